"""KV eviction (core/model/attention.py's Eviction; StreamingLLM's sinks plus a sliding window): the
rule, its settings, and the mask in the C++ kernel and the torch path against a float64 reference,
row by row whatever the batch; an engine with a window runs it in every step."""

import math

import pytest
import torch

from bounds import attention_f32_bound
from kernel_paths import kernel_path  # noqa: F401 (a fixture: every kernel path this CPU offers)
from test_attention import assert_bit_identical, invariance_cases, kernel_or_torch, paged_batch, threads  # noqa: F401
from core import EngineConfig
from core.errors import InvalidParameter
from core.model.attention import FULL, Eviction, causal_attention, paged_attention
from core.model.kv_cache import KVCache


def test_a_query_sees_the_sinks_and_its_window():
    rule = Eviction(sink_tokens=2, window=3)
    seen = rule.visible(torch.tensor(9), torch.arange(12)).tolist()
    assert [j for j, s in enumerate(seen) if s] == [0, 1, 7, 8, 9]      # sinks, then p - 3 < j <= p
    assert FULL.visible(torch.tensor(4), torch.arange(6)).tolist() == [True] * 5 + [False]
    assert rule.kept_tokens(100) == 5 and rule.kept_tokens(4) == 4 and FULL.kept_tokens(100) == 100
    assert not FULL.active and rule.active


@pytest.mark.parametrize("field,value", [("kv_window", -1), ("kv_window", 1.5), ("kv_sink_tokens", -2),
                                         ("kv_sink_tokens", "4")])
def test_the_settings_are_checked_and_named(field, value):
    with pytest.raises(InvalidParameter) as info:
        EngineConfig(model="tiny", **{field: value})
    assert info.value.param == field


def test_sinks_need_a_window():
    with pytest.raises(InvalidParameter) as info:
        EngineConfig(model="tiny", kv_sink_tokens=4)
    assert info.value.param == "kv_sink_tokens" and "kv_window" in str(info.value)
    EngineConfig(model="tiny", kv_window=8)                                  # a window without sinks is fine


def masked_reference(q, k, v, rule: Eviction) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) over the keys the rule keeps) v in float64: (T, H, D)."""
    T, H, D = q.shape
    G = H // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    pos = torch.arange(T)
    mask = rule.visible(pos[:, None], pos[None, :])
    scores = torch.einsum("qhd,khd->hqk", qd, kd) / math.sqrt(D)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vd), mask


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("rule", [Eviction(0, 5), Eviction(2, 7), Eviction(4, 16)], ids=str)
def test_paged_attention_applies_the_rule(path, rule, kernel_path):
    """Two sequences in scattered blocks, prefilled in two chunks and decoded, against float64
    attention over the keys the rule keeps; each row within attention_f32_bound of it (tests/bounds.py)."""
    g = torch.Generator().manual_seed(11)
    H, Hkv, D, bs = 4, 2, 16, 4
    lens, tables = [30, 19], [[3, 9, 1, 7, 5, 11, 13, 15], [2, 6, 4, 8, 10]]
    cache = KVCache(1, 16, bs, Hkv, D)
    qs = [torch.randn(n, H, D, generator=g) for n in lens]
    ks = [torch.randn(n, Hkv, D, generator=g) for n in lens]
    vs = [torch.randn(n, Hkv, D, generator=g) for n in lens]
    outputs = [[], []]
    for chunks in ([(0, 0, 20), (1, 0, 9)], [(0, 20, 9), (1, 9, 10)], [(0, 29, 1)]):
        batch = paged_batch(cache, tables, chunks, kernel_or_torch(path))
        if path == "torch":                                    # the groups carry the rule's mask
            from core.model.attention import build_group
            batch.groups = [build_group([(sum(n for _, _, n in chunks[:i]), n, a, tables[s])], bs, 2, rule)
                            for i, (s, a, n) in enumerate(chunks)]
        batch.eviction = rule
        q = torch.cat([qs[s][a:a + n] for s, a, n in chunks])
        y = paged_attention(q, torch.cat([ks[s][a:a + n] for s, a, n in chunks]),
                            torch.cat([vs[s][a:a + n] for s, a, n in chunks]), 0, batch)
        t = 0
        for s, _, n in chunks:
            outputs[s].append(y[t:t + n])
            t += n
    for s in range(2):
        exact, mask = masked_reference(qs[s], ks[s], vs[s], rule)
        bound = 2 * attention_f32_bound(qs[s], ks[s], vs[s], mask)
        got = torch.cat(outputs[s]).double()
        assert ((got - exact).abs() <= bound).all()
        full, causal = masked_reference(qs[s], ks[s], vs[s], FULL)
        if not torch.equal(mask, causal):                        # the rule evicts keys of this sequence
            assert (got - full).abs().max() > bound.max()       # ... and that changed the result


def test_a_window_past_every_position_is_full_attention_bit_for_bit(kernel_path):
    kernel = kernel_or_torch("kernel")
    g = torch.Generator().manual_seed(12)
    cache = KVCache(1, 8, 16, 1, 64)
    n = 40
    q, k, v = torch.randn(n, 3, 64, generator=g), torch.randn(n, 1, 64, generator=g), torch.randn(n, 1, 64, generator=g)
    full = paged_attention(q, k, v, 0, paged_batch(cache, [[1, 4, 2]], [(0, 0, n)], kernel))
    batch = paged_batch(cache, [[1, 4, 2]], [(0, 0, n)], kernel)
    batch.eviction = Eviction(4, n)
    assert torch.equal(paged_attention(q, k, v, 0, batch), full)


def test_the_kernel_applies_the_rule_row_by_row(threads, kernel_path):
    """A row's bits under the rule do not depend on what else the step computes."""
    kernel = kernel_or_torch("kernel")
    g = torch.Generator().manual_seed(13)
    H, Hkv, D, bs, n = 9, 3, 64, 16, 200
    cache = KVCache(1, 2 * (n // bs + 1) + 1, bs, Hkv, D)
    tables = [list(range(1, 2 + n // bs)), list(range(2 + n // bs, 3 + 2 * (n // bs)))]
    q, k, v = torch.randn(2 * n, H, D, generator=g), torch.randn(2 * n, Hkv, D, generator=g), torch.randn(2 * n, Hkv, D, generator=g)
    rule = Eviction(4, 48)

    def run(chunks, rows):
        batch = paged_batch(cache, tables, chunks, kernel)
        batch.eviction = rule
        return paged_attention(q[rows], k[rows], v[rows], 0, batch)
    full = run([(0, 0, n), (1, 0, n)], list(range(2 * n)))
    for t in (0, 3, 4, 47, 48, 60, n - 1):
        assert torch.equal(run([(1, t, 1)], [n + t])[0], full[n + t]), f"token {t} alone"
        if t + 3 <= n:
            assert torch.equal(run([(0, t, 3)], [t, t + 1, t + 2]), full[t:t + 3]), f"tokens {t}.. in a small step"


def test_causal_attention_takes_the_rule_too():
    g = torch.Generator().manual_seed(14)
    q, k, v = torch.randn(24, 4, 16, generator=g), torch.randn(24, 2, 16, generator=g), torch.randn(24, 2, 16, generator=g)
    rule = Eviction(2, 6)
    y, probs = causal_attention(q, k, v, rule)
    exact, mask = masked_reference(q, k, v, rule)
    assert ((y.double() - exact).abs() <= 2 * attention_f32_bound(q, k, v, mask)).all()
    assert (probs[:, ~mask] == 0).all()


@pytest.mark.parametrize("native", [True, False], ids=["C++", "Python"])
def test_an_engine_with_a_window_computes_under_it_in_every_batch(make_tiny_engine, native):
    """The engine's steps (C++ decoder or Python layers, the kernel's attention) use the rule: the
    logits after a long prompt are the same bits alone, batched and chunked; equal to full
    attention's with a window past the prompt, and not with a short one."""
    target = make_tiny_engine().tokenizer.encode("one two three four five six seven eight nine ten " * 4)
    logits = {}
    for name, settings in {"full": {}, "long": {"kv_window": 4096, "kv_sink_tokens": 4},
                           "short": {"kv_window": 8, "kv_sink_tokens": 2}}.items():
        engine = make_tiny_engine(block_size=4, enable_prefix_caching=False, native=native, **settings)
        cases = invariance_cases(engine, target)
        assert_bit_identical(cases)
        logits[name] = next(iter(cases.values()))
    assert torch.equal(logits["long"], logits["full"])
    assert not torch.equal(logits["short"], logits["full"])
