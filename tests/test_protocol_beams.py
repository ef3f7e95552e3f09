"""Beam search over the websocket: `generate` with `beam_width` (docs/protocol.md).

The live server on the tiny model; the beams are compared with the engine's own beam search on
the same weights (tests/test_sharing.py checks that one against a plain reference).
"""

import pytest

from conftest import WS
from core import LLM
from core.engine.beam_search import BeamSearchParams
from test_protocol import all_blocks_free, assert_works


@pytest.fixture(scope="module")
def reference_llm(tiny_loaded):
    from app.config import ServerConfig
    return LLM("tiny", loaded=tiny_loaded, num_kv_blocks=256, weight_format=ServerConfig().engine.weight_format)


def test_generate_with_beam_width_returns_the_beams_best_first(live_server, ws: WS, reference_llm):
    prompt = "Once upon a time"
    s = ws.generate(prompt=prompt, max_tokens=4, beam_width=3, length_penalty=0.5)
    assert s.error is None, s.error
    assert s.accepted["beam_width"] == 3 and s.accepted["max_tokens"] == 4
    assert s.tokens == []                      # a beam search streams nothing: its beams come in done
    (want,) = reference_llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.5))
    beams = s.done["beams"]
    assert [b["beam"] for b in beams] == [0, 1, 2]
    assert [b["token_ids"] for b in beams] == [b.token_ids for b in want.sequences]
    assert [b["text"] for b in beams] == [b.text for b in want.sequences]
    # the same engine arithmetic on the same weights: the same float, sent as JSON
    assert [b["cum_logprob"] for b in beams] == [b.cum_logprob for b in want.sequences]
    assert s.done["text"] == beams[0]["text"] and "samples" not in s.done
    all_blocks_free(live_server)
    assert_works(ws)


@pytest.mark.parametrize("fields,param", [
    ({"beam_width": 0}, "beam_width"),
    ({"beam_width": "3"}, "beam_width"),
    ({"beam_width": None}, "beam_width"),
    ({"beam_width": 2, "length_penalty": 11.0}, "length_penalty"),
    ({"beam_width": 2, "length_penalty": "long"}, "length_penalty"),
    ({"length_penalty": 1.0}, "length_penalty"),
    ({"beam_width": 2, "n": 2}, "n"),
    ({"beam_width": 2, "temperature": 0.5}, "temperature"),
    ({"beam_width": 2, "seed": 1}, "seed"),
    ({"beam_width": 2, "stop": "."}, "stop"),
    ({"beam_width": 2, "max_tokens": 10 ** 6}, "max_tokens"),
])
def test_bad_beam_options_are_refused_by_name(live_server, ws: WS, fields, param):
    err = ws.error({"type": "generate", "id": "b", "prompt": "Hi", **fields}, mid="b")
    assert err["code"] == "invalid_request" and err["param"] == param, err
    assert_works(ws)
    all_blocks_free(live_server)


def test_beam_width_over_the_server_limit_is_refused_by_name(live_server, ws: WS):
    limit = live_server.runtime.config.max_beam_width
    err = ws.error({"type": "generate", "id": "b", "prompt": "Hi", "beam_width": limit + 1}, mid="b")
    assert err["code"] == "invalid_request" and err["param"] == "beam_width", err
    assert "max_beam_width" in err["message"]
    assert_works(ws)
    all_blocks_free(live_server)


def test_abort_mid_search_gives_every_block_back(live_server, ws: WS):
    mid = ws.start(prompt="Once upon a time", max_tokens=40, beam_width=4)
    ws.accepted(mid)
    ws.send({"type": "abort", "id": mid})
    s = ws.finish(mid, accepted={})
    assert s.error is None and s.done["finish_reason"] in ("abort", "length")
    all_blocks_free(live_server)
    assert_works(ws)
