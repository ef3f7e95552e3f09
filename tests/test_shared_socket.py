"""A page full of embeds opens one socket (static/js/shared-socket.js, socket-worker.js).

Three embed iframes of the session's tiny live server on a page of the same site: all reach
ready, live, while the server counts one more connection, not three; an embed opened alone (not
in a frame) keeps its own socket, as before; on a page of another site, where the browser refuses
the frames a shared worker, each embed falls back to a socket of its own and works.
"""

import time

import pytest

from conftest import author_page, wait_ready

pytestmark = pytest.mark.browser

EMBEDS = ["tokenizer", "embedding", "kv-memory"]


def connections(runtime, settle_s: float = 0.5) -> int:
    """The server's connection count once it has held still for settle_s (sockets of earlier
    pages close a moment after their pages). Hang-stopping only: at most 20 s."""
    last, since, deadline = runtime.num_connections, time.monotonic(), time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = runtime.num_connections
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
    return last


def test_embeds_in_frames_share_one_socket(browser, live_server, artifacts_dir):
    runtime = live_server.runtime
    context = browser.new_context(viewport={"width": 1280, "height": 1500})
    try:
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        before = connections(runtime)
        frames = "".join(f'<iframe title="{n}" src="{live_server.http}/embed/{n}" width="600" height="450"></iframe>'
                         for n in EMBEDS)
        page.goto(author_page(f"<!doctype html><body>{frames}</body>"))
        for name in EMBEDS:
            page.frame_locator(f'iframe[title="{name}"]').locator(
                f'[data-widget="{name}"][data-source="live"][data-state="ready"]').wait_for(timeout=60_000)
        assert connections(runtime) == before + 1
        # the reader's own text still reaches the server and comes back to the frame that asked
        tok = page.frame_locator('iframe[title="tokenizer"]')
        tok.locator("textarea").fill("one two three")
        tok.locator('[data-figure="num_words"][data-value="3"]').wait_for(timeout=30_000)
        assert errors == []

        alone = context.new_page()
        alone.goto(f"{live_server.http}/embed/tokenizer")
        wait_ready(alone, '[data-widget="tokenizer"]')
        assert connections(runtime) == before + 2   # a page that is not a frame: its own socket

        # a page of another site (localhost against 127.0.0.1): where the browser refuses the frames
        # a shared worker, each embed opens a socket of its own and works
        page.close()
        alone.close()
        assert connections(runtime) == before   # (the live server admits only 4 at once)
        other = context.new_page()
        other.goto(author_page(frames).replace("127.0.0.1", "localhost"))
        for name in EMBEDS:
            other.frame_locator(f'iframe[title="{name}"]').locator(
                f'[data-widget="{name}"][data-source="live"][data-state="ready"]').wait_for(timeout=60_000)
        # shared where the browser allows it, else one each (Chromium 156 in these contexts: one each)
        assert connections(runtime) in (before + 1, before + len(EMBEDS))
        assert errors == []
    finally:
        context.close()
