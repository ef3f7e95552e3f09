"""Streaming detokenization and stop strings: the Detokenizer alone, then through the engine."""

import pytest

from core import SamplingParams
from core.model.detokenizer import Detokenizer

MIXED = "Café crème 🎉 for 日本語 readers: naïve façades, ½ price, ok?"


@pytest.fixture(scope="module")
def tok(tiny_loaded):
    return tiny_loaded.tokenizer


def feed(detok, ids, finished_at_end=True):
    """Append ids one by one; -> (stop string or None, released pieces)."""
    pieces = []
    for k, i in enumerate(ids):
        stop = detok.append(i)
        last = stop is not None or k == len(ids) - 1
        pieces.append(detok.release(finished=last and finished_at_end))
        if stop is not None:
            return stop, pieces
    return None, pieces


def test_incremental_text_equals_full_decode(tok):
    ids = tok.encode(MIXED)
    assert len(ids) > len(MIXED.split())                       # multi-byte characters span tokens
    detok = Detokenizer(tok, [])
    stop, pieces = feed(detok, ids)
    assert stop is None
    assert detok.text == tok.decode(ids) == MIXED
    assert "".join(pieces) == MIXED
    assert all("\ufffd" not in p for p in pieces)             # never half a character


def test_without_stop_strings_text_is_released_at_once(tok):
    ids = tok.encode("plain words here")
    detok = Detokenizer(tok, [])
    released = []
    for i in ids:
        detok.append(i)
        released.append(detok.release(finished=False))
    assert "".join(released) == "plain words here"
    assert all(released)


def test_stop_string_cuts_the_text(tok):
    text = "The answer is 42. END of the story, and more."
    ids = tok.encode(text)
    detok = Detokenizer(tok, ["END"])
    stop, pieces = feed(detok, ids)
    assert stop == "END"
    assert detok.text == "The answer is 42. "
    assert "".join(pieces) == detok.text
    assert len(detok.ids) < len(ids)                            # it stopped at the completing token


def test_stop_string_inside_a_token_and_across_tokens(tok):
    text = "Hello wonderful world"
    ids = tok.encode(text)
    for stop in ("wonder", "lo won", "o w", "d"):
        detok = Detokenizer(tok, [stop])
        found, pieces = feed(detok, ids)
        assert found == stop
        assert detok.text == text[: text.index(stop)]
        assert "".join(pieces) == detok.text


def test_earliest_stop_string_wins(tok):
    text = "alpha beta gamma delta"
    detok = Detokenizer(tok, ["delta", "beta", "gamma"])
    found, _ = feed(detok, tok.encode(text))
    assert found == "beta" and detok.text == "alpha "


def test_holdback_never_shows_text_that_is_taken_back(tok):
    text = "one two three four five six seven"
    ids = tok.encode(text)
    stop = "four"
    detok = Detokenizer(tok, [stop, "xyzzy"])
    released = ""
    for i in ids:
        found = detok.append(i)
        piece = detok.release(finished=found is not None)
        released += piece
        assert text.startswith(released)
        assert stop not in released
        if found:
            break
        assert len(detok.text) - len(released) <= len("xyzzy") - 1   # at most the holdback waits
    assert released == "one two three "


def test_no_stop_found_releases_everything_at_the_end(tok):
    text = "nothing to stop here"
    detok = Detokenizer(tok, ["zzzz"])
    found, pieces = feed(detok, tok.encode(text))
    assert found is None
    assert "".join(pieces) == text


# -- through the engine (real model, greedy) ---------------------------------------------------

@pytest.mark.real_model
def test_stop_strings_end_generation(smollm):
    prompts = [smollm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in
               ("Describe a sunny beach in two sentences.", "Explain what a compiler does.")]
    base = smollm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    stops, expected = [], []
    for out in base:
        words = out.text.split()
        assert len(words) > 6
        stop = " " + words[len(words) // 2]                  # a word from the middle of the text
        stops.append(stop)
        expected.append(out.text[: out.text.index(stop)])
    streamed = {}
    engine = smollm.engine
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=24, stop=[s, "@@@never@@@"]))
            for p, s in zip(prompts, stops)]
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed.setdefault(o.request_id, []).append(o)
    for seq, out, stop, text in zip(seqs, base, stops, expected):
        outs = streamed[seq.request_id]
        final = outs[-1]
        assert final.finished and final.finish_reason == "stop" and final.stop_reason == stop
        assert final.text == text
        assert stop not in final.text
        assert "".join(o.new_text for o in outs) == final.text   # the stream shows only what stays
        assert out.token_ids[: len(final.token_ids)] == final.token_ids
        assert len(final.token_ids) < len(out.token_ids)
