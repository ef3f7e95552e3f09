"""Recording widgets through the real engine: Chromium opens each widget's embed page on a running
sendlens server (loopback), the page's own client sends exactly the messages the widget sends,
and the tap on that client (static/js/source.js, window.sendlensTaps) keeps every exchange that
ended well. Once the widget is ready and nothing is in flight, its exchanges, the server's hello
and the page's machine/engine/model make one recording.

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

    out = []
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        context.route("**/*", route)
        started = time.monotonic()
        for i, (widget, options) in enumerate(jobs, 1):
            t0 = time.monotonic()
            label = f"{widget}" + (f"?{urlencode(options)}" if options else " (defaults)")
            print(f"[{i}/{len(jobs)}] recording {label} …", file=log, flush=True)
            recording = record_one(context, base, widget, options, timeout_s)
            if outside:
                raise RecordingFailed(f"{label}: the page asked for something outside the server: {outside[:3]}")
            out.append(recording)
            print(f"[{i}/{len(jobs)}] {label}: {len(recording['exchanges'])} exchange(s) in "
                  f"{time.monotonic() - t0:.1f} s", file=log, flush=True)
        print(f"recorded {len(out)} in {time.monotonic() - started:.1f} s", file=log, flush=True)
    finally:
        context.close()
    return out


def record_one(context, base: str, widget: str, options: dict, timeout_s: float) -> dict:
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        query = f"?{urlencode(options)}" if options else ""
        page.goto(f"{base}/embed/{widget}{query}")
        root = page.locator(f'[data-widget="{widget}"]')
        page.wait_for_function(
            "(name) => ['ready', 'error'].includes(document.querySelector(`[data-widget=\"${name}\"]`)?.dataset.state)",
            arg=widget, timeout=timeout_s * 1000)
        if root.get_attribute("data-state") == "error":
            raise RecordingFailed(f"{widget}: the widget ended in error: {root.inner_text()[:300]}")
        taken = _settled(page, widget, timeout_s)
        if errors:
            raise RecordingFailed(f"{widget}: the page logged errors: {errors[:3]}")
        source = json.loads(page.locator("#sendlens-source").text_content())
        return validate({
            "format": FORMAT, "widget": widget, "options": {k: str(v) for k, v in options.items()},
            "machine": source["machine"], "date": now(), "engine": source["engine"], "model": source["model"],
            "hello": taken["hello"], "exchanges": taken["exchanges"],
        })
    finally:
        page.close()


def _settled(page, widget: str, timeout_s: float) -> dict:
    """The tap's state once no exchange of a new key has ended for SETTLE_S and nothing is in flight."""
    read = ("(name) => { const t = window.sendlensTaps[name];"
            " return { pending: t.pending, hello: t.hello, exchanges: t.exchanges() }; }")
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        taken = page.evaluate(read, widget)
        state = len(taken["exchanges"])   # one per key (the tap keeps a key's latest)
        if state != last:
            last, since = state, time.monotonic()
        elif taken["pending"] == 0 and taken["exchanges"] and time.monotonic() - since >= SETTLE_S:
            return taken
        if time.monotonic() > deadline:
            raise RecordingFailed(f"{widget}: still {taken['pending']} request(s) in flight after {timeout_s:.0f} s")
        time.sleep(0.1)
