"""app/security.py: trusted hosts, the websocket's origin check, headers on every response."""

import base64
import http.client
import os

import pytest

from app.security import machine_names
from conftest import author_page


@pytest.fixture(scope="module")
def client(live_server):
    return live_server.app.test_client()


@pytest.mark.parametrize("path", ["/", "/healthz", "/embed/chat", "/static/css/sendlens.css", "/nowhere"])
def test_every_response_has_the_headers(client, path):
    resp = client.get(path)
    resp.close()                                   # a static file is streamed: close it
    assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert resp.headers["Referrer-Policy"] == "no-referrer"


@pytest.mark.parametrize("host", ["evil.example", "attacker.test:8000", "localhost.evil.example"])
def test_an_untrusted_host_is_refused(client, host):
    """DNS rebinding: a page of another site that resolves its own name to this machine."""
    resp = client.get("/", headers={"Host": host})
    assert resp.status_code == 400
    assert client.get("/healthz", headers={"Host": host}).status_code == 400


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1:8000"])
def test_the_machines_own_names_are_trusted(client, host):
    assert client.get("/healthz", headers={"Host": host}).status_code == 200


def test_snippets_use_the_trusted_host_only(client):
    page = client.get("/", headers={"Host": "127.0.0.1:8000"}).get_data(as_text=True)
    assert 'data-base="http://127.0.0.1:8000/embed/chat"' in page


def test_configured_hosts_are_trusted(tiny_loaded):
    from app import create_app
    app = create_app({"model": "tiny", "num_kv_blocks": 8, "testing": True,
                      "trusted_hosts": "sendlens.school.example"}, loaded=tiny_loaded)
    try:
        c = app.test_client()
        assert c.get("/healthz", headers={"Host": "sendlens.school.example"}).status_code == 200
        assert c.get("/healthz", headers={"Host": "other.example"}).status_code == 400
    finally:
        app.extensions["sendlens"].shutdown()


def test_machine_names_include_loopback():
    names = machine_names()
    assert {"localhost", "127.0.0.1", "::1"} <= set(names)


def handshake(port: int, origin):
    """Open /ws as a browser would, with an Origin header; the status the server answered
    (101: upgraded to a websocket; 403: refused before the upgrade)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode()}
    if origin is not None:
        headers["Origin"] = origin
    try:
        conn.request("GET", "/ws", headers=headers)
        resp = conn.getresponse()
        return resp.status
    finally:
        conn.close()


@pytest.mark.parametrize("origin", ["https://evil.example", "http://evil.example:{port}", "null", "file://",
                                    "http://127.0.0.1:1", "chrome-extension://abc"])
def test_a_foreign_origin_cannot_open_the_websocket(live_server, origin):
    assert handshake(live_server.port, origin.format(port=live_server.port)) == 403


@pytest.mark.parametrize("origin", ["https://127.0.0.1:{port}", "https://localhost:{port}"])
def test_an_origin_of_the_other_scheme_cannot_open_the_websocket(live_server, origin):
    """This server speaks http: an https page of the same host and port may open wss:// only,
    which this server does not serve, so its handshake is refused."""
    assert handshake(live_server.port, origin.format(port=live_server.port)) == 403


def test_origin_schemes_pair_http_with_ws_and_https_with_wss():
    from app.security import origin_allowed
    trusted = ["sendlens.example"]
    assert origin_allowed("https://sendlens.example", "sendlens.example", trusted, set(), "https")
    assert not origin_allowed("http://sendlens.example", "sendlens.example", trusted, set(), "https")
    assert not origin_allowed("https://sendlens.example", "sendlens.example", trusted, set(), "http")
    assert origin_allowed("http://sendlens.example", "sendlens.example", trusted, set(), "http")


@pytest.mark.parametrize("origin", ["http://127.0.0.1:{port}", "http://localhost:{port}", None])
def test_the_sites_own_origin_opens_the_websocket(live_server, origin):
    assert handshake(live_server.port, origin.format(port=live_server.port) if origin else None) == 101


def test_an_allowed_origin_opens_the_websocket(tiny_loaded):
    import threading

    from werkzeug.serving import make_server

    from app import create_app
    app = create_app({"model": "tiny", "num_kv_blocks": 8, "testing": True,
                      "allowed_origins": "https://teacher.example"}, loaded=tiny_loaded)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert handshake(server.server_port, "https://teacher.example") == 101
        assert handshake(server.server_port, "https://student-site.example") == 403
    finally:
        server.shutdown()
        server.server_close()
        app.extensions["sendlens"].shutdown()


# ---- in a browser: a page of another site ----------------------------------------------------
@pytest.mark.browser
@pytest.mark.real_model
def test_a_foreign_page_cannot_drive_the_websocket_but_can_embed(browser, server, artifacts_dir):
    """Another origin on loopback (127.0.0.2) serves a page that frames a sendlens embed and tries
    to open sendlens' websocket itself. The embed works (its socket comes from sendlens' origin);
    the page's own socket is refused before the upgrade."""
    page_html = f"""<!doctype html><title>pending</title>
<iframe src="{server.base}/embed/tokenizer" width="600" height="450"></iframe>
<script>
const ws = new WebSocket("ws://127.0.0.1:{server.port}/ws");
ws.onopen = () => {{ document.title = "opened"; }};
ws.onerror = () => {{ document.title = "refused"; }};
</script>"""

    foreign = author_page(page_html, host="127.0.0.2")   # another site than the server's
    context = browser.new_context(viewport={"width": 800, "height": 600})
    try:
        page = context.new_page()
        page.goto(foreign)
        page.wait_for_function("() => document.title !== 'pending'", timeout=30_000)
        assert page.title() == "refused"
        frame = page.frame_locator("iframe")
        frame.locator('[data-widget="tokenizer"][data-state="ready"]').wait_for(timeout=60_000)
        page.screenshot(path=str(artifacts_dir / "foreign-origin-embed.png"))
    finally:
        context.close()
