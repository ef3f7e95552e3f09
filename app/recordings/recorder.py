"""Recording widgets through the real engine: Chromium opens each widget's embed page on a running
sendlens server (loopback), the page's own client sends exactly the messages the widget sends,
and the tap on that client (static/js/source.js, window.sendlensTaps) keeps every exchange that
ended well. Once the widget is ready and nothing is in flight, its exchanges, the server's hello
and the page's machine/engine/model make one recording. A few widgets record at once, each on its
own page, and the recordings come back in the order of the jobs.

Nothing is fetched from anywhere but that server: every other request is refused (and counted
as a failure). Progress goes to `log` (stderr), one line per recording.
"""

import json
import sys
import time
from pathlib import Path
from urllib.parse import urlencode, urlsplit

from . import FORMAT
from .meta import now
from .schema import validate

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SETTLE_S = 1.5          # no new exchange for this long, and nothing in flight: the widget is done
                        # (a widget that polls, such as paging every 0.5 s, repeats one key: not new)
PAGES_AT_ONCE = 3       # widgets recorded side by side: one page waits on the engine or settles
                        # while another loads (each page has its own socket and requests)
POLL_S = 0.1            # how often each open page is read


class RecordingFailed(RuntimeError):
    """A widget did not reach ready, or its page asked for something outside the server."""


def chromium_path() -> str:
    import os
    path = os.environ.get("SENDLENS_CHROMIUM", "/usr/bin/chromium")
    if not Path(path).exists():
        raise RecordingFailed(f"no Chromium at {path}: the recorder drives each widget's page in it "
                              "(install Debian's chromium package, as `make test` does, or set SENDLENS_CHROMIUM)")
    return path


def record(base: str, jobs: list[tuple[str, dict]], *, log=sys.stderr, timeout_s: float = 900,
           browser=None) -> list[dict]:
    """Record each (widget, options) of `jobs` from the server at `base` (http://127.0.0.1:PORT),
    in `browser` (a Playwright Chromium; None: one started here). Returns the recordings, checked
    against the schema, in the order of `jobs`."""
    if browser is not None:
        return _record_in(browser, base, jobs, log, timeout_s)
    from playwright.sync_api import sync_playwright
    pw = sync_playwright().start()
    try:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            return _record_in(browser, base, jobs, log, timeout_s)
        finally:
            browser.close()
    finally:
        pw.stop()


def _record_in(browser, base: str, jobs: list[tuple[str, dict]], log, timeout_s: float) -> list[dict]:
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(base))
    outside: list[str] = []

    def route(r):
        url = r.request.url
        if url == origin or url.startswith(origin + "/"):
            r.continue_()
        else:
            outside.append(url)
            r.abort()

    done: dict[int, dict] = {}
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        context.route("**/*", route)
        started = time.monotonic()
        waiting = list(enumerate(jobs, 1))
        open_: list[Recording] = []
        tabs: list = []                  # free tabs: a tab's next widget reuses its compiled scripts
        while waiting or open_:
            while waiting and len(open_) < PAGES_AT_ONCE:
                i, (widget, options) = waiting.pop(0)
                print(f"[{i}/{len(jobs)}] recording {label_of(widget, options)} …", file=log, flush=True)
                tab = tabs.pop() if tabs else context.new_page()
                open_.append(Recording(tab, base, i, widget, options, timeout_s))
            for rec in list(open_):
                recording = rec.poll()
                if outside:
                    raise RecordingFailed(f"{rec.label}: the page asked for something outside the server: {outside[:3]}")
                if recording is None:
                    continue
                open_.remove(rec)
                tabs.append(rec.page)
                done[rec.index] = recording
                print(f"[{rec.index}/{len(jobs)}] {rec.label}: {len(recording['exchanges'])} exchange(s) in "
                      f"{time.monotonic() - rec.started:.1f} s", file=log, flush=True)
            time.sleep(POLL_S)
        print(f"recorded {len(done)} in {time.monotonic() - started:.1f} s", file=log, flush=True)
    finally:
        context.close()
    return [done[i] for i in sorted(done)]


def label_of(widget: str, options: dict) -> str:
    return widget + (f"?{urlencode(options)}" if options else " (defaults)")


class Recording:
    """One widget's page, loaded in a browser tab, while it records: poll() returns its recording
    once the widget is ready, nothing is in flight and no exchange of a new key has ended for
    SETTLE_S (by the page's own clock), else None. The tab stops listening to the page once it
    returns one or fails, and can load the next widget: Chromium keeps a tab's renderer process
    within one site, and with it the scripts it compiled (plotly.js above all)."""

    READ = ("(name) => { const root = document.querySelector(`[data-widget=\"${name}\"]`);"
            " const t = (window.sendlensTaps || {})[name];"
            " return { state: root?.dataset.state, text: root?.innerText.slice(0, 300),"
            "  pending: t ? t.pending : null, quiet_ms: t && t.lastNewAt !== null ? performance.now() - t.lastNewAt : null,"
            "  hello: t ? t.hello : null, exchanges: t ? t.exchanges() : [],"
            "  source: document.getElementById('sendlens-source')?.textContent }; }")

    def __init__(self, page, base: str, index: int, widget: str, options: dict, timeout_s: float):
        self.index, self.widget, self.options = index, widget, options
        self.label = label_of(widget, options)
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.timeout_s = timeout_s
        self.errors: list[str] = []
        self.page = page
        self._listeners = [("pageerror", lambda e: self.errors.append(str(e))),
                           ("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)]
        for event, listener in self._listeners:
            page.on(event, listener)
        query = f"?{urlencode(options)}" if options else ""
        try:
            page.goto(f"{base}/embed/{widget}{query}", wait_until="commit")
        except Exception:
            self._stop()
            raise

    def _stop(self) -> None:
        for event, listener in self._listeners:
            self.page.remove_listener(event, listener)

    def poll(self) -> dict | None:
        try:
            recording = self._check()
        except Exception:
            self._stop()
            raise
        if recording is not None:
            self._stop()
        return recording

    def _check(self) -> dict | None:
        taken = self.page.evaluate(self.READ, self.widget)
        if taken["state"] == "error":
            raise RecordingFailed(f"{self.widget}: the widget ended in error: {taken['text']}")
        if self.errors:
            raise RecordingFailed(f"{self.widget}: the page logged errors: {self.errors[:3]}")
        settled = (taken["state"] == "ready" and taken["pending"] == 0 and taken["exchanges"]
                   and taken["quiet_ms"] is not None and taken["quiet_ms"] >= SETTLE_S * 1000)
        if not settled:
            if time.monotonic() > self.deadline:
                raise RecordingFailed(f"{self.widget}: not ready and settled after {self.timeout_s:.0f} s "
                                      f"(state {taken['state']}, {taken['pending']} request(s) in flight)")
            return None
        source = json.loads(taken["source"])
        return validate({
            "format": FORMAT, "widget": self.widget, "options": {k: str(v) for k, v in self.options.items()},
            "machine": source["machine"], "date": now(), "engine": source["engine"], "model": source["model"],
            "hello": taken["hello"], "exchanges": taken["exchanges"],
        })
