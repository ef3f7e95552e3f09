"""The tokenizer wrapper and the chat template: ids equal to Hugging Face's, and render_chat's
labels for every token, and encode_steps' pieces joined equal to encode()'s ids (the tiny model
shares SmolLM2's tokenizer, so most tests use it)."""

import random

import pytest

from core.model.tokenizer import CHARS_PER_TOKEN, TokenKind

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is the tallest mountain in Europe?"}],
    [{"role": "system", "content": "You are a pirate. Answer like one."},
     {"role": "user", "content": "Where is the treasure?"}],
    [{"role": "user", "content": "Name a prime number."},
     {"role": "assistant", "content": "Seven is prime."},
     {"role": "user", "content": "And an even one?"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about cats."}],
    [{"role": "user", "content": "Ünïcödé, 日本語 and emoji 🎉 — all fine?\nSecond line."}],
]


@pytest.fixture(scope="module")
def tok(tiny_loaded):
    return tiny_loaded.tokenizer


def test_encode_decode_round_trip(tok):
    for text in ("Hello world", "  leading spaces", "Ünïcödé 日本語 🎉", "line\nbreak\ttab", "x" * 300):
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_special_tokens(tok):
    assert tok.eos_token_id in tok.special_ids
    assert tok.hf.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    assert tok.encode("<|im_start|>") == [tok.hf.convert_tokens_to_ids("<|im_start|>")]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.vocab_size == 49152


def test_token_texts_are_single_token_decodes(tok):
    ids = tok.encode("The cat sat.")
    texts = tok.token_texts(ids)
    assert "".join(texts) == "The cat sat."
    assert texts == [tok.decode([i]) for i in ids]
    emoji = tok.token_texts(tok.encode("🎉"))
    assert len(emoji) > 1 and "\ufffd" in "".join(emoji)   # a piece of a character alone


def test_apply_chat_template_adds_the_generation_prompt(tok):
    conv = CONVERSATIONS[1]
    with_prompt = tok.apply_chat_template(conv)
    without = tok.apply_chat_template(conv, add_generation_prompt=False)
    assert with_prompt[: len(without)] == without
    assert tok.decode(with_prompt[len(without):], skip_special_tokens=False) == "<|im_start|>assistant\n"
    assert with_prompt == tok.encode(tok.render_template(conv))


# -- render_chat labels ------------------------------------------------------------------------

@pytest.mark.parametrize("conv", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_render_chat_ids_and_labels(tok, conv):
    rendered = tok.render_chat(conv)
    assert rendered.token_ids == tok.apply_chat_template(conv)
    assert [t.id for t in rendered.tokens] == rendered.token_ids
    assert rendered.text == tok.render_template(conv)
    for t in rendered.tokens:
        assert (t.kind == TokenKind.SPECIAL) == (t.id in tok.special_ids)
        if t.kind in (TokenKind.CONTENT, TokenKind.WRAPPER):
            assert t.message is not None and t.role == conv[t.message]["role"]
        if t.kind == TokenKind.CONTENT:
            assert t.text.strip() == "" or t.text in conv[t.message]["content"] or "\ufffd" in t.text
    # each message's content is exactly its content tokens, in order
    for i, m in enumerate(conv):
        ids = [t.id for t in rendered.tokens if t.kind == TokenKind.CONTENT and t.message == i]
        assert ids and tok.decode(ids) == m["content"]
    # the messages appear in order
    order = [t.message for t in rendered.tokens if t.message is not None]
    assert order == sorted(order)


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_trailing_generation_prompt(tok, conv):
    tokens = tok.render_chat(conv).tokens
    last = max(i for i, t in enumerate(tokens) if t.message == len(conv) - 1)
    tail = tokens[last + 1:]
    assert tail[0].kind == TokenKind.SPECIAL and tail[0].text == "<|im_start|>"
    assert all(t.kind == TokenKind.GENERATION_PROMPT and t.role == "assistant" for t in tail[1:])
    assert "".join(t.text for t in tail[1:]) == "assistant\n"
    assert all(t.kind != TokenKind.GENERATION_PROMPT for t in tokens[: last + 1])
    no_prompt = tok.render_chat(conv, add_generation_prompt=False)
    assert no_prompt.token_ids == tok.apply_chat_template(conv, add_generation_prompt=False)
    assert not any(t.kind == TokenKind.GENERATION_PROMPT for t in no_prompt.tokens)


def test_default_system_prompt_is_inserted(tok):
    conv = CONVERSATIONS[1]
    rendered = tok.render_chat(conv)
    first_user = next(i for i, t in enumerate(rendered.tokens) if t.message == 0)
    head = rendered.tokens[:first_user]
    assert head, "SmolLM2's template adds a system turn when the chat has none"
    assert all(t.message is None for t in head)
    assert all(t.kind in (TokenKind.INSERTED, TokenKind.SPECIAL) for t in head)
    assert sum(t.kind == TokenKind.INSERTED for t in head) > 5
    assert {t.role for t in head if t.kind == TokenKind.INSERTED} == {"system"}
    inserted_text = "".join(t.text for t in head)
    assert rendered.text.startswith(inserted_text)
    assert inserted_text.startswith("<|im_start|>system\n") and inserted_text.endswith("<|im_end|>\n")
    # the inserted turn is the same as a system message with that content
    default_system = inserted_text[len("<|im_start|>system\n"):-len("<|im_end|>\n")]
    assert default_system.strip()
    assert tok.apply_chat_template([{"role": "system", "content": default_system}] + conv) == rendered.token_ids


def test_an_own_system_message_inserts_nothing(tok):
    for conv in CONVERSATIONS:
        rendered = tok.render_chat(conv)
        has_system = conv[0]["role"] == "system"
        assert any(t.kind == TokenKind.INSERTED for t in rendered.tokens) != has_system
        if has_system:
            assert rendered.tokens[0].message == 0 and rendered.tokens[0].role == "system"
            assert rendered.tokens[0].kind == TokenKind.SPECIAL


def test_wrapper_tokens_name_their_role(tok):
    rendered = tok.render_chat(CONVERSATIONS[3])
    for i, m in enumerate(CONVERSATIONS[3]):
        wrapper = "".join(t.text for t in rendered.tokens if t.kind == TokenKind.WRAPPER and t.message == i)
        assert wrapper.startswith(m["role"] + "\n")
        assert all(t.role == m["role"] for t in rendered.tokens if t.message == i)


# -- against the Hugging Face tokenizer read from the GGUF file -----------------------------------

@pytest.mark.real_model
def test_chat_template_matches_hugging_face(smollm, hf_reference):
    _, hf_tok = hf_reference
    for conv in CONVERSATIONS:
        ours = smollm.tokenizer.apply_chat_template(conv)
        theirs = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours == list(theirs)
        assert smollm.tokenizer.render_template(conv) == hf_tok.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=False)
        assert smollm.tokenizer.render_chat(conv).token_ids == list(theirs)
    for text in ("Hello world", "Ünïcödé 日本語 🎉", "def f(x):\n    return x * 2\n"):
        assert smollm.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False)


def test_render_chat_survives_private_use_characters(tok):
    """Text that contains the markers render_chat uses internally still renders, with the
    same ids as the plain template (labels fall back to plain wrapper labels)."""
    messages = [{"role": "user", "content": "odd \ue000 1 \ue001 text \ue002 here"}]
    rendered = tok.render_chat(messages)
    assert rendered.token_ids == tok.apply_chat_template(messages)
    assert len(rendered.tokens) == len(rendered.token_ids)


def test_inserted_system_prompt_is_labelled_even_for_empty_content(tok):
    rendered = tok.render_chat([{"role": "user", "content": ""}])
    kinds = [t.kind for t in rendered.tokens]
    assert TokenKind.INSERTED in kinds
    first_user = next(i for i, t in enumerate(rendered.tokens) if t.message == 0)
    assert all(t.message is None for t in rendered.tokens[:first_user])
    assert rendered.tokens[first_user].kind == TokenKind.SPECIAL and rendered.tokens[first_user].role == "user"


def test_render_chat_labels_a_long_chat(tok):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(200)]
    rendered = tok.render_chat(messages)
    assert rendered.token_ids == tok.apply_chat_template(messages)
    owners = {t.message for t in rendered.tokens if t.kind == TokenKind.CONTENT}
    assert owners == set(range(200))


ENCODE_STEPS_TEXTS = {
    "prose": "The river ran past the old mill, and the miller counted the boats as they went by. " * 12,
    "code": ("def f(x, y=3):\n    return {'a': x ** 2, \"b\": y}  # a comment\n\nclass A:\n    pass\n"
             "for i in range(10):\n\tprint(f(i), end='')\n") * 8,
    "newlines": "one\ntwo\n\nthree\n \nfour   five\r\n six\n\n\n" * 20,
    "digits": "In 2024, 3.14159 x 1000000 = 3141590 and 007 + 12345678901234567890 is 42. " * 10,
    "unicode": ("Ünïcödé café, 日本語のテキスト, emoji 🎉🎉 and ‘quotes’ — "
                "dashes… naïve fiancée. ") * 10,
    "contractions": "It's what we've said: they'll go, I'm sure you'd agree, don't you? 'tis fine. " * 10,
    "special tokens": "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\nyes it is<|im_end|>\n" * 10,
    "spaces": "a  b   c    d\t\te  \n  f " * 30,
}


def run_steps(gen):
    """-> (the steps a generator yielded, its return value)."""
    count = 0
    while True:
        try:
            next(gen)
            count += 1
        except StopIteration as stop:
            return count, stop.value


@pytest.mark.parametrize("name", sorted(ENCODE_STEPS_TEXTS))
def test_encode_steps_gives_exactly_encodes_ids_in_several_pieces(tok, name):
    """Cut at words' starts (Tokenizer.encode_steps), a text encodes to exactly encode()'s ids,
    for every kind of text and piece size; a long text with places to cut takes several pieces."""
    text = ENCODE_STEPS_TEXTS[name]
    whole = tok.encode(text)
    for per_step in (1, 3, 16, 64):
        steps, ids = run_steps(tok.encode_steps(text, per_step))
        assert ids == whole, (name, per_step)
        assert steps >= 1
    assert tok.cuttable                                   # SmolLM2's tokenizer: byte-level BPE, no normalizer
    # a piece is 16 * CHARS_PER_TOKEN characters, up to the next place to cut: at least half
    # the pieces a cut anywhere would make
    assert run_steps(tok.encode_steps(text, 16))[0] >= len(text) // (16 * CHARS_PER_TOKEN * 2) >= 5


def test_encode_steps_on_random_texts_of_tricky_characters(tok):
    """Seeded texts from spaces, newlines, tabs, letters, contractions, digits, punctuation,
    non-ASCII letters and spaces, emoji and special tokens, cut as finely as encode_steps can."""
    alphabet = (list(" \n\t\r") + list("aZx'sdtmlrev") + list("0123456789") + list(".,;:!?-_()[]{}<>|\"")
                + list("éü日本🎉\u00a0\u2003") + ["<|im_start|>", "<|im_end|>", "'s", "'ll", "  ", "\n\n"])
    rng = random.Random(30)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120)))
        assert run_steps(tok.encode_steps(text, 1))[1] == tok.encode(text), repr(text)


def test_encode_steps_of_the_chat_template_output(tok):
    everything = [{"role": "user", "content": ENCODE_STEPS_TEXTS[k]} for k in sorted(ENCODE_STEPS_TEXTS)]
    for conv in CONVERSATIONS + [everything]:
        text = tok.render_template(conv)
        steps, ids = run_steps(tok.encode_steps(text, 8))
        assert ids == tok.apply_chat_template(conv) == tok.encode(text)
    assert steps > 10                                     # the long chat was cut many times
    assert run_steps(tok.encode_steps("", 8)) == (0, [])


def test_encode_steps_takes_one_piece_where_it_may_not_cut(tok, monkeypatch):
    """A tokenizer whose pre-tokenizer is not byte-level BPE's own (Tokenizer.cuttable false):
    the whole text in one piece."""
    monkeypatch.setattr(tok, "cuttable", False)
    text = ENCODE_STEPS_TEXTS["prose"]
    assert run_steps(tok.encode_steps(text, 4)) == (1, tok.encode(text))
