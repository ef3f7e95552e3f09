"""SamplingParams: defaults, normalisation, and validation that names the parameter at fault."""

import pytest

from core import InvalidParameter, SamplingParams
from core.engine.sampling_params import MAX_TOP_CANDIDATES


def test_defaults():
    p = SamplingParams()
    assert p.temperature == 1.0 and p.top_k == 0 and p.top_p == 1.0
    assert p.max_tokens == 16 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos and p.top_candidates == 0
    assert not p.greedy
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0).greedy


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0                 # vLLM's "all"
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]


def test_valid_edges():
    p = SamplingParams(temperature=100.0, top_p=1e-9, top_k=1, max_tokens=1, seed=0,
                       top_candidates=MAX_TOP_CANDIDATES, stop_token_ids=[0, 2])
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (100.0, 1e-9, 1, 1, 0)
    assert p.top_candidates == MAX_TOP_CANDIDATES and p.stop_token_ids == [0, 2]
    p = SamplingParams(seed=(1 << 63) - 1, top_k=1 << 30)
    assert p.seed == (1 << 63) - 1 and p.top_k == 1 << 30


@pytest.mark.parametrize("param, value", [
    ("temperature", -0.1), ("temperature", 100.5), ("temperature", float("nan")), ("temperature", "hot"),
    ("temperature", None), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")), ("top_p", "0.9"),
    ("top_k", -2), ("top_k", 2.5), ("top_k", "5"), ("top_k", False),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.0), ("max_tokens", None),
    ("seed", -1), ("seed", 1 << 63), ("seed", 1.5), ("seed", "42"),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5), ("stop", ("a",)),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", 2),
    ("top_candidates", -1), ("top_candidates", MAX_TOP_CANDIDATES + 1), ("top_candidates", 2.0),
])
def test_invalid_values_name_the_parameter(param, value):
    with pytest.raises(InvalidParameter) as exc:
        SamplingParams(**{param: value})
    assert exc.value.param == param
    assert str(exc.value).startswith(f"{param}:")
    assert exc.value.code == "invalid_request"
    assert isinstance(exc.value, ValueError)


def test_first_bad_parameter_is_reported_alone():
    with pytest.raises(InvalidParameter) as exc:
        SamplingParams(temperature=0.5, max_tokens=0)
    assert exc.value.param == "max_tokens"
