"""Helpers for the rooms' server tests: an app of its own (tiny model, its own SQLite file)
served on loopback, HTTP without following redirects (to see cookies and 303s), and websocket
clients that carry a room's cookies in the handshake, as a browser does."""

import http.client
import json
import urllib.parse
from types import SimpleNamespace

from conftest import WS, Client

ROOM_SETTINGS = {"model": "tiny", "num_kv_blocks": 64, "room_kv_blocks": 128, "max_tokens_limit": 64,
                 "default_max_tokens": 8, "testing": True}


def start(loaded, db_path, **settings) -> SimpleNamespace:
    from app import create_app
    from app.loopback import serve
    app = create_app({**ROOM_SETTINGS, "rooms_db_path": str(db_path), **settings}, loaded=loaded)
    served = serve(app, name="rooms-test-server")

    def stop():
        served.stop()
        app.extensions["sendlens_rooms"].shutdown()
        app.extensions["sendlens"].shutdown()
    return SimpleNamespace(app=app, port=served.port, http=served.http, ws=served.ws,
                           rooms=app.extensions["sendlens_rooms"], stop=stop)


def request(srv, method: str, path: str, cookies: dict | None = None, form: dict | None = None):
    """-> (status, headers as a dict of lists, body text); redirects are not followed."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    headers = {}
    if cookies:
        headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
    body = None
    if form is not None:
        body = urllib.parse.urlencode(form)
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    out = {}
    for k, v in resp.getheaders():
        out.setdefault(k.lower(), []).append(v)
    text = resp.read().decode("utf-8", "replace")
    conn.close()
    return resp.status, out, text


def cookie(headers: dict, name: str) -> str | None:
    for line in headers.get("set-cookie", []):
        key, _, rest = line.partition("=")
        if key == name:
            return rest.split(";")[0]
    return None


def new_room(srv) -> tuple[str, dict]:
    """-> (code, the presenter's cookies)."""
    status, headers, _ = request(srv, "GET", "/room/new")
    assert status == 303, status
    code = headers["location"][0].split("/")[-2]
    return code, {f"sendlens_presenter_{code}": cookie(headers, f"sendlens_presenter_{code}")}


def join(srv, code: str, name: str) -> dict:
    """-> the student's cookies."""
    status, headers, body = request(srv, "POST", f"/room/{code}/join", form={"display_name": name})
    assert status == 303, (status, body[-500:])
    return {f"sendlens_student_{code}": cookie(headers, f"sendlens_student_{code}")}


class RoomWS(WS):
    """conftest's WS, with cookies in the handshake."""

    def __init__(self, url: str, cookies: dict):
        header = "; ".join(f"{k}={v}" for k, v in cookies.items())
        self.client = Client.connect(url, headers={"Cookie": header} if header else None)
        self.backlog, self.counter = [], 0
        self.hello = json.loads(self.client.receive(60))

    def updates(self, mid, until, timeout: float = 60.0) -> list[dict]:
        """room_update messages for the watch `mid` until until(update) is true."""
        got = []
        while True:
            m = self.recv_for(mid, timeout=timeout)
            assert m["type"] == "room_update", m
            got.append(m)
            if until(m):
                return got
