"""Embeds that degrade instead of failing (static/js/source.js), in Chromium.

Two embeds in 600x450 iframes (sharing one socket: static/js/socket-worker.js) reach the
session's tiny live server through a TCP door this test holds (so the test can cut every connection and stop answering, as a stopped server does, without
stopping the shared server). The server refuses new connections with `overloaded` (its own
refusal: open_connection says it is full), then the door stops answering; the embeds show a
recording, badged with the reason, the tokenizer its own last live result (localStorage) and the
embedding the one the server serves from `recordings_dir` (its localStorage cleared); once the
server answers again, both go live by themselves.
"""

import io
import socket
import threading

import pytest

from conftest import author_page, axe_blocking

pytestmark = pytest.mark.browser

EMBEDS = ["tokenizer", "embedding"]
TIMEOUT = 60_000   # ms; hang-stopping only: the client retries with backoff up to 8 s apart


class Door:
    """A TCP relay from a loopback port to the live server: open(), then shut() drops every
    connection and refuses new ones, open() again on the same port."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.port = None
        self.listener = None
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()

    def open(self):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port or 0))
        s.listen(64)
        self.port = s.getsockname()[1]
        self.listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s):
        while True:
            try:
                client, _ = s.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        """Drop every relayed connection (the listener stays)."""
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def shut(self):
        try:
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the accept() (a close alone leaves it listening)
        except OSError:
            pass
        self.listener.close()
        self.cut()


@pytest.fixture
def door(live_server):
    d = Door(live_server.port)
    d.open()
    try:
        yield d
    finally:
        d.shut()


def roots(page):
    return {name: page.frame_locator(f'iframe[title="{name}"]').locator(f'[data-widget="{name}"]') for name in EMBEDS}


def wait_all(page, selector_for):
    for name in EMBEDS:
        page.frame_locator(f'iframe[title="{name}"]').locator(selector_for(name)).wait_for(timeout=TIMEOUT)


def test_embeds_fall_back_to_recordings_and_come_back_live(browser, live_server, door, monkeypatch, tmp_path,
                                                           artifacts_dir):
    from app.recordings import store
    from app.recordings.recorder import record

    # the server's own recording of the embedding's default options (python -m app.export's recorder)
    [served] = record(live_server.http, [("embedding", {})], log=io.StringIO(), browser=browser)
    store.write(tmp_path, store.file_name("embedding", 0), served)
    monkeypatch.setattr(live_server.app.config["SENDLENS"], "recordings_dir", str(tmp_path))

    base = f"http://127.0.0.1:{door.port}"
    context = browser.new_context(viewport={"width": 1280, "height": 1000}, bypass_csp=True)   # bypass: axe below
    page = context.new_page()
    page_errors = []
    page.on("pageerror", lambda e: page_errors.append(str(e)))
    try:
        yield_page_on_failure = artifacts_dir / "fallback-failure.png"
        frames = "".join(f'<iframe title="{n}" src="{base}/embed/{n}" width="600" height="450" '
                         f'style="border:1px solid #ccc;display:block;margin:8px"></iframe>' for n in EMBEDS)
        # an author's page on another site (another loopback port: Chromium's local network checks
        # keep a public page's frames off loopback)
        page.goto(author_page(f"<!doctype html><body>{frames}</body>"))
        wait_all(page, lambda n: f'[data-widget="{n}"][data-source="live"][data-state="ready"]')
        # the tokenizer keeps its last live result; the embedding forgets its own (the server's serves)
        tok = next(f for f in page.frames if f.url.endswith("/embed/tokenizer"))
        emb = next(f for f in page.frames if f.url.endswith("/embed/embedding"))
        tok.wait_for_function("() => Object.keys(localStorage).some((k) => k.startsWith('sendlens:last-live:tokenizer'))",
                              timeout=TIMEOUT)
        emb.wait_for_function("() => Object.keys(localStorage).some((k) => k.startsWith('sendlens:last-live:embedding'))",
                              timeout=TIMEOUT)
        emb.evaluate("() => Object.keys(localStorage).filter((k) => k.startsWith('sendlens:last-live:embedding'))"
                     ".forEach((k) => localStorage.removeItem(k))")

        # 1. overloaded: the server refuses every new connection, and the open ones are cut
        refuse = lambda seat: "the server already has 4 connections (max_connections); try again shortly"  # noqa: E731
        monkeypatch.setattr(live_server.runtime, "open_connection", refuse)
        door.cut()
        wait_all(page, lambda n: f'.source-bar:has([data-fallback="overloaded"]) + [data-widget="{n}"][data-source="recording"][data-state="ready"]')
        for name, frame in (("tokenizer", tok), ("embedding", emb)):
            assert "recorded on" in frame.locator(".source-bar").inner_text(), name
        page.locator('iframe[title="tokenizer"]').screenshot(path=str(artifacts_dir / "fallback-tokenizer-iframe-600x450.png"))
        page.locator('iframe[title="embedding"]').screenshot(path=str(artifacts_dir / "fallback-embedding-iframe-600x450.png"))
        # a reader who opens the embed now, at 1280x800: refused from the start, it shows the
        # server's recording at once
        alone = context.new_page()
        alone.set_viewport_size({"width": 1280, "height": 800})
        alone.goto(f"{base}/embed/embedding")
        alone.wait_for_selector('.source-bar:has([data-fallback="overloaded"]) + [data-widget="embedding"]'
                                '[data-source="recording"][data-state="ready"]', timeout=TIMEOUT)
        alone.screenshot(path=str(artifacts_dir / "fallback-embedding-1280.png"))
        assert axe_blocking(alone) == []
        alone.set_viewport_size({"width": 390, "height": 844})
        alone.reload()   # drawn afresh at a phone's width
        alone.wait_for_selector('.source-bar:has([data-fallback="overloaded"]) + [data-widget="embedding"]'
                                '[data-source="recording"][data-state="ready"]', timeout=TIMEOUT)
        alone.screenshot(path=str(artifacts_dir / "fallback-embedding-390.png"))
        assert alone.evaluate("() => document.documentElement.scrollWidth - window.innerWidth") <= 0
        alone.close()

        # 2. stopped: nothing answers on the server's port
        door.shut()
        monkeypatch.setattr(live_server.runtime, "open_connection", live_server.runtime.__class__.open_connection
                            .__get__(live_server.runtime))   # it would admit again: no connection reaches it
        wait_all(page, lambda n: f'.source-bar:has([data-fallback="unreachable"]) + [data-widget="{n}"][data-source="recording"]')

        # 3. back: both embeds go live again by themselves
        door.open()
        wait_all(page, lambda n: f'[data-widget="{n}"][data-source="live"][data-state="ready"]')
        for frame in (tok, emb):
            assert frame.locator(".source-bar").inner_text() == ""
        assert page_errors == []
    except Exception:
        page.screenshot(path=str(yield_page_on_failure))
        raise
    finally:
        context.close()
