"""The static export (app/export.py) in Chromium: its widgets play recordings with no server.

One export per module, recorded from the session's tiny live server (`live_server`) for every
widget (its defaults, and the presets docs/widgets.md names for the export),
served by `python -m http.server` on loopback. Every recorded widget reaches data-state="ready"
with data-source="recording", opens no websocket, requests nothing outside the export and logs no
error; a reader's own text says it needs the live server; "Run it live" (?server=) turns a widget
live on the live server, whose allowed_origins admit the export's origin.
"""

import contextlib
import io
import json
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest

from conftest import axe_blocking, free_port, serve_app

pytestmark = pytest.mark.browser

# every widget, recorded on the tiny model (about 100 s on two cores: a page load each)
from app.widgets import BY_NAME  # noqa: E402

WIDGETS = list(BY_NAME)


@pytest.fixture(scope="module")
def recording_server(tiny_loaded):
    """The tiny model served with the default limits, as `python -m app.export --model tiny` serves
    it (the live server's small test limits refuse some widgets' default texts)."""
    yield from serve_app({"model": "tiny", "testing": True}, tiny_loaded)


@contextlib.contextmanager
def static_host(out):
    """`python -m http.server` serving the folder `out` on a free loopback port: its base URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "-d", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):   # hang-stopping only: http.server binds in well under a second
            try:
                urllib.request.urlopen(base + "/index.html", timeout=5).close()
                break
            except OSError:
                time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def exported(recording_server, browser, tmp_path_factory):
    from app.export import export
    out = tmp_path_factory.mktemp("export")
    log = io.StringIO()
    recordings = export(out, app=recording_server.app, base=recording_server.http, names=WIDGETS, log=log,
                        browser=browser)
    with static_host(out) as base:
        yield SimpleNamespace(out=out, base=base, recordings=recordings, log=log.getvalue())


class StaticPage:
    """A page that may reach only `origins`; its console errors, websockets and outside requests
    are kept."""

    def __init__(self, context, origins):
        self.origins = origins
        self.errors, self.blocked, self.sockets = [], [], []
        context.route("**/*", self._route)
        self.page = context.new_page()
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("websocket", lambda ws: self.sockets.append(ws.url))
        self.page.set_default_timeout(30_000)

    def _route(self, route):
        url = route.request.url
        if any(url.startswith(o + "/") for o in self.origins):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()


@pytest.fixture
def static_page(browser, exported):
    """A page that may reach the export only (a test that runs it live adds the live server)."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        yield StaticPage(context, [exported.base])
    finally:
        context.close()


def test_export_writes_every_page_and_the_recordings(exported):
    from app.export import jobs_for
    from app.widgets import BY_NAME
    assert (exported.out / "index.html").is_file()
    for name in BY_NAME:
        assert (exported.out / "embed" / name / "index.html").is_file(), name
    assert (exported.out / "vendor" / "plotly.min.js").stat().st_size > 0
    index = json.loads((exported.out / "recordings" / "index.json").read_text())
    assert [(e["widget"], e["options"]) for e in index["recordings"]] == jobs_for(WIDGETS)
    # progress: a line when each recording starts and one when it ends
    assert exported.log.count("recording ") == len(index["recordings"])
    html = (exported.out / "embed" / "tokenizer" / "index.html").read_text()
    assert 'src="/' not in html and 'href="/' not in html, "an export's URLs must be relative"


def test_every_widget_plays_its_recording_without_a_server(static_page, exported, artifacts_dir):
    page = static_page.page
    for name in WIDGETS:
        page.goto(f"{exported.base}/embed/{name}/index.html")
        root = page.locator(f'[data-widget="{name}"]')
        page.wait_for_selector(f'[data-widget="{name}"][data-state="ready"]', timeout=60_000)
        assert root.get_attribute("data-source") == "recording", name
        assert "recorded on" in page.locator(".source-bar").inner_text()
        if name == "tokenizer":
            badge = root.locator(".badge[data-recorded]").first
            assert badge.inner_text().startswith("recorded on "), badge.inner_text()
            page.screenshot(path=str(artifacts_dir / "export-tokenizer-1280.png"))
            assert axe_blocking(page) == []
    # the walkthrough: every widget on one page, each from its recording
    page.goto(f"{exported.base}/index.html")
    for name in WIDGETS:
        root = page.locator(f'[data-widget="{name}"]')
        root.scroll_into_view_if_needed()
        page.wait_for_selector(f'[data-widget="{name}"][data-state="ready"]', timeout=60_000)
        assert root.get_attribute("data-source") == "recording", name
    # in a 600x450 iframe of another page, and on a phone: no sideways scrolling
    # a page of the export's origin with no script (http.server's listing of a folder; it sends no CSP)
    page.goto(f"{exported.base}/recordings/")
    page.set_content(f'<iframe src="{exported.base}/embed/attention/index.html" width="600" height="450" '
                     'style="border:1px solid #ccc"></iframe>')
    page.frame_locator("iframe").locator('[data-widget="attention"][data-state="ready"]').wait_for(timeout=60_000)
    page.locator("iframe").screenshot(path=str(artifacts_dir / "export-attention-iframe-600x450.png"))
    assert page.frames[1].evaluate("() => document.documentElement.scrollWidth - window.innerWidth") <= 0
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{exported.base}/embed/tokenizer/index.html")
    page.wait_for_selector('[data-widget="tokenizer"][data-state="ready"]')
    page.screenshot(path=str(artifacts_dir / "export-tokenizer-390.png"))
    assert page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth") <= 0
    assert static_page.sockets == [], static_page.sockets
    assert static_page.blocked == [], static_page.blocked
    assert static_page.errors == [], static_page.errors


def test_a_readers_own_text_needs_the_live_server(static_page, exported, artifacts_dir):
    page = static_page.page
    page.goto(f"{exported.base}/embed/tokenizer/index.html")
    page.wait_for_selector('[data-widget="tokenizer"][data-state="ready"]')
    page.fill('[data-widget="tokenizer"] textarea', "My very own words")
    page.wait_for_selector('[data-widget="tokenizer"][data-state="error"]')
    assert "needs the live server" in page.locator('[data-widget="tokenizer"] .widget-error').inner_text()
    page.screenshot(path=str(artifacts_dir / "export-tokenizer-needs-live-1280.png"))
    assert static_page.sockets == []


def test_run_it_live_turns_a_widget_live(static_page, exported, live_server, artifacts_dir):
    origins = live_server.app.extensions["sendlens_allowed_origins"]
    origins.add(exported.base)   # the live server's own rule: the export's origin may open its socket
    static_page.origins.append(live_server.http)
    try:
        page = static_page.page
        page.goto(f"{exported.base}/embed/tokenizer/index.html?server={live_server.http}")
        root = page.locator('[data-widget="tokenizer"]')
        page.wait_for_selector('[data-widget="tokenizer"][data-state="ready"]')
        assert root.get_attribute("data-source") == "recording"
        assert static_page.sockets == []
        page.screenshot(path=str(artifacts_dir / "export-tokenizer-run-it-live-button-1280.png"))
        page.click("button.run-live")
        page.wait_for_selector('[data-widget="tokenizer"][data-source="live"][data-state="ready"]')
        assert static_page.sockets == [live_server.ws]
        page.fill('[data-widget="tokenizer"] textarea', "My very own words")
        page.wait_for_function("() => document.querySelector('[data-figure=\"num_words\"]')?.dataset.value === '4'")
        assert root.get_attribute("data-state") == "ready"
        page.screenshot(path=str(artifacts_dir / "export-tokenizer-live-1280.png"))
        assert static_page.errors == [] and static_page.blocked == []
    finally:
        origins.discard(exported.base)


def test_run_it_live_on_a_server_that_refuses_the_origin_goes_back_to_the_recording(static_page, exported,
                                                                                     live_server):
    static_page.origins.append(live_server.http)
    page = static_page.page
    page.goto(f"{exported.base}/embed/tokenizer/index.html?server={live_server.http}")
    page.wait_for_selector('[data-widget="tokenizer"][data-state="ready"]')
    page.click("button.run-live")
    page.wait_for_selector('.source-bar:has-text("allowed_origins") + [data-widget="tokenizer"]'
                           '[data-source="recording"][data-state="ready"]')
    assert page.locator("button.run-live").count() == 1
    static_page.errors.clear()   # Chromium logs the refused handshake (403) itself


def test_an_export_is_reproducible_and_its_server_runs_it_live(exported, recording_server, browser, live_server,
                                                               tmp_path, artifacts_dir):
    """Recorded again from the same commit, model and machine, an export's recordings are the same
    but for their date (a widget that measures time would differ in its timings too: these two
    measure none). Exported with `server`, a page offers Run it live on that server with no ?server=."""
    from app.export import export
    names = ["tokenizer", "embedding"]
    again = export(tmp_path, app=recording_server.app, base=recording_server.http, names=names,
                   server=live_server.http, log=io.StringIO(), browser=browser)
    first = {(r["widget"], json.dumps(r["options"], sort_keys=True)): r for r in exported.recordings}
    assert again and {r["widget"] for r in again} == set(names)
    for r in again:
        before = first[(r["widget"], json.dumps(r["options"], sort_keys=True))]
        assert {k: v for k, v in r.items() if k != "date"} == {k: v for k, v in before.items() if k != "date"}, r["widget"]
    origins = live_server.app.extensions["sendlens_allowed_origins"]
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    with static_host(tmp_path) as base:
        origins.add(base)
        try:
            static = StaticPage(context, [base, live_server.http])
            page = static.page
            page.goto(f"{base}/embed/tokenizer/index.html")
            page.wait_for_selector('[data-widget="tokenizer"][data-source="recording"][data-state="ready"]')
            page.click("button.run-live")
            page.wait_for_selector('[data-widget="tokenizer"][data-source="live"][data-state="ready"]')
            assert static.sockets == [live_server.ws]
            assert static.errors == [] and static.blocked == []
        finally:
            origins.discard(base)
            context.close()
