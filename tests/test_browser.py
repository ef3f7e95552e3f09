"""The site in Chromium against the real server (`python -m app`, SmolLM2-135M-Instruct).

Every request the page makes is routed: only this server may be reached; anything else is
aborted and recorded (the site must work offline). Screenshots go to the artifacts folder.
"""

import re
import time
import urllib.error
import urllib.request

import pytest

from app.sections import SECTIONS
from app.widgets import BY_NAME
from conftest import BAD_WORDS, get_json, wait_ready
from test_app import csp

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

NAMES = [n for s in SECTIONS for n in s.widgets]
BUILT = sorted(BY_NAME)
# Hang-stopping deadlines of widgets whose first job reads a long text several times over on the
# real model (the quantization formats' held-out perplexity, kv-eviction's windows): minutes on two
# busy cores, then cached by the server for the rest of the session.
SLOW_WIDGETS = {"quantization": 600_000, "kv-eviction": 600_000}
CHAT = '[data-widget="chat"]'
DURATION = re.compile(r"^\d+(\.\d+)? (ms|s)$")


# ---- the walkthrough -------------------------------------------------------------------------
def test_index_shows_all_sections(pg, artifacts_dir):
    resp = pg.goto("/")
    assert resp.status == 200
    page = pg.page
    for name in BUILT:   # widgets mount when scrolled near (lazily): bring each into view
        page.locator(f'[data-widget="{name}"]').scroll_into_view_if_needed()
        wait_ready(page, f'[data-widget="{name}"]', SLOW_WIDGETS.get(name, 120_000))
    headings = page.locator("main section > h2").all_inner_texts()
    assert [" ".join(h.split()) for h in headings] == [f"{s.number} {s.title}" for s in SECTIONS]
    assert page.locator("main section").evaluate_all("els => els.map(e => e.id)") == [s.slug for s in SECTIONS]
    for s in SECTIONS:
        assert page.locator(f"#{s.slug}").is_visible()
    # The table of contents jumps to a section.
    page.click(f'nav.toc a[href="#{SECTIONS[8].slug}"]')
    page.wait_for_function(f"() => location.hash === '#{SECTIONS[8].slug}'")
    top = page.locator(f"#{SECTIONS[8].slug}").evaluate("e => e.getBoundingClientRect().top")
    assert abs(top) < 50
    assert page.locator("figure.coming").count() == len(NAMES) - len(BUILT)
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px"
    page.evaluate("() => window.scrollTo(0, 0)")
    page.screenshot(path=str(artifacts_dir / "index.png"), full_page=True)
    pg.assert_clean()


# ---- the chat widget -------------------------------------------------------------------------
WATCH_STREAM = """() => {
  window.__lengths = [];
  const log = document.querySelector('[data-widget="chat"] .chat-log');
  new MutationObserver(() => {
    const last = [...log.querySelectorAll('.msg-assistant')].pop();
    if (last && last.classList.contains('streaming')) {
      window.__lengths.push(last.querySelector('.msg-text').textContent.length);
    }
  }).observe(log, {subtree: true, childList: true, characterData: true});
}"""
ANSWER_DONE = """(n) => {
  const answers = document.querySelectorAll('[data-widget="chat"] .msg-assistant');
  return answers.length === n && !answers[n - 1].classList.contains('streaming');
}"""


def stat(page, label: str) -> str:
    return page.locator(f'{CHAT} .stat:has(.stat-label:text-is("{label}")) .stat-value').inner_text()


def send(page, text: str | None, max_tokens: int, turn: int, timeout: float = 90_000):
    """Send a message (None: the pre-filled one) and wait for the answer of this turn."""
    page.fill(f'{CHAT} input[aria-label="Max tokens"]', str(max_tokens))
    if text is not None:
        page.fill(f"{CHAT} textarea", text)
    page.click(f'{CHAT} button:text-is("Send")')
    page.wait_for_function(ANSWER_DONE, arg=turn, timeout=timeout)


def titles(page) -> list[str]:
    """Every tooltip in the chat widget (title attributes and SVG titles)."""
    return page.evaluate("""() => {
      const root = document.querySelector('[data-widget="chat"]');
      return [...root.querySelectorAll('[title]')].map(e => e.getAttribute('title'))
        .concat([...root.querySelectorAll('title')].map(e => e.textContent));
    }""")


def test_chat_streams_reports_and_reuses_the_cache(pg, server, artifacts_dir):
    pg.goto("/")
    page = pg.page
    wait_ready(page, CHAT)
    prefilled = page.input_value(f"{CHAT} textarea")
    assert prefilled.strip(), "the chat offers a question"
    # The preview of the prompt is there before anything is sent.
    assert page.locator(f"{CHAT} .tokens .tok").count() > 0
    assert "if you press Send now" in page.inner_text(f"{CHAT} .ctx-line")

    # ---- first turn: the pre-filled question, streamed
    page.evaluate(WATCH_STREAM)
    send(page, None, 30, turn=1)
    lengths = page.evaluate("() => window.__lengths")
    assert len({n for n in lengths if n > 0}) >= 2, f"the answer did not grow while streaming: {lengths}"
    first_answer = page.locator(f"{CHAT} .msg-assistant .msg-text").first.inner_text()
    assert first_answer.strip()
    assert page.locator(f"{CHAT} .msg-user").first.inner_text().endswith(prefilled.strip())
    for label in ("TTFT", "TPOT"):
        value = stat(page, label)
        assert DURATION.match(value), f"{label} shows {value!r}"
    generated = int(stat(page, "Tokens out"))
    assert 1 < generated <= 30
    finish = page.inner_text(f"{CHAT} .finish")
    assert re.match(r"Stopped: (the model produced its end-of-turn token \S+ \(id \d+\)"
                    r"|it reached the limit of 30 tokens|the text reached the stop string)", finish), finish
    assert "End to end" in finish
    ctx = page.inner_text(f"{CHAT} .ctx-line")
    assert re.search(r"all \d+ (computed now|sent again; \d+ came from the prefix cache)", ctx), ctx
    assert page.locator(f"{CHAT} .timeline svg rect").count() >= 2
    assert "prefilled" in page.inner_text(f"{CHAT} .timeline .tl-note")
    assert page.get_attribute(CHAT, "data-state") == "ready"

    # ---- second turn: the whole transcript again, its prefix from the cache
    follow_up = "And what is the capital of Germany?"
    send(page, follow_up, 30, turn=2)
    ctx = page.inner_text(f"{CHAT} .ctx-line")
    m = re.search(r"^([\d,]+) of ([\d,]+) tokens of context .*all (\d+) sent again; (\d+) came from the prefix cache",
                  ctx)
    assert m, ctx
    total, window, sent, cached = (int(g.replace(",", "")) for g in m.groups())
    assert window == 8192 and total == sent
    assert 0 < cached < sent and cached % 16 == 0
    assert page.locator(f"{CHAT} .tokens .tok").count() == total
    assert page.locator(f"{CHAT} .tokens .tok.cached").count() == cached
    shown = "".join(page.locator(f"{CHAT} .tokens .tok").all_text_contents()).replace("·", " ").replace("↵", "\n")
    for part in (prefilled.strip(), first_answer.strip(), follow_up):
        assert part in shown, f"{part!r} is not in the prompt the model received"
    assert len(page.locator(f"{CHAT} .msg-assistant").all()) == 2
    for label in ("TTFT", "TPOT"):
        assert DURATION.match(stat(page, label))
    assert not any(BAD_WORDS.search(t) for t in titles(page))
    page.locator(CHAT).screenshot(path=str(artifacts_dir / "chat.png"))
    pg.assert_clean()


def test_chat_stop_aborts_the_request(pg, server):
    pg.goto("/embed/chat")
    page = pg.page
    wait_ready(page, CHAT)
    page.fill(f'{CHAT} input[aria-label="Max tokens"]', "400")
    page.fill(f"{CHAT} textarea", "Write a very long story about a dragon who learns to cook. "
                                  "Make it at least ten paragraphs long, with many details.")
    page.click(f'{CHAT} button:text-is("Send")')
    page.wait_for_function("""() => {
      const v = [...document.querySelectorAll('[data-widget="chat"] .stat')]
        .find(s => s.querySelector('.stat-label').textContent === 'Tokens out');
      return Number(v.querySelector('.stat-value').textContent) >= 3;
    }""", timeout=60_000)
    stop = page.locator(f'{CHAT} button:text-is("Stop")')
    assert stop.is_enabled()
    stop.click()
    page.wait_for_function(ANSWER_DONE, arg=1, timeout=30_000)
    finish = page.inner_text(f"{CHAT} .finish")
    assert "aborted" in finish, finish
    assert 3 <= int(stat(page, "Tokens out")) < 400
    assert page.locator(f"{CHAT} .msg-assistant .msg-text").inner_text().strip()
    assert stop.is_disabled()
    assert page.locator(f'{CHAT} button:text-is("Send")').is_enabled()

    deadline = time.monotonic() + 60   # hang-stopping only
    while True:
        h = get_json(server.base + "/healthz")
        if h["kv"]["free_blocks"] == h["kv"]["total_blocks"] and h["running"] == 0:
            break
        assert time.monotonic() < deadline, f"the aborted request still holds KV blocks: {h}"
        time.sleep(0.1)
    pg.assert_clean()


# ---- embeds ----------------------------------------------------------------------------------
def test_embed_pages_are_exactly_the_built_widgets(server):
    found = []
    for name in NAMES:
        try:
            with urllib.request.urlopen(f"{server.base}/embed/{name}", timeout=10) as resp:
                found.append(name)
                assert csp(resp.headers)["frame-ancestors"] == "*"
        except urllib.error.HTTPError as err:
            assert err.code == 404
            err.close()
    assert sorted(found) == BUILT


@pytest.mark.parametrize("name", BUILT)
def test_embed_widget_reaches_ready(pg, artifacts_dir, name):
    resp = pg.goto(f"/embed/{name}")
    assert resp.status == 200
    page = pg.page
    wait_ready(page, f'[data-widget="{name}"]', SLOW_WIDGETS.get(name, 60_000))
    assert page.locator("[data-widget]").count() == 1
    assert page.locator("main, nav.toc").count() == 0
    box = page.locator(f'[data-widget="{name}"]').bounding_box()
    assert box["width"] > 600 and box["height"] > 200
    page.screenshot(path=str(artifacts_dir / f"embed-{name}.png"), full_page=True)
    pg.assert_clean()


def test_widgets_below_the_fold_wait_until_scrolled_near(pg):
    pg.goto("/")
    page = pg.page
    wait_ready(page, CHAT)
    far = BUILT[-1] if BUILT[-1] != "chat" else None
    if far is None:
        pytest.skip("only the chat is built")
    assert page.get_attribute(f'[data-widget="{far}"]', "data-state") == "loading"
    page.locator(f'[data-widget="{far}"]').scroll_into_view_if_needed()
    wait_ready(page, f'[data-widget="{far}"]', 120_000)
    pg.assert_clean()


def test_the_walkthrough_reads_on_a_phone(pg, artifacts_dir):
    pg.page.set_viewport_size({"width": 390, "height": 844})
    pg.goto("/")
    page = pg.page
    page.locator(CHAT).scroll_into_view_if_needed()
    wait_ready(page, CHAT)
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px on a phone"
    page.screenshot(path=str(artifacts_dir / "index-phone-390.png"))
    pg.assert_clean()
