"""app/clients.py: the client's address through trusted proxies, and seats counted by a key function.

A school reaches a public server through one NAT address: its students count against their room,
not against the address; anonymous tabs keep the per-address limit. Forwarded headers are believed
only from proxies the deployment named.
"""

import json
from types import SimpleNamespace

import pytest
from werkzeug.datastructures import Headers

from app.clients import Seat, client_address, client_scheme, parse_networks
from conftest import TIMEOUT, WS, Client, healthz, wait_for


class HeaderWS(WS):
    """WS with extra handshake headers (what a proxy would add)."""

    def __init__(self, url: str, headers: dict):
        self.client = Client.connect(url, headers=headers)
        self.backlog, self.counter = [], 0
        raw = self.client.receive(TIMEOUT)
        assert raw is not None, "no hello from the server"
        self.hello = json.loads(raw)


def forwarded(*values) -> Headers:
    return Headers([("X-Forwarded-For", v) for v in values])


# ---- the address, unit by unit ---------------------------------------------------------------
def test_with_no_proxy_named_forwarded_headers_are_ignored():
    assert client_address("198.51.100.9", forwarded("203.0.113.1"), (), "X-Forwarded-For") == "198.51.100.9"


def test_a_trusted_proxy_names_the_right_most_untrusted_hop():
    proxies = parse_networks("10.0.0.0/8 192.0.2.1")
    # the client wrote a fake first hop; our proxies appended the real one and themselves
    headers = forwarded("1.2.3.4, 203.0.113.7", "10.1.1.1")
    assert client_address("192.0.2.1", headers, proxies, "X-Forwarded-For") == "203.0.113.7"


def test_an_untrusted_peer_is_the_client_whatever_it_forwards():
    proxies = parse_networks("10.0.0.5")
    assert client_address("198.51.100.9", forwarded("203.0.113.1"), proxies, "X-Forwarded-For") == "198.51.100.9"


def test_a_proxy_without_the_header_is_counted_itself():
    proxies = parse_networks("10.0.0.5")
    assert client_address("10.0.0.5", Headers(), proxies, "X-Forwarded-For") == "10.0.0.5"
    assert client_address("10.0.0.5", forwarded("not an address"), proxies, "X-Forwarded-For") == "10.0.0.5"


def test_the_scheme_comes_from_a_trusted_proxy_only():
    proxies = parse_networks("10.0.0.5")
    headers = Headers([("X-Forwarded-Proto", "https")])
    assert client_scheme("10.0.0.5", headers, "http", proxies) == "https"
    assert client_scheme("198.51.100.9", headers, "http", proxies) == "http"
    assert client_scheme("10.0.0.5", headers, "http", ()) == "http"


def test_trusted_proxies_must_be_addresses():
    from app.config import ServerConfig
    from core.errors import InvalidParameter
    with pytest.raises(InvalidParameter) as info:
        ServerConfig(model="tiny", trusted_proxies="proxy.example")
    assert info.value.param == "trusted_proxies"


# ---- on a server -----------------------------------------------------------------------------
def serve(tiny_loaded, settings: dict):
    from app import create_app
    from app.loopback import serve as serve_on_loopback
    app = create_app({"model": "tiny", "num_kv_blocks": 128, "testing": True, "default_max_tokens": 2,
                      **settings}, loaded=tiny_loaded)
    served = serve_on_loopback(app)

    def stop():
        served.stop()
        app.extensions["sendlens"].shutdown()
    return SimpleNamespace(app=app, runtime=app.extensions["sendlens"], port=served.port, stop=stop,
                           http=served.http, ws=served.ws)


def test_behind_a_named_proxy_each_forwarded_address_has_its_own_seats(tiny_loaded):
    server = serve(tiny_loaded, {"trusted_proxies": "127.0.0.1", "max_connections_per_address": 2})
    opened = []
    try:
        opened += [HeaderWS(server.ws, {"X-Forwarded-For": "203.0.113.1"}) for _ in range(2)]
        third = HeaderWS(server.ws, {"X-Forwarded-For": "203.0.113.1"})
        assert third.hello["type"] == "error" and third.hello["code"] == "overloaded"
        third.close()
        other = HeaderWS(server.ws, {"X-Forwarded-For": "203.0.113.2"})
        opened.append(other)
        assert other.hello["type"] == "hello"
    finally:
        for ws in opened:
            ws.close()
        server.stop()


def test_without_a_named_proxy_a_forged_header_gets_no_extra_seat(tiny_loaded):
    server = serve(tiny_loaded, {"max_connections_per_address": 2})
    opened = []
    try:
        opened += [HeaderWS(server.ws, {"X-Forwarded-For": f"203.0.113.{i}"}) for i in (1, 2)]
        third = HeaderWS(server.ws, {"X-Forwarded-For": "203.0.113.3"})
        assert third.hello["type"] == "error" and "max_connections_per_address" in third.hello["message"]
        third.close()
    finally:
        for ws in opened:
            ws.close()
        server.stop()


ROOM_SIZE = 40


def test_forty_students_of_one_room_from_one_address_join_and_chat(tiny_loaded):
    """The seat hook as a rooms module would use it: a connection that names a room counts against
    the room's limit; one that does not keeps the per-address limit (16 by default)."""
    server = serve(tiny_loaded, {})
    runtime = server.runtime
    per_address = runtime.config.max_connections_per_address

    def seat_for(request):
        room = request.args.get("room")
        return Seat(f"room:{room}", ROOM_SIZE, "the room's seats") if room else runtime.address_seat(request)
    runtime.seat_for = seat_for
    students, tabs = [], []     # every client is closed in finally: an open one's thread would keep pytest alive
    try:
        students = [WS(server.ws + "?room=r1") for _ in range(ROOM_SIZE)]
        assert [s.hello["type"] for s in students] == ["hello"] * ROOM_SIZE, [s.hello for s in students]
        ids = [s.start(prompt=f"Student {i} says", max_tokens=2) for i, s in enumerate(students)]
        done = [s.finish(mid).done for s, mid in zip(students, ids)]
        assert all(d is not None and d["finish_reason"] in ("length", "stop") for d in done), done
        tabs = [WS(server.ws) for _ in range(per_address)]
        assert [t.hello["type"] for t in tabs] == ["hello"] * per_address, [t.hello for t in tabs]
        tabs.append(WS(server.ws))
        extra = tabs[-1].hello
        assert extra["type"] == "error" and extra["code"] == "overloaded", extra
        assert "max_connections_per_address" in extra["message"]
    finally:
        for ws in students + tabs:
            ws.close()
        try:
            wait_for(lambda: healthz(server)["connections"] == 0, timeout=30, what="every connection to close")
        finally:
            server.stop()


def test_behind_a_tls_proxy_an_https_page_opens_the_socket_and_an_http_one_does_not(tiny_loaded):
    """The proxy ends TLS and says so in X-Forwarded-Proto: the origin's scheme is compared with it."""
    import base64
    import http.client
    import os
    server = serve(tiny_loaded, {"trusted_proxies": "127.0.0.1"})

    def handshake(origin: str, proto: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            conn.request("GET", "/ws", headers={
                "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(), "Origin": origin,
                "Host": "localhost", "X-Forwarded-Proto": proto, "X-Forwarded-For": "203.0.113.9"})
            return conn.getresponse().status
        finally:
            conn.close()
    try:
        assert handshake("https://localhost", "https") == 101
        assert handshake("http://localhost", "https") == 403
        assert handshake("https://localhost", "http") == 403
    finally:
        server.stop()
