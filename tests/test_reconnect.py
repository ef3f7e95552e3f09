"""Every widget survives a dropped connection: on its embed page, once it is ready, the websocket
is closed under it; the widget says it lost the connection, and when the socket is back it is ready
again and has asked the server anew over the new socket (one seam: ctx.connected in static/js/main.js).

The page's WebSocket is wrapped by an init script (the client has no test hook): the wrapper keeps
every socket the page opens, counts what each sends, and while `window.__wsBlocked` is set, points
new sockets at a closed port, so the reconnecting client fails until the test lets it through. The
socket is closed from the page, as a dropped connection reads to the client (not the server's idle
close, after which the client waits quietly). The script also keeps the page from storing its last
live result, and the server serves no recordings, so the embed has none to fall back on and says
that it lost the connection (its fallback to a recording: tests/test_embed_fallback.py).
"""

from types import SimpleNamespace

import pytest

from app.widgets import BY_NAME
from conftest import Tabs, serve_app, wait_ready

pytestmark = pytest.mark.browser

NAMES = sorted(BY_NAME)
READY_MS = 120_000  # a widget's first measurement on a shared machine


@pytest.fixture(scope="module")
def tiny_server(tiny_loaded):
    """The tiny model with the default limits (as the export records every widget on it): what is
    tested is the page's connection, which no model changes, so the real-model server's process
    (tests/xdist_groups.py), the suite's longest, does not wait on these reconnections."""
    yield from serve_app({"model": "tiny", "testing": True}, tiny_loaded)


@pytest.fixture(scope="module")
def watched(browser, tiny_server):
    """The tiny server, and a kept tab of this module's own (conftest.Tabs) with WRAP_WEBSOCKET
    run before every page (added once: init scripts stay with the tab, which is why no other
    module may reuse it)."""
    server = SimpleNamespace(base=tiny_server.http, port=tiny_server.port)
    tabs = Tabs(browser)
    page = tabs.page(server)
    page.page.add_init_script(WRAP_WEBSOCKET)
    page.detach()
    yield tabs, server
    tabs.close()


@pytest.fixture
def pg(watched):
    tabs, server = watched
    page = tabs.page(server)
    yield page
    page.detach()

WRAP_WEBSOCKET = """
(() => {
  const Native = window.WebSocket;
  window.__sockets = [];
  window.__wsBlocked = false;
  class Watched extends Native {
    constructor(url, protocols) {
      super(window.__wsBlocked ? "ws://127.0.0.1:9/ws" : url, protocols);
      this.__sent = [];
      window.__sockets.push(this);
    }
    send(data) {
      this.__sent.push(String(data));
      return super.send(data);
    }
  }
  window.WebSocket = Watched;
  Storage.prototype.setItem = () => {};   // no last live result to fall back on (static/js/source.js)
})();
"""


def requests_sent(page, index: int) -> int:
    """Messages other than aborts that the page's socket number `index` has sent."""
    return page.evaluate("""(i) => window.__sockets[i].__sent
        .filter((text) => JSON.parse(text).type !== "abort").length""", index)


@pytest.mark.parametrize("name", NAMES)
def test_widget_comes_back_after_the_socket_drops(pg, name):
    page = pg.page
    pg.goto(f"/embed/{name}")
    root = f'[data-widget="{name}"]'
    wait_ready(page, root, READY_MS)
    first = page.evaluate("() => window.__sockets.length") - 1
    asked_before = requests_sent(page, first)

    page.evaluate("() => { window.__wsBlocked = true; window.__sockets.at(-1).close(); }")
    page.wait_for_selector(f'{root}[data-state="error"]', timeout=30_000)
    alert = page.locator(f"{root} > .widget-error").inner_text()
    assert "connection" in alert.lower(), alert

    page.evaluate("() => { window.__wsBlocked = false; }")
    page.wait_for_function("""([root, first]) => {
        const live = window.__sockets.filter((s, i) => i > first && s.readyState === WebSocket.OPEN);
        return live.length > 0 && document.querySelector(root).dataset.state === "ready";
    }""", arg=[root, first], timeout=READY_MS)
    # the widget ran again over the new socket: if it asked the server anything before the drop,
    # it asked again after it
    last = page.evaluate("() => window.__sockets.length") - 1
    assert last > first
    if asked_before:
        assert requests_sent(page, last) >= 1, f"{name} is ready but sent nothing over the new socket"
    assert page.locator(f"{root} > .widget-error").count() == 0
    assert pg.page_errors == [], pg.page_errors
