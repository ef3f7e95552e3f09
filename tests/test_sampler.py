"""The sampler on hand-made logits (filters, greedy, candidates, seeds), then seeded requests
through the engine (tiny model: at temperature 4 its tokens vary enough to tell seeds apart)."""

import math

import pytest
import torch

from bounds import U32, gamma
from core import SamplingParams
from core.model.sampler import Sampler, draw, filter_logits


def one_row(logits):
    return torch.tensor([logits], dtype=torch.float32)


def kept(filtered) -> set[int]:
    return set(torch.isfinite(filtered[0]).nonzero().flatten().tolist())


def filt(logits, temperature=1.0, top_k=0, top_p=1.0):
    return filter_logits(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))


# Probabilities that are exact in binary, placed out of order so sorting matters.
PROBS = {3: 0.5, 0: 0.25, 4: 0.125, 1: 0.0625, 2: 0.0625}
LOGITS = one_row([math.log(PROBS[i]) for i in range(5)])
# A probability the sampler computes in fp32 from LOGITS, against the exact one: LOGITS are log p
# rounded to fp32 (off by at most u |log p| <= u log 16), which moves a softmax weight p_j by at most
# 2 p_j max|delta|; the softmax's own roundings (max, exp within 2 ulps, a sum of 5, a divide) by
# (gamma_5 + 6u) p_j, and a renormalization after top-k/top-p (a sum of at most 5, a divide) by
# (gamma_5 + u) p_j (tests/bounds.py: attention_f32_bound's softmax argument). p <= 1; doubled for
# second-order terms.
PROB_TOL = 2 * (2 * U32 * math.log(16) + 2 * gamma(5) + 7 * U32)


# -- filters -----------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 5, 17, 99])
def test_top_k_keeps_exactly_k(k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(1, 100, generator=g)
    out = filt(logits, top_k=k)
    assert kept(out) == set(logits[0].topk(k).indices.tolist())
    assert len(kept(out)) == k
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])          # kept logits are untouched
    assert torch.all(out[~finite] == float("-inf"))


def test_top_k_off():
    logits = torch.randn(1, 50)
    assert torch.equal(filt(logits, top_k=0), logits)
    assert len(kept(filt(logits, top_k=50))) == 50
    assert len(kept(filt(logits, top_k=1000))) == 50


@pytest.mark.parametrize("p, expected", [
    (1e-6, {3}),               # the most likely token is always kept (a top_p, not a tolerance)
    (0.49, {3}),
    (0.5, {3}),                # 0.5 alone reaches p exactly
    (0.51, {3, 0}),
    (0.75, {3, 0}),            # 0.5 + 0.25 reaches it exactly
    (0.76, {3, 0, 4}),
    (0.875, {3, 0, 4}),
    (0.9, {3, 0, 4, 1, 2}),    # 1 and 2 tie at 0.0625: a tie at the edge keeps one of them ...
    (1.0, {0, 1, 2, 3, 4}),
])
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    got = kept(filt(LOGITS, top_p=p))
    if p == 0.9:               # ... exactly one of the tied pair (4 tokens reach 0.9375)
        assert len(got) == 4 and {3, 0, 4} < got and got <= expected
    else:
        assert got == expected


def test_top_p_applies_after_top_k_and_temperature():
    # top-k 2 leaves 0.5 and 0.25, renormalised to 2/3 and 1/3
    assert kept(filt(LOGITS, top_k=2, top_p=0.6)) == {3}
    assert kept(filt(LOGITS, top_k=2, top_p=0.7)) == {3, 0}
    assert kept(filt(LOGITS, top_k=2, top_p=1.0)) == {3, 0}
    # temperature 0.5 squares the probabilities: 0.25, 0.0625, ... renormalised -> 0.25/0.3359 = 0.744
    assert kept(filt(LOGITS, temperature=0.5, top_p=0.74)) == {3}
    assert kept(filt(LOGITS, temperature=0.5, top_p=0.75)) == {3, 0}
    # a high temperature flattens: more tokens are needed to reach the same p
    assert len(kept(filt(LOGITS, temperature=10.0, top_p=0.75))) == 4


def test_temperature_divides_the_logits():
    logits = torch.randn(1, 20)
    for t in (0.3, 1.0, 2.5):
        out = filt(logits, temperature=t)
        # the same fp32 logits divided by t, once rounded to fp32 (the sampler's tensor) or not:
        # each quotient correctly rounded, so within (u + u + u) |x / t| of each other; 4u for the rest
        assert torch.allclose(out, logits / t, rtol=4 * U32, atol=0)
        # two softmaxes of inputs within 4u |x/t| of each other: p_j moves by at most 2 p_j max|dx|,
        # and each softmax's own roundings by (gamma_20 + 6u) p_j (see PROB_TOL); p <= 1, doubled
        dx = 4 * U32 * float((logits / t).abs().max())
        assert torch.allclose(out.softmax(-1), torch.softmax(logits / t, -1), rtol=0,
                              atol=2 * (2 * dx + 2 * (gamma(20) + 6 * U32)))


def test_per_row_parameters():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 64, generator=g)
    out = filter_logits(logits, torch.tensor([1.0, 0.5, 2.0]), torch.tensor([5, 0, 10]),
                        torch.tensor([1.0, 0.9, 1.0]))
    assert torch.isfinite(out[0]).sum() == 5
    assert torch.isfinite(out[2]).sum() == 10
    probs = torch.softmax(logits[1] / 0.5, -1).sort(descending=True).values
    need = int((probs.cumsum(0) < 0.9).sum()) + 1            # smallest prefix reaching 0.9
    assert torch.isfinite(out[1]).sum() == need


def test_a_row_is_filtered_the_same_alone_or_beside_any_others():
    """Batch invariance: rows of every kind (top-k alone, top-p alone, both, neither, k above the
    vocabulary) in one call, in two orders, give each row exactly the bits it gets alone."""
    g = torch.Generator().manual_seed(11)
    V = 49152                                              # SmolLM2's vocabulary
    logits = torch.randn(7, V, generator=g) * 4
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.9, 1.0, 0.5])
    top_k = torch.tensor([50, 0, 50, 0, 7, V + 3, 50])
    top_p = torch.tensor([1.0, 0.9, 0.95, 1.0, 0.5, 0.8, 1.0])
    together = filter_logits(logits, temperature, top_k, top_p)
    alone = torch.cat([filter_logits(logits[i:i + 1], temperature[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
                       for i in range(7)])
    assert torch.equal(together, alone)
    flip = torch.arange(6, -1, -1)
    assert torch.equal(filter_logits(logits[flip], temperature[flip], top_k[flip], top_p[flip]), together[flip])
    assert torch.isfinite(together[0]).sum() == 50 and torch.isfinite(together[6]).sum() == 50
    assert torch.equal(together[3], logits[3] / temperature[3])                 # no filter: untouched


def test_draw_follows_the_weights_and_never_draws_a_zero():
    """draw's law is the weights' (Pearson's chi-square over 20,000 seeded draws, at significance
    1e-3: a correct draw fails one run in a thousand), no index of weight 0 is ever drawn (leading,
    inner and trailing zeros), the weights need not sum to 1, and all-zero weights are refused by name."""
    from test_speculative import ALPHA, chi_square_p
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0, 0.0])   # sums to 7, not 1
    g = torch.Generator().manual_seed(5)
    N = 20_000
    counts = torch.bincount(torch.tensor([draw(weights, g) for _ in range(N)]), minlength=len(weights))
    assert counts[weights == 0].sum() == 0
    kept = weights > 0
    assert chi_square_p(counts[kept].tolist(), (N * weights[kept] / weights.sum()).tolist()) > ALPHA
    with pytest.raises(ValueError, match="weights"):
        draw(torch.zeros(5), g)


# -- the sampler -------------------------------------------------------------------------------

def test_temperature_zero_is_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 6
    tokens, cands = Sampler()(logits, params, [None] * 6)
    assert tokens == logits.argmax(-1).tolist()
    assert cands == [None] * 6


def test_top_k_one_is_argmax_at_any_temperature():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 100, generator=g)
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    tokens, _ = Sampler()(logits, [SamplingParams(temperature=5.0, top_k=1)] * 8, gens)
    assert tokens == logits.argmax(-1).tolist()


def test_sampling_follows_the_filtered_distribution():
    n = 6000
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.08, 0.02]])).expand(n, 4).contiguous()
    gen = torch.Generator().manual_seed(11)
    tokens, _ = Sampler()(logits, [SamplingParams(temperature=1.0)] * n, [gen] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    # each frequency is a binomial proportion of n draws, standard deviation sqrt(p (1 - p) / n) <=
    # sqrt(1/4 / n) = 0.0065: within 4 of those (a 6e-5 chance of missing for a fresh seed; seeded here)
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.08, 0.02]), rtol=0, atol=4 * math.sqrt(0.25 / n))
    tokens, _ = Sampler()(logits, [SamplingParams(temperature=1.0, top_k=2)] * n, [gen] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert freq[2] == 0 and freq[3] == 0                        # filtered out: never drawn
    assert abs(freq[0].item() - 2 / 3) < 0.025                  # renormalised 0.6 / 0.9


def test_same_seed_same_draws():
    logits = torch.randn(1, 1000)
    params = [SamplingParams(temperature=1.0, seed=5)]

    def draws(seed):
        gen = torch.Generator().manual_seed(seed)
        return [Sampler()(logits, params, [gen])[0][0] for _ in range(30)]
    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(3, 50)
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.0)]
    tokens, _ = Sampler()(logits, params, [None, gen, None])
    assert tokens == logits.argmax(-1).tolist()


def test_candidates_before_and_after_filters():
    logits = LOGITS.clone()
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=1.0, top_k=2, top_candidates=4)]
    tokens, cands = Sampler()(logits, params, [gen])
    (row,) = cands
    assert [c.token_id for c in row] == [3, 0, 4, 1] or [c.token_id for c in row] == [3, 0, 4, 2]
    for c in row:
        assert c.prob == pytest.approx(PROBS[c.token_id], abs=PROB_TOL)      # raw softmax
        # raw logit, unscaled: log p rounded once to fp32, within u |log p|
        assert c.logit == pytest.approx(math.log(PROBS[c.token_id]), abs=U32 * abs(math.log(PROBS[c.token_id])))
    finals = {c.token_id: c.final_prob for c in row}
    assert finals[3] == pytest.approx(2 / 3, abs=PROB_TOL) and finals[0] == pytest.approx(1 / 3, abs=PROB_TOL)
    assert finals[4] == 0.0                                  # cut by top-k: probability exactly 0
    assert tokens[0] in (3, 0)


def test_candidates_of_a_greedy_row():
    logits = LOGITS.clone()
    tokens, cands = Sampler()(logits, [SamplingParams(temperature=0.0, top_candidates=2)], [None])
    assert tokens == [3]
    assert [(c.token_id, c.final_prob) for c in cands[0]] == [(3, 1.0), (0, 0.0)]
    assert cands[0][0].prob == pytest.approx(0.5, abs=PROB_TOL) and cands[0][1].prob == pytest.approx(0.25, abs=PROB_TOL)


def test_candidates_include_the_chosen_token():
    logits = LOGITS.clone()
    for seed in range(100):
        gen = torch.Generator().manual_seed(seed)
        tokens, cands = Sampler()(logits, [SamplingParams(temperature=1.0, top_candidates=1)], [gen])
        if tokens[0] != 3:
            break
    else:
        pytest.fail("100 seeds never drew anything but the most likely token")
    ids = [c.token_id for c in cands[0]]
    assert ids == [3, tokens[0]]                            # the top one, then the one drawn
    assert cands[0][1].final_prob == pytest.approx(PROBS[tokens[0]], abs=PROB_TOL)


# -- seeded requests through the engine ----------------------------------------------------------

def seeded(seed, **kw):
    return SamplingParams(temperature=4.0, top_p=0.95, seed=seed, max_tokens=12, ignore_eos=True, **kw)


def test_seeded_request_same_tokens_twice_and_in_any_batch(make_tiny_llm, assert_pool_clean):
    llm = make_tiny_llm()
    prompt = "Once upon a time"
    alone = llm.generate(prompt, seeded(42))[0].token_ids
    assert llm.generate(prompt, seeded(42))[0].token_ids == alone
    assert len(set(alone)) > 3                              # it really sampled
    crowd = llm.generate(["The weather", prompt, "A", prompt],
                         [seeded(1), seeded(42), SamplingParams(temperature=0.0, max_tokens=20), seeded(7)])
    assert crowd[1].token_ids == alone
    assert crowd[3].token_ids != alone                      # another seed, other tokens
    other = make_tiny_llm(max_num_batched_tokens=3, max_num_seqs=2)   # chunked, other batches
    assert other.generate(["Hello there", prompt], [seeded(3), seeded(42)])[1].token_ids == alone
    assert_pool_clean(llm.engine)
    assert_pool_clean(other.engine)


def test_unseeded_requests_follow_the_engine_seed(make_tiny_llm):
    params = SamplingParams(temperature=4.0, max_tokens=12, ignore_eos=True)
    a = make_tiny_llm(seed=123).generate(["Once upon a time"] * 3, params)
    b = make_tiny_llm(seed=123).generate(["Once upon a time"] * 3, params)
    c = make_tiny_llm(seed=124).generate(["Once upon a time"] * 3, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1         # each request draws on its own
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_engine_candidates(make_tiny_llm):
    llm = make_tiny_llm()
    out = llm.generate("Once upon a time", seeded(9, top_candidates=5))[0]
    assert len(out.candidates) == len(out.token_ids)
    for token, row in zip(out.token_ids, out.candidates):
        assert token in [c.token_id for c in row]
        assert 5 <= len(row) <= 6
        assert all(0.0 <= c.prob <= 1.0 and 0.0 <= c.final_prob <= 1.0 for c in row)
        probs = [c.prob for c in row[:5]]
        assert probs == sorted(probs, reverse=True)
    assert llm.generate("Once upon a time", seeded(9))[0].candidates is None


def test_top_p_one_keeps_every_token_beside_a_filtering_row():
    """Row 0 asks for nothing to be cut; row 1's top-p must not cut row 0's float32 tail."""
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(3)) * 4
    out = filter_logits(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 0.5]))
    assert bool(torch.isfinite(out[0]).all())
    assert int(torch.isfinite(out[1]).sum()) < 49152


def test_a_vanishing_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([[0.1, 2.0, 0.3, 1.9]])
    out = filter_logits(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1e-46]))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, False]


def test_overflowing_logits_fall_back_to_the_argmax():
    logits = torch.tensor([[1.0, 3e38, -3e38, 2.0]])
    params = [SamplingParams(temperature=1e-3, seed=0)]
    tokens, _ = Sampler()(logits, params, [torch.Generator().manual_seed(0)])
    assert tokens == [1]


@pytest.mark.parametrize("t", [1e-45, 1e-38, 1e-6])
def test_a_vanishing_temperature_means_greedy(t):
    assert SamplingParams(temperature=t).temperature == 0.0
    assert SamplingParams(temperature=t).greedy


def test_greedy_rows_take_the_first_largest_logit_as_torch_does():
    """argmax_rows (numpy's scan) against torch.argmax: ties to the first, NaN as the largest, a row
    of -inf, and a bfloat16 row (torch's own reduction)."""
    from core.model.sampler import argmax_rows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g)
    x[1, 3] = x[1, 7] = 50.0
    x[2, 9] = float("nan")
    x[3] = float("-inf")
    x[4] = 0.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1)) and argmax_rows(x).tolist()[1:5] == [3, 9, 0, 0]
    assert torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().argmax(dim=-1))
