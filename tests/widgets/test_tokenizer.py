"""Widget `tokenizer`: the real tokens of any text, checked against transformers' tokenizer."""

from urllib.parse import quote

import pytest

from conftest import figure_value, on_a_phone, shoot_widget, wait_ready

TOK = '[data-widget="tokenizer"]'

# Special strings typed as text, whitespace runs, emoji (4-byte characters cut across tokens),
# combining marks, CJK, Cyrillic, Arabic, code.
TEXTS = [
    "The cat sat on the mat.",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "spaces:   three,\ttab,\n\nblank line,      six",
    "Emoji 😀👍🏽 and flags 🇫🇷 in a row",
    "日本語のテキスト and Привет, мир! and مرحبا",
    "café, naïve, e\u0301 (a combining accent)",
    "def f(x):\n    return x ** 2  # 4 spaces",
    "<|endoftext|><|endoftext|> x <|im_end|>",
]


def test_tokenizer_registers_tokenize_answered_at_once():
    from app.widgets import BY_NAME
    types = {m.type: m for m in BY_NAME["tokenizer"].messages}
    assert set(types) == {"tokenize"}
    assert not types["tokenize"].job


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_and_texts_join_back(ws, hf_reference, text):
    _, hf_tok = hf_reference
    reply = ws.call("tokenize", text=text)
    assert reply["type"] == "tokenize", reply
    ids = [t["id"] for t in reply["tokens"]]
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert "".join(t["text"] for t in reply["tokens"]) == text
    assert reply["num_tokens"] == len(ids)
    assert reply["num_words"] == len(text.split())
    assert reply["num_chars"] == len(text)
    special = set(hf_tok.all_special_ids) | {i for i, t in hf_tok.added_tokens_decoder.items() if t.special}
    assert [t["special"] for t in reply["tokens"]] == [i in special for i in ids]


@pytest.mark.real_model
def test_a_typed_special_string_is_one_special_token(ws, hf_reference):
    _, hf_tok = hf_reference
    reply = ws.call("tokenize", text="<|im_start|>")
    assert reply["num_tokens"] == 1
    (tok,) = reply["tokens"]
    assert tok == {"id": hf_tok.convert_tokens_to_ids("<|im_start|>"), "text": "<|im_start|>",
                   "special": True, "bytes": None}


def test_partial_characters_carry_their_bytes(ws):
    reply = ws.call("tokenize", text="😀")
    tokens = reply["tokens"]
    assert len(tokens) > 1, "the emoji is cut into byte pieces"
    raw = bytes.fromhex("".join(t["bytes"].replace(" ", "") for t in tokens))
    assert raw == "😀".encode("utf-8")
    assert [t["text"] for t in tokens[:-1]] == [""] * (len(tokens) - 1) and tokens[-1]["text"] == "😀"


def test_every_token_of_the_vocabulary_has_the_bytes_the_tokenizer_decodes(tiny_loaded):
    """The byte-level alphabet read back: each token's bytes decode as transformers decodes it alone."""
    from app.token_text import token_bytes
    tok = tiny_loaded.tokenizer
    ids = list(range(tok.vocab_size))
    decoded = tok.token_texts(ids)
    for tid, (raw, special), text in zip(ids, token_bytes(tok, ids), decoded):
        assert raw.decode("utf-8", errors="replace") == text, tid
        assert special == (tid in tok.special_ids)


@pytest.mark.parametrize("msg, param", [
    ({"type": "tokenize", "id": "e1"}, "text"),
    ({"type": "tokenize", "id": "e1", "text": ""}, "text"),
    ({"type": "tokenize", "id": "e1", "text": 42}, "text"),
    ({"type": "tokenize", "id": "e1", "text": ["a"]}, "text"),
    ({"type": "tokenize", "id": "e1", "text": "a", "lang": "en"}, "lang"),
])
def test_bad_input_names_the_field_and_the_connection_stays_usable(ws, msg, param):
    err = ws.error(msg, "e1")
    assert err["code"] == "invalid_request" and err["param"] == param, err
    assert ws.call("tokenize", text="still here")["num_tokens"] == 2


def test_text_is_bounded_by_the_message_size(ws):
    limit = ws.hello["limits"]["max_message_bytes"]
    err = ws.error({"type": "tokenize", "id": "big", "text": "x" * limit}, None)
    assert err["code"] == "invalid_request" and "max_message_bytes" in err["message"]
    assert ws.call("tokenize", text="ok")["num_tokens"] == 1


@pytest.mark.browser
@pytest.mark.real_model
def test_tokenizer_page_shows_real_chips_from_the_url(pg, artifacts_dir, hf_reference):
    _, hf_tok = hf_reference
    text = "<|im_start|>user\nHello   world 😀 Привет<|im_end|>"
    query = "?text=" + quote(text)
    shoot_widget(pg, "tokenizer", artifacts_dir, query)
    page = pg.page
    pg.goto("/embed/tokenizer" + query)
    wait_ready(page, TOK)
    assert page.input_value(f"{TOK} textarea") == text
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert figure_value(page, "num_tokens") == len(ids)
    assert figure_value(page, "num_words") == len(text.split())
    chips = page.locator(f"{TOK} .tokens .tok")
    assert chips.count() == len(ids)
    assert [int(x) for x in chips.evaluate_all("els => els.map(e => e.dataset.id)")] == ids
    assert page.locator(f"{TOK} .tokens .tok-special").count() == 2
    assert page.locator(f"{TOK} .tokens .tok-special").first.inner_text() == "<|im_start|>"
    page.click(f"{TOK} .ids summary")
    assert page.inner_text(f"{TOK} .id-list") == "[" + ", ".join(map(str, ids)) + "]"

    page.fill(f"{TOK} textarea", "Hello world")
    page.wait_for_function("""() => document.querySelector('[data-widget="tokenizer"] [data-figure="num_tokens"]')
                              ?.dataset.value === '2'""")
    assert figure_value(page, "num_words") == 2
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_tokenizer_on_the_walkthrough_at_phone_width(pg, artifacts_dir):
    snippet = on_a_phone(pg, "tokenizer", "?tokenizer.text=Tokens+are+not+words.", artifacts_dir)
    assert figure_value(pg.page, "num_words") == 4
    assert "text=Tokens" in snippet
    pg.assert_clean()
