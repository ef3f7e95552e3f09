"""Widget `chat`: its server module and its page (the full stream is in test_protocol/test_browser)."""

import pytest

from conftest import figure_value, shoot_widget, wait_ready

CHAT = '[data-widget="chat"]'


def test_chat_registers_generate_and_template():
    from app.widgets import BY_NAME
    types = {m.type: m for m in BY_NAME["chat"].messages}
    assert set(types) == {"generate", "template"}
    assert not any(m.job for m in types.values())


@pytest.mark.browser
@pytest.mark.real_model
def test_chat_takes_its_options_from_the_url(pg, artifacts_dir):
    shoot_widget(pg, "chat", artifacts_dir, "?message=Name+three+colours.&max_tokens=12&temperature=0.7&seed=3")
    page = pg.page
    pg.goto("/embed/chat?message=Name+three+colours.&max_tokens=12&temperature=0.7&seed=3")
    wait_ready(page, CHAT)
    assert page.input_value(f"{CHAT} textarea") == "Name three colours."
    assert page.input_value(f'{CHAT} input[aria-label="Max tokens"]') == "12"
    assert page.input_value(f'{CHAT} select[aria-label="Temperature"]') == "0.7"
    assert page.input_value(f'{CHAT} input[aria-label="Seed"]') == "3"
    page.click(f'{CHAT} button:text-is("Send")')
    page.wait_for_selector(f'{CHAT} [data-figure="completion_tokens"][data-value]', timeout=60_000)
    page.wait_for_function("""() => !document.querySelector('[data-widget="chat"] .msg-assistant.streaming')""",
                           timeout=60_000)
    assert 1 <= figure_value(page, "completion_tokens") <= 12
    assert figure_value(page, "ttft_ms") > 0 and figure_value(page, "queue_ms") >= 0
    assert figure_value(page, "tpot_ms") > 0
    pg.assert_clean()
