"""Speculative decoding (core/engine/speculative.py, drafts.py): lossless, leak-free, checked params.

- Greedy: the same tokens as plain decoding, for both drafts, on several prompts, alone and in a
  batch beside plain requests (whose own tokens and probabilities stay bit for bit the same).
- Sampling: the rejection rule keeps the model's distribution. Chi-square goodness-of-fit tests at
  a significance of ALPHA = 1e-3 (a correct rule fails one run in a thousand): on the rule itself
  (speculative.verify) with a point-mass draft and with a drawn one, for one draft token and for the
  first three tokens of two (a rejection at the second position, the extra token), and through the engine on the
  tiny model with top_k = TOP_K, on the joint distribution of the first two generated tokens.
- KV blocks: none leak after rejections, preemption or abort; block tables and reference counts
  agree after every step.
"""

import collections
import functools

import pytest
import torch

from core import EngineConfig, InvalidParameter, SamplingParams
from core.engine.drafts import Draft, ngram_propose
from core.engine.sampling_params import MAX_SPECULATIVE_TOKENS
from core.engine.speculative import verify

ALPHA = 1e-3      # the significance of every chi-square test here
TOP_K = 4         # the tiny model's sampling vocabulary in the engine's statistical tests
MIN_EXPECTED = 5  # cells with a smaller expected count are pooled (the chi-square approximation's rule)

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,",
    "Once upon a time, in a quiet village by the sea,",
]


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 24), ignore_eos=True, **kw)


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """P-value of Pearson's chi-square statistic, cells with expected < MIN_EXPECTED pooled."""
    cells, pool_o, pool_e = [], 0, 0.0
    for o, e in zip(observed, expected):
        if e < MIN_EXPECTED:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            cells.append((o, e))
    if pool_e > 0:
        cells.append((pool_o, pool_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def check_pool(engine):
    """After a step: every running sequence's table covers its computed tokens and no more, and
    each block's reference count is the number of tables holding it."""
    bm = engine.block_manager
    held = collections.Counter()
    for seq in engine.scheduler.running:
        assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens), seq.request_id
        held.update(seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == held[block.block_id]
        assert (block.ref_count == 0) == (block.block_id in bm.free)


def run_all(engine, seqs, after_step=None, check=True):
    """Step until every request in seqs has finished, checking the pool after each step (unless
    check is False); -> {request_id: final output}."""
    for seq in seqs:
        engine.add_sequence(seq)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if check:
            check_pool(engine)
        if after_step:
            after_step()
    return final


@pytest.fixture
def one_thread():
    """torch on one thread for the many small operations of the statistical tests (on a busy
    machine, two threads make each one many times slower), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield 1
    torch.set_num_threads(before)


# -- params ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    ({"speculation": "medusa"}, "speculation"),
    ({"speculation": 1}, "speculation"),
    ({"speculation": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculation": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "num_speculative_tokens"),
    ({"speculation": "self", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"speculation": "self", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 4}, "num_speculative_tokens"),
    ({"speculation": "ngram", "top_candidates": 5}, "top_candidates"),
])
def test_bad_speculation_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_speculation_defaults():
    assert SamplingParams().speculation is None and SamplingParams().num_speculative_tokens is None
    p = SamplingParams(speculation="ngram")
    assert p.speculation.value == "ngram" and p.num_speculative_tokens == 4
    assert SamplingParams(speculation="self", num_speculative_tokens=8).num_speculative_tokens == 8


@pytest.mark.parametrize("layers", [0, 2, -1, "1"])
def test_bad_self_draft_layers_name_the_setting(make_tiny_engine, layers):
    with pytest.raises(InvalidParameter) as err:
        make_tiny_engine(self_draft_layers=layers)   # the tiny model has 2 layers: 1 is the only draft
    assert err.value.param == "self_draft_layers"


def test_bad_self_draft_layers_through_the_config():
    with pytest.raises(InvalidParameter) as err:
        EngineConfig(self_draft_layers=0)
    assert err.value.param == "self_draft_layers"


# -- prompt lookup ---------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_last_match():
    assert ngram_propose([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]
    assert ngram_propose([5, 1, 2, 7, 1, 2, 8, 1, 2], 2) == [8, 1]      # the latest occurrence wins
    assert ngram_propose([4, 6, 5, 4, 5], 2) == [4, 5]                  # falls back to a shorter n
    assert ngram_propose([1, 2, 3, 4], 4) == []                        # nothing repeats
    assert ngram_propose([7, 7], 3) == [7]                             # the continuation may run to the end


# -- greedy: plain decoding's tokens ---------------------------------------------------------------

@pytest.mark.parametrize("draft", ["ngram", "self"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculation_alone_equals_plain(make_tiny_llm, assert_pool_clean, draft, k):
    llm = make_tiny_llm(block_size=4, share_cpu=False, enable_prefix_caching=False)  # every step after the prefill is a pass
    for prompt in PROMPTS:
        plain = llm.generate(prompt, greedy(max_tokens=40))[0]
        spec = llm.generate(prompt, greedy(max_tokens=40, speculation=draft, num_speculative_tokens=k))[0]
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        stats = spec.speculation
        assert stats.draft == draft and stats.verify_passes == len(spec.metrics.steps) - 1
        assert stats.accepted + stats.verify_passes == len(spec.token_ids) - 1   # each pass adds kept + 1
        assert len(stats.proposed_per_position) == k
        assert plain.speculation is None
    assert_pool_clean(llm.engine)


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_speculation_on_the_python_forward_equals_plain(make_tiny_llm, assert_pool_clean, draft):
    """native=False: the model's Python forward, and the self draft's first layers in Python too."""
    llm = make_tiny_llm(block_size=4, share_cpu=False, native=False)
    for prompt in PROMPTS[:2]:
        plain = llm.generate(prompt, greedy(max_tokens=24))[0]
        spec = llm.generate(prompt, greedy(max_tokens=24, speculation=draft, num_speculative_tokens=4))[0]
        assert spec.token_ids == plain.token_ids
    assert llm.engine.speculator._layer_draft is None or llm.engine.speculator._layer_draft.native is None
    assert_pool_clean(llm.engine)


def test_prompt_lookup_accepts_on_a_repetitive_prompt(make_tiny_llm):
    """A prompt of one repeated token: the greedy tiny model continues it, and prompt lookup
    guesses the continuation, so passes keep drafts (the counters count them)."""
    llm = make_tiny_llm(share_cpu=False)
    plain = llm.generate("the " * 24, greedy(max_tokens=32))[0]
    spec = llm.generate("the " * 24, greedy(max_tokens=32, speculation="ngram", num_speculative_tokens=4))[0]
    assert spec.token_ids == plain.token_ids
    stats = spec.speculation
    assert stats.proposed > 0 and stats.verify_passes < len(spec.token_ids) - 1
    assert stats.accepted == sum(p.accepted for p in stats.passes)
    assert all(a <= p for a, p in zip(stats.accepted_per_position, stats.proposed_per_position))


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_greedy_speculation_batched_beside_plain_requests(make_tiny_engine, assert_pool_clean, draft):
    """Speculative and plain requests in one batch, joining at different steps, with a small
    token budget: every speculative request's tokens equal its plain run; every plain request
    (greedy, and seeded sampling with its candidates' probabilities) is bit for bit its run alone."""
    def fresh():
        return make_tiny_engine(block_size=4, max_num_batched_tokens=24, share_cpu=False, num_kv_blocks=512)

    def plain_params(i):
        if i % 2:
            return SamplingParams(temperature=0.9, top_k=50, seed=100 + i, max_tokens=20, ignore_eos=True,
                                  top_candidates=5)
        return greedy(max_tokens=20, top_candidates=3)

    alone = {}
    for i, prompt in enumerate(PROMPTS):
        engine = fresh()
        out = run_all(engine, [engine.make_sequence(prompt, greedy(max_tokens=30), request_id=f"s{i}")])
        alone[f"s{i}"] = out[f"s{i}"].token_ids
        engine = fresh()
        out = run_all(engine, [engine.make_sequence(prompt[::-1], plain_params(i), request_id=f"p{i}")])
        alone[f"p{i}"] = (out[f"p{i}"].token_ids, out[f"p{i}"].candidates)

    engine = fresh()
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        seqs.append(engine.make_sequence(prompt, greedy(max_tokens=30, speculation=draft, num_speculative_tokens=3 + i),
                                         request_id=f"s{i}"))
        seqs.append(engine.make_sequence(prompt[::-1], plain_params(i), request_id=f"p{i}"))
    late = seqs[4:]

    def join_late():          # the last prompt's two requests arrive after the others started
        if engine.recorder.num_steps == 3:
            for seq in late:
                engine.add_sequence(seq)
    final = run_all(engine, seqs[:4], after_step=join_late)
    for i in range(len(PROMPTS)):
        assert final[f"s{i}"].token_ids == alone[f"s{i}"], f"speculative request {i}"
        tokens, candidates = alone[f"p{i}"]
        assert final[f"p{i}"].token_ids == tokens, f"plain request {i}"
        assert final[f"p{i}"].candidates == candidates, f"plain request {i}'s probabilities"
    assert sum(final[f"s{i}"].speculation.proposed for i in range(len(PROMPTS))) > 0
    assert_pool_clean(engine)


# -- KV blocks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_no_block_leaks_after_rejections_preemption_and_abort(make_tiny_engine, assert_pool_clean, draft):
    """A pool too small for all at once: requests are preempted (and recomputed) while others
    verify drafts and roll back rejected ones; two are aborted mid-way. Tables and reference
    counts agree after every step; in the end every block is free, and the finished greedy
    requests still equal plain decoding."""
    settings = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, share_cpu=False)
    prompts = PROMPTS + ["the " * 10, "a, b, c, a, b, c, a, b,"]
    engine = make_tiny_engine(**settings)
    plain = run_all(engine, [engine.make_sequence(p, greedy(max_tokens=28), request_id=str(i))
                             for i, p in enumerate(prompts)])
    engine = make_tiny_engine(**settings)
    seqs = [engine.make_sequence(p, greedy(max_tokens=28, speculation=draft, num_speculative_tokens=4), request_id=str(i))
            for i, p in enumerate(prompts)]
    aborted = []

    def abort_two():
        if engine.recorder.num_steps == 6:
            for rid in ("1", "3"):
                if engine.abort(rid) is not None:
                    aborted.append(rid)
    final = run_all(engine, seqs, after_step=abort_two)
    assert sum(s.num_preemptions for s in seqs) > 0, "the test meant to preempt"
    assert sum(s.speculation.proposed - s.speculation.accepted for s in seqs) > 0, "the test meant to reject"
    assert aborted
    for rid, out in final.items():
        if rid not in aborted:
            assert out.token_ids == plain[rid].token_ids, rid
    assert_pool_clean(engine)


def test_a_stop_token_inside_the_kept_drafts_ends_the_request_there(make_tiny_llm, assert_pool_clean):
    llm = make_tiny_llm(block_size=4, share_cpu=False)
    prompt = "the " * 24
    plain = llm.generate(prompt, greedy(max_tokens=32))[0]
    stop = plain.token_ids[5]
    want = llm.generate(prompt, greedy(max_tokens=32, stop_token_ids=[stop]))[0]
    got = llm.generate(prompt, greedy(max_tokens=32, stop_token_ids=[stop], speculation="ngram",
                                      num_speculative_tokens=8))[0]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop" and got.stop_reason == stop
    assert_pool_clean(llm.engine)


# -- sampling: the model's distribution ------------------------------------------------------------

@pytest.mark.parametrize("point_mass", [True, False])
def test_the_rejection_rule_keeps_the_target_distribution(one_thread, point_mass):
    """verify() on fixed logits, many seeds: the first token it emits (a kept draft token or the
    correction) is distributed as the target p, whatever the draft q."""
    V, N = 8, 10000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -9.0]] * 2)   # (d + 1 = 2, V)
    params = SamplingParams(temperature=1.0, top_k=6)                          # tokens 6, 7 are filtered out
    p = torch.softmax(logits[0, :6], dim=-1).tolist() + [0.0, 0.0]
    q = torch.tensor([0.05, 0.05, 0.1, 0.1, 0.2, 0.1, 0.2, 0.2])                 # a draft with its own mind
    counts = [0] * V
    kept = 0
    for seed in range(N):
        g = torch.Generator().manual_seed(seed)
        if point_mass:
            x = seed % V                                # proposals everywhere, in and out of the top-k
            draft = Draft([x])
        else:
            x = int(torch.multinomial(q, 1, generator=g)[0])
            draft = Draft([x], q[None])
        accepted, token = verify(logits, draft, params, g)
        first = x if accepted else token
        counts[first] += 1
        kept += accepted
    assert counts[6] == counts[7] == 0
    assert 0 < kept < N
    assert chi_square_p(counts[:6], [N * pi for pi in p[:6]]) > ALPHA


@pytest.mark.parametrize("point_mass", [True, False])
def test_the_rejection_rule_keeps_the_joint_distribution_past_the_first_draft_token(one_thread, point_mass):
    """verify() with two draft tokens on a small model of its own (each position's logits depend on
    the tokens before it), many seeds: the first three tokens emitted, (y0, y1, y2), are distributed
    as the model's p0(y0) p1(y1 | y0) p2(y2 | y0, y1). This reaches what one draft token cannot: a
    rejection at the second draft position (its correction drawn from p1's residual given the kept
    first token), and the extra token drawn from p2 when both are kept. Tokens the pass does not
    emit come from the next passes, drawn from the model as plain sampling does (sampler.draw)."""
    from core.model.sampler import draw
    V, N, T = 4, 30000, 0.8
    g = torch.Generator().manual_seed(1234)
    L0 = torch.randn(V, generator=g)                                        # the model: logits at each position
    L1 = torch.randn(V, V, generator=g)                                     # [y0]
    L2 = torch.randn(V, V, V, generator=g)                                  # [y0, y1]
    Q0 = torch.softmax(torch.randn(V, generator=g), -1)                     # a drawn draft with its own mind
    Q1 = torch.softmax(torch.randn(V, V, generator=g), -1)
    params = SamplingParams(temperature=T)

    def p(logits):
        return torch.softmax(logits.double() / T, -1)

    counts = torch.zeros(V, V, V, dtype=torch.long)
    kept = collections.Counter()
    for seed in range(N):
        gen = torch.Generator().manual_seed(seed)
        if point_mass:
            x0, x1 = seed % V, (seed // V) % V                              # proposals of every kind
            draft = Draft([x0, x1])
        else:
            x0 = draw(Q0, gen)
            x1 = draw(Q1[x0], gen)
            draft = Draft([x0, x1], torch.stack([Q0, Q1[x0]]))
        logits = torch.stack([L0, L1[x0], L2[x0, x1]])                      # (d + 1 = 3, V)
        accepted, token = verify(logits, draft, params, gen)
        kept[accepted] += 1
        ys = draft.tokens[:accepted] + [token]
        while len(ys) < 3:                                                  # the next passes
            ys.append(draw(p(L1[ys[0]] if len(ys) == 1 else L2[ys[0], ys[1]]), gen))
        counts[ys[0], ys[1], ys[2]] += 1
    assert set(kept) == {0, 1, 2}, kept                                     # every case was reached
    expected = p(L0)[:, None, None] * p(L1)[:, :, None] * p(L2)             # (V, V, V)
    assert chi_square_p(counts.flatten().tolist(), (N * expected).flatten().tolist()) > ALPHA

def next_token_distribution(engine, ids) -> dict[int, float]:
    """The model's sampling distribution after ids under the test's params (temperature 1, top_k =
    TOP_K): the probabilities the engine's sampler reports (top_candidates = TOP_K)."""
    seq = engine.add_request(ids, SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=1, top_candidates=TOP_K,
                                                 seed=0))
    while not seq.is_finished:
        engine.step()
    return {c.token_id: c.final_prob for c in seq.candidates[0] if c.final_prob > 0}


def prompt_holding_its_candidates(engine, text: str) -> list[int]:
    """text's tokens, with the likely next tokens put in front until every one of them already
    occurs in the prompt: whatever the first sampled token, prompt lookup then finds it in the
    context and proposes what followed it, so the second token comes from a pass with a draft."""
    ids = engine.tokenizer.encode(text)
    for _ in range(8):
        candidates = next_token_distribution(engine, ids)
        if set(candidates) <= set(ids):
            return ids
        ids = sorted(candidates) + ids
    raise AssertionError("no prompt holds its own candidates; choose another text")


def first_two_distribution(engine, prompt_ids):
    """The model's exact joint distribution of the first two tokens: P(t1) after the prompt,
    P(t2 | t1) after prompt + t1."""
    dist = functools.partial(next_token_distribution, engine)
    joint = {}
    for t1, p1 in dist(prompt_ids).items():
        for t2, p2 in dist(prompt_ids + [t1]).items():
            joint[(t1, t2)] = p1 * p2
    return joint


@pytest.mark.slow          # a thousand seeded requests: `make test` runs it, the inner loop does not
@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_speculative_sampling_keeps_the_models_distribution(make_tiny_engine, one_thread, draft):
    """Many seeds through the engine, all in continuous batches: the first token comes from the
    prefill, the second from a verify pass of (at most, with max_tokens = 3) one draft token;
    their joint distribution must be the model's."""
    engine = make_tiny_engine(share_cpu=False, num_threads=one_thread, max_num_seqs=64, num_kv_blocks=4096)
    prompt = prompt_holding_its_candidates(engine, "one two one two one two one two one two one")
    joint = first_two_distribution(engine, prompt)
    cells = sorted(joint)
    N = 1000
    seqs = [engine.make_sequence(prompt, SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, seed=s,
                                                        ignore_eos=True, speculation=draft, num_speculative_tokens=3))
            for s in range(N)]
    final = run_all(engine, seqs, check=False)
    assert all(s.speculation.passes[0].proposed for s in seqs), "every second token from a pass with a draft"
    observed = collections.Counter(tuple(out.token_ids[:2]) for out in final.values())
    assert set(observed) <= set(cells)
    proposed = sum(s.speculation.proposed for s in seqs)
    kept = sum(s.speculation.accepted for s in seqs)
    assert 0 < kept < proposed, "the test meant to keep some drafts and reject others"
    assert chi_square_p([observed[c] for c in cells], [N * joint[c] for c in cells]) > ALPHA
