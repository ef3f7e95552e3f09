"""The page's websocket client retries by itself a request the server refused with `overloaded`
and a short `retry_after_s` (static/js/client.js): a chat sent while its connection's work budget
is low waits, says so, and is then answered, as a student's second message in a busy class is."""

from types import SimpleNamespace

import pytest

from conftest import Page, serve_app

pytestmark = pytest.mark.browser

# A budget small enough that one long message empties it: refilled at RATE tokens a second, so a
# refused message is told to retry after at most BURST / RATE = 2 s (the client's bound is 10 s).
RATE, BURST = 400, 800
SETTINGS = {"model": "tiny", "num_kv_blocks": 64, "default_max_tokens": 8, "testing": True,
            "work_tokens_per_second": RATE, "work_burst_tokens": BURST}
# about 300 bytes that tokenize to hundreds of tokens (digits and spaces): the first message leaves
# the bucket near empty, and the second one's estimate (the whole chat again) exceeds what is left
LONG = " ".join(str(i) for i in range(100))


@pytest.fixture(scope="module")
def budget_server(tiny_loaded):
    for srv in serve_app(dict(SETTINGS), tiny_loaded):
        yield SimpleNamespace(base=srv.http, port=srv.port)


def send(page, text: str) -> None:
    page.fill('[data-widget="chat"] textarea[name="message"]', text)
    page.evaluate("() => document.querySelector('[data-widget=chat] form').requestSubmit()")


def test_a_chat_refused_by_its_budget_waits_and_is_sent_again(browser, budget_server):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        pg = Page(context, budget_server)
        page = pg.page
        pg.goto("/embed/chat")
        page.wait_for_selector('[data-widget="chat"] textarea[name="message"]')
        # every text the status line shows, in order (the waiting one lasts only until the retry)
        page.evaluate("""() => {
            const finish = document.querySelector('[data-widget=chat] .finish');
            window.__finishes = [];
            new MutationObserver(() => window.__finishes.push(finish.textContent))
                .observe(finish, { childList: true, characterData: true, subtree: true });
        }""")

        def answered() -> None:
            try:
                page.wait_for_function(
                    "() => /^Stopped/.test(document.querySelector('[data-widget=chat] .finish').textContent)",
                    timeout=60_000)
            except Exception:
                pytest.fail(f"no answer; the status line showed {page.evaluate('() => window.__finishes')}")
        send(page, LONG)
        answered()
        page.evaluate("() => { window.__finishes = []; }")
        send(page, LONG)
        answered()
        finishes = page.evaluate("() => window.__finishes")
        waiting = [t for t in finishes if t.startswith("Waiting to send again by itself")]
        assert waiting, finishes
        assert "work_burst_tokens" in waiting[0]            # the server's reason, shown as it came
        assert not any(t.startswith("The server refused") for t in finishes), finishes
        answers = page.locator('[data-widget="chat"] .msg-assistant .msg-text')
        assert answers.count() == 2 and "no answer" not in answers.nth(1).inner_text()
        pg.assert_clean()
    finally:
        context.close()
