"""Blocks shared and taken back: n samples, beam search, copy-on-write, preemption by swap.

On the tiny model. Reference counts are checked at every step against a count made from the
block tables of the sequences holding blocks, and at chosen steps against numbers worked out by
hand; outputs are checked token for token against lone requests (seeded samples) or a plain
beam search on full recomputation (beams), and preempted requests against unpreempted runs.
"""

import math
from collections import Counter

import pytest

from core import InvalidParameter, SamplingParams
from core.config import EngineConfig
from core.engine.beam_search import BeamSearchParams
from core.engine.sampling_params import MAX_SEED, derived_seed
from core.engine.sequence import SequenceStatus

PROMPT = [1, 17, 29, 311, 47, 5]                 # 6 tokens: with blocks of 4, one full and one partial
# The tiny model is random with tied embeddings: it nearly always repeats the last token, so the
# samples sample at temperature 8, where its distribution spreads.


def table_count(engine) -> list[int]:
    """Reference counts as the block tables say they should be: how many sequences hold each block."""
    count = Counter(b for s in engine.scheduler.running for b in s.block_table)
    return [count[b] for b in range(engine.block_manager.num_blocks)]


def check_refs(engine):
    assert engine.block_manager.ref_counts() == table_count(engine)


def seeded(seed, n=1, max_tokens=6):
    return SamplingParams(temperature=8.0, seed=seed, n=n, max_tokens=max_tokens, ignore_eos=True)


# -- n samples -------------------------------------------------------------------------------

def test_n_samples_share_the_prompt_and_copy_its_last_block_once_each(make_tiny_engine, assert_pool_clean):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=32, enable_prefix_caching=False)
    engine.add_request(PROMPT, seeded(3, n=3, max_tokens=4))
    bm = engine.block_manager
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        check_refs(engine)
        used.append(bm.num_blocks - bm.num_free_blocks)
        if engine.view.num_steps == 1:   # prefill, then the fork: 3 samples on the prompt's 2 blocks
            tables = [s.block_table for s in engine.scheduler.running]
            assert len(tables) == 3 and all(t == tables[0] for t in tables)
            assert sorted(bm.ref_counts(), reverse=True)[:3] == [3, 3, 0]
            assert bm.num_copies == 0
    # by hand: step 1 writes 6 slots (2 blocks); step 2 writes slot 7 of the shared partial block:
    # samples 0 and 1 copy it, sample 2 writes in place (4 blocks); step 3 writes slot 8, still
    # each sample's own block (4); step 4 writes slot 9, a new block each (7), and all three finish.
    assert used == [2, 4, 4, 0]
    assert bm.num_copies == 2
    assert [row.blocks_copied for row in engine.view.trace] == [0, 2, 0, 0]
    assert_pool_clean(engine)


def test_a_prompt_that_fills_its_blocks_copies_nothing(make_tiny_engine, assert_pool_clean):
    engine = make_tiny_engine(block_size=3, num_kv_blocks=32, enable_prefix_caching=False)
    engine.add_request(PROMPT, seeded(3, n=4, max_tokens=5))
    while engine.has_unfinished_requests():
        engine.step()
        check_refs(engine)
    assert engine.block_manager.num_copies == 0
    assert_pool_clean(engine)


def test_outputs_list_n_completions_and_n1_is_unchanged(make_tiny_llm):
    llm = make_tiny_llm(num_kv_blocks=64)
    (out,) = llm.generate(PROMPT, seeded(5, n=3))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
    assert out.finished and out.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (one,) = llm.generate(PROMPT, seeded(5))
    assert one.samples is None and len(one.outputs) == 1
    assert one.outputs[0].token_ids == one.token_ids == out.outputs[0].token_ids


def test_seeded_samples_are_lone_requests_with_derived_seeds_whatever_the_batch(make_tiny_llm):
    llm = make_tiny_llm(num_kv_blocks=64, block_size=4)
    seed, n = 11, 4
    lone = [llm.generate(PROMPT, seeded(derived_seed(seed, i)))[0].token_ids for i in range(n)]
    (alone,) = llm.generate(PROMPT, seeded(seed, n=n))
    others = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 40, 41], PROMPT + [9, 9]]
    batch = llm.generate([others[0], PROMPT, others[1], others[2]],
                         [seeded(1, n=2), seeded(seed, n=n), seeded(2), seeded(3, n=3)])
    assert [c.token_ids for c in alone.outputs] == lone
    assert [c.token_ids for c in batch[1].outputs] == lone
    assert derived_seed(MAX_SEED, 1) == 0


def test_abort_frees_every_sample_before_and_after_the_fork(make_tiny_engine, assert_pool_clean):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=32, max_num_batched_tokens=4)
    engine.add_request(PROMPT, seeded(1, n=3, max_tokens=8), request_id="a")
    engine.step()                                     # 4 of the 6 prompt tokens: not forked yet
    assert engine.scheduler.slots.count(None) == engine.config.max_num_seqs - 3   # slots held
    out = engine.abort("a")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert_pool_clean(engine)
    engine.add_request(PROMPT, seeded(1, n=3, max_tokens=8), request_id="b")
    for _ in range(4):
        engine.step()
        check_refs(engine)
    assert len(engine.scheduler.running) == 3
    assert engine.abort("b").finished
    assert engine.abort("b") is None
    assert_pool_clean(engine)


def test_n_is_validated_by_name(make_tiny_engine):
    for bad in (0, 65, 1.5, "2"):
        with pytest.raises(InvalidParameter) as err:
            SamplingParams(n=bad)
        assert err.value.param == "n"
    engine = make_tiny_engine(max_num_seqs=4)
    with pytest.raises(InvalidParameter) as err:
        engine.add_request(PROMPT, SamplingParams(n=5))
    assert err.value.param == "n"


# -- preemption by recompute and by swap -----------------------------------------------------

PROMPTS = [[1, 5, 9, 13, 17], [1, 200, 201], [1, 7, 7, 7, 7, 7, 7, 7, 7, 7], [1, 300],
           [1, 31, 32, 33, 34, 35, 36], [1, 90, 91, 92]]


@pytest.mark.parametrize("weight_format", ["fp32", "q4_1"])
def test_preempted_requests_give_exactly_their_unpreempted_tokens(make_tiny_llm, assert_pool_clean,
                                                                  weight_format):
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 4 + [seeded(7, max_tokens=12),
                                                                                     seeded(8, n=2, max_tokens=12)]
    roomy = make_tiny_llm(block_size=4, num_kv_blocks=128, weight_format=weight_format)
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(PROMPTS, params)]
    for mode in ("recompute", "swap"):
        llm = make_tiny_llm(block_size=4, num_kv_blocks=10, weight_format=weight_format, preemption_mode=mode,
                            enable_prefix_caching=False)
        got = llm.generate(PROMPTS, params)
        assert [[c.token_ids for c in o.outputs] for o in got] == want, mode
        trace = list(llm.engine.view.trace)
        assert any(row.preempted for row in trace), "the pool was meant to be too small"
        swapped_out = sum(len(row.swapped_out) for row in trace)
        if mode == "swap":
            assert swapped_out and swapped_out == sum(len(row.swapped_in) for row in trace)
            assert sum(r.blocks_swapped_out for r in trace) == sum(r.blocks_swapped_in for r in trace) > 0
            assert all(r.swap_s > 0 for r in trace if r.blocks_swapped_out or r.blocks_swapped_in)
            assert llm.engine.scheduler.swap.num_free_blocks == llm.engine.scheduler.swap.num_blocks
        else:
            assert swapped_out == 0
        assert max(row.kv_blocks_used for row in trace) <= 10
        assert_pool_clean(llm.engine)


def test_refs_match_the_tables_at_every_step_under_preemption(make_tiny_engine, assert_pool_clean):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=9, preemption_mode="swap", num_swap_blocks=4,
                              enable_prefix_caching=False)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, seeded(i, n=1 + i % 3, max_tokens=10))
    kinds = set()
    while engine.has_unfinished_requests():
        engine.step()
        check_refs(engine)
        swap = engine.scheduler.swap
        held = sum(len(s.host_table) for s in engine.scheduler.swapped)
        assert swap.num_free_blocks == swap.num_blocks - held
        row = engine.view.trace[-1]
        kinds |= {"swap" for _ in row.swapped_out} | {"recompute" for r in row.preempted if r not in row.swapped_out}
    assert kinds == {"swap", "recompute"}    # the 4-block host pool cannot take every victim
    assert_pool_clean(engine)


def test_abort_while_swapped_gives_the_host_blocks_back(make_tiny_engine, assert_pool_clean):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=6, preemption_mode="swap", enable_prefix_caching=False)
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(p, seeded(i, max_tokens=14), request_id=str(i))
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    assert victim.status == SequenceStatus.SWAPPED and victim.host_table
    engine.abort(victim.request_id)
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting) + list(engine.scheduler.swapped):
        engine.abort(seq.request_id)
    assert engine.scheduler.swap.num_free_blocks == engine.scheduler.swap.num_blocks
    assert_pool_clean(engine)


def test_preemption_mode_is_validated_by_name():
    with pytest.raises(InvalidParameter) as err:
        EngineConfig(preemption_mode="drop")
    assert err.value.param == "preemption_mode"
    with pytest.raises(InvalidParameter) as err:
        EngineConfig(num_swap_blocks=0)
    assert err.value.param == "num_swap_blocks"


# -- beam search -----------------------------------------------------------------------------

def reference_beam_search(ref, prompt, width, max_tokens, eos, length_penalty=1.0):
    """A plain beam search: every beam's next-token log-probabilities from a fresh prefill of its
    whole sequence (no KV cache kept between steps, no sharing), the same selection rule."""
    def top(tokens):
        (out,) = ref.generate(tokens, SamplingParams(temperature=0.0, max_tokens=1, top_candidates=2 * width))
        cands = out.candidates[0][: 2 * width]
        return [(math.log(c.prob), c.token_id) for c in cands]

    live, complete = [([], 0.0)], []
    for _ in range(max_tokens):
        cands = [(cum + lp, out + [tok]) for out, cum in live for lp, tok in top(prompt + out)]
        going = []
        for cum, toks in cands:
            (complete if toks[-1] in eos else going).append((toks, cum))
        going.sort(key=lambda b: b[1], reverse=True)
        live = going[:width]
    complete += live

    def score(b):
        n = len(b[0]) - (b[0][-1] in eos)
        return b[1] / max(1, n) ** length_penalty
    return sorted(complete, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width,penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beam_search_equals_a_reference_on_full_recomputation(make_tiny_llm, assert_pool_clean, width, penalty):
    llm = make_tiny_llm(block_size=4, num_kv_blocks=64)
    ref = make_tiny_llm(block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    eos = llm.engine.stop_token_ids
    prompts = [PROMPT, [1, 80, 81]]
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=penalty))
    for prompt, result in zip(prompts, results):
        want = reference_beam_search(ref, prompt, width, 5, eos, penalty)
        assert [b.token_ids for b in result.sequences] == [toks for toks, _ in want]
        for beam, (_, cum) in zip(result.sequences, want):
            # fp32 log-probabilities summed over 5 steps, from two computations of the same
            # logits: each term within a few ulps of |log p| < 20, so 5 * 20 * 2**-20 bounds it
            assert beam.cum_logprob == pytest.approx(cum, abs=5 * 20 * 2 ** -20)
            assert beam.text == llm.tokenizer.decode([t for t in beam.token_ids if t not in eos])
    assert_pool_clean(llm.engine)


def test_beams_fork_by_sharing_blocks_and_pruned_beams_free_at_once(make_tiny_engine, assert_pool_clean):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    group = engine.add_beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    while not group.is_finished:
        engine.step()
        check_refs(engine)
        live = {s.request_id for s in group.live}
        held = {s.request_id for s in engine.scheduler.running}
        assert held == live or group.is_finished     # a pruned beam holds nothing after the step
        if engine.view.num_steps == 1:               # the prompt's 2 blocks, shared by 3 beams
            assert sorted(engine.block_manager.ref_counts(), reverse=True)[:2] == [3, 3]
    assert len(group.result.sequences) == 3
    assert engine.block_manager.num_copies >= 2
    assert_pool_clean(engine)


def test_beam_search_params_are_validated_by_name(make_tiny_engine):
    for kwargs, name in [({"beam_width": 0, "max_tokens": 4}, "beam_width"),
                         ({"beam_width": 17, "max_tokens": 4}, "beam_width"),
                         ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                         ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty")]:
        with pytest.raises(InvalidParameter) as err:
            BeamSearchParams(**kwargs)
        assert err.value.param == name
    engine = make_tiny_engine(max_num_seqs=2)
    with pytest.raises(InvalidParameter) as err:
        engine.add_beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=2))
    assert err.value.param == "beam_width"



def run_beams(engine, groups, max_steps=3000):
    """Step until every group is done, checking reference counts at each step; a search that
    stops making progress fails here instead of hanging."""
    for _ in range(max_steps):
        if all(g.is_finished for g in groups):
            return [[(b.token_ids, b.cum_logprob) for b in g.result.sequences] for g in groups]
        engine.step()
        check_refs(engine)
    raise AssertionError(f"beam search not done after {max_steps} steps: it hangs")


BEAM_PROMPTS = [PROMPT, [1, 80, 81], [1, 5, 9, 13, 17]]


@pytest.mark.parametrize("weight_format", ["fp32", "q4_1"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beams_under_preemption_finish_with_their_unpreempted_beams(make_tiny_engine, assert_pool_clean, mode,
                                                                    weight_format):
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    roomy = make_tiny_engine(block_size=4, num_kv_blocks=128, enable_prefix_caching=False,
                             weight_format=weight_format)
    want = run_beams(roomy, [roomy.add_beam_search(p, params) for p in BEAM_PROMPTS])
    # 8 blocks of 4: one beam of 16 tokens fits, the 9 beams of three searches do not
    engine = make_tiny_engine(block_size=4, num_kv_blocks=8, preemption_mode=mode, enable_prefix_caching=False,
                              weight_format=weight_format)
    got = run_beams(engine, [engine.add_beam_search(p, params) for p in BEAM_PROMPTS])
    assert got == want
    assert any(row.preempted for row in engine.view.trace), "the pool was meant to be too small"
    assert engine.block_manager.num_free_blocks == 8
    assert engine.scheduler.swap.num_free_blocks == engine.scheduler.swap.num_blocks
    assert_pool_clean(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_mid_search_under_preemption_gives_every_block_back(make_tiny_engine, assert_pool_clean, mode):
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    engine = make_tiny_engine(block_size=4, num_kv_blocks=8, preemption_mode=mode, enable_prefix_caching=False)
    groups = [engine.add_beam_search(p, params) for p in BEAM_PROMPTS]
    for _ in range(3000):
        engine.step()
        check_refs(engine)
        if any(row.preempted for row in engine.view.trace):
            break
    assert not any(g.is_finished for g in groups)
    for g in groups:
        out = engine.abort(g.request_id)
        assert out is not None and out.finished
    assert engine.block_manager.num_free_blocks == 8
    assert engine.scheduler.swap.num_free_blocks == engine.scheduler.swap.num_blocks
    assert_pool_clean(engine)


def test_beam_blocks_match_a_hand_count_at_every_step(make_tiny_engine, assert_pool_clean):
    """The pool against a count kept by hand beside the search, from the beams alone: every beam
    live in a step writes its uncomputed tokens (a block another beam holds is copied first, once),
    then a beam continued again forks a child holding its blocks, and a pruned beam lets go."""
    bs = 4
    engine = make_tiny_engine(block_size=bs, num_kv_blocks=64, enable_prefix_caching=False)
    group = engine.add_beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    names = iter(range(10 ** 6))                        # a hand-kept block is a name, not a pool id
    beams = {group.root.request_id: (list(PROMPT), [], 0)}   # id -> (tokens, blocks, computed)
    copies = 0
    while not group.is_finished:
        engine.step()
        check_refs(engine)
        holders = Counter(b for _, blocks, _ in beams.values() for b in blocks)
        written = {}
        for rid, (tokens, blocks, computed) in beams.items():
            blocks = list(blocks)
            for i in sorted({p // bs for p in range(computed, len(tokens))}):
                if i < len(blocks) and holders[blocks[i]] > 1:   # copy-on-write
                    holders[blocks[i]] -= 1
                    blocks[i] = next(names)
                    holders[blocks[i]] = 1
                    copies += 1
                elif i == len(blocks):
                    blocks.append(next(names))
                    holders[blocks[i]] = 1
            written[rid] = (tokens, blocks)
        beams = {}
        for seq in [] if group.is_finished else group.live:
            if seq.request_id in written:                 # it goes on: its own blocks
                blocks = written[seq.request_id][1]
            else:                                          # forked from the beam it continues
                (blocks,) = [b for t, b in written.values() if t == seq.token_ids[:-1]]
            beams[seq.request_id] = (list(seq.token_ids), list(blocks), len(seq.token_ids) - 1)
        want = Counter(b for _, blocks, _ in beams.values() for b in blocks)
        assert sorted(c for c in engine.block_manager.ref_counts() if c) == sorted(want.values())
        assert engine.block_manager.num_copies == copies
    assert copies >= 2
    assert_pool_clean(engine)
