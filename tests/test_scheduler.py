"""The scheduler on its own, with real Sequence objects and a simulated model (no forward pass).

`advance` does what LLMEngine.step does after the model ran: the scheduled tokens count as
computed, full blocks are published, a sequence whose tokens are all computed gets one more
(sampled) token, and one that reached max_tokens finishes.
"""

import pytest

from core.config import EngineConfig
from core.engine.block_manager import BlockManager
from core.engine.sampling_params import SamplingParams
from core.engine.scheduler import Scheduler
from core.engine.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks=64, block_size=4, **settings) -> Scheduler:
    settings.setdefault("chunk_context_tokens", 0)   # budgets in plain tokens, unless a test says
    config = EngineConfig(model="tiny", block_size=block_size, num_kv_blocks=num_blocks, **settings)
    return Scheduler(config, BlockManager(num_blocks, block_size, config.enable_prefix_caching))


def make_seq(rid, num_prompt_tokens, max_tokens=4, first_token=1000) -> Sequence:
    ids = list(range(first_token, first_token + num_prompt_tokens))
    return Sequence(str(rid), ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), None, 0.0)


def advance(sched: Scheduler):
    out = sched.schedule()
    for seq, n in out.scheduled:
        assert n >= 1
        seq.num_computed_tokens += n
        sched.block_manager.publish(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq)
    return out


def run_all(sched: Scheduler, limit=1000):
    steps = []
    while sched.has_work():
        steps.append(advance(sched))
        assert len(steps) < limit
    return steps


def ids(out):
    return [(s.request_id, n) for s, n in out.scheduled]


def test_token_budget_respected_every_step():
    sched = make_scheduler(max_num_batched_tokens=16)
    seqs = [make_seq(i, 40, max_tokens=5, first_token=1000 * (i + 1)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    steps = run_all(sched)
    assert all(out.num_batched_tokens <= 16 for out in steps)
    # the budget is used whole while there is more work than it holds
    assert [out.num_batched_tokens for out in steps[:7]] == [16] * 7
    assert ids(steps[0]) == [("0", 16)]
    assert ids(steps[2]) == [("0", 8), ("1", 8)]   # a chunk of the next prompt fills the step
    assert all(s.is_finished and s.num_output_tokens == 5 for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_max_num_seqs_respected():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(i, 5, max_tokens=3, first_token=100 * (i + 1)) for i in range(5)]
    for s in seqs:
        sched.add(s)
    widths = []
    while sched.has_work():
        out = advance(sched)
        widths.append(len(out.scheduled))
        assert len(sched.running) <= 2
        assert len(sched.slots) == 2
        assert all(s.slot in (0, 1) for s, _ in out.scheduled if not s.is_finished)
    assert max(widths) == 2
    assert all(s.is_finished for s in seqs)
    assert sched.slots == [None, None]


def test_decodes_and_prefill_chunks_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq("a", 5, max_tokens=10)
    sched.add(a)
    assert ids(advance(sched)) == [("a", 5)]        # a's whole prompt; it samples its first token
    b = make_seq("b", 30, first_token=5000)
    sched.add(b)
    out = advance(sched)
    assert ids(out) == [("a", 1), ("b", 7)]         # a decodes while b prefills its first chunk
    out = advance(sched)
    assert ids(out) == [("a", 1), ("b", 7)]
    assert a.num_output_tokens == 3 and b.num_computed_tokens == 14


def test_no_chunking_runs_whole_prompts():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = make_seq("a", 6, max_tokens=2)
    b = make_seq("b", 5, max_tokens=2, first_token=3000)
    big = make_seq("big", 20, max_tokens=2, first_token=6000)   # larger than any budget
    for s in (a, b, big):
        sched.add(s)
    assert ids(advance(sched)) == [("a", 6)]        # b's 5 tokens do not fit the 2 left
    assert ids(advance(sched)) == [("a", 1), ("b", 5)]
    steps = run_all(sched)
    assert ("big", 20) in [pair for out in steps for pair in ids(out)]   # alone, in one piece
    for out in steps:
        if ("big", 20) in ids(out):
            assert ids(out) == [("big", 20)]
    assert all(s.is_finished for s in (a, b, big))


def test_preemption_picks_the_newest_request():
    # 3 blocks of 4 tokens; three 4-token prompts fill them. The next token of each needs a new
    # block: the oldest keeps running, the newest ones give their blocks back.
    sched = make_scheduler(num_blocks=3, block_size=4)
    seqs = [make_seq(i, 4, max_tokens=8, first_token=100 * (i + 1)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = advance(sched)
    assert ids(out) == [("0", 4), ("1", 4), ("2", 4)]
    assert sched.block_manager.num_free_blocks == 0
    out = advance(sched)
    assert out.preempted[0] is seqs[2]               # the newest goes first
    assert seqs[0] not in out.preempted
    assert ("0", 1) in ids(out)
    victim = seqs[2]
    assert victim.status == SequenceStatus.WAITING
    assert victim.num_preemptions == 1
    assert victim.block_table == [] and victim.num_computed_tokens == 0
    assert victim in sched.waiting and victim not in sched.running
    assert victim.num_output_tokens == 1             # its generated token is kept, to recompute
    run_all(sched)
    assert all(s.is_finished and s.num_output_tokens == 8 for s in seqs)
    assert sched.block_manager.num_free_blocks == 3


def test_preempted_request_returns_to_the_front_of_the_queue():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2)
    a, b, c = (make_seq(r, 4, max_tokens=8, first_token=f) for r, f in (("a", 100), ("b", 200), ("c", 300)))
    for s in (a, b, c):
        sched.add(s)
    advance(sched)                                   # a and b run; c waits (2 seats)
    out = advance(sched)                             # a and b each need a block; one is free
    assert out.preempted == [b]
    assert list(sched.waiting)[:2] == [b, c]


def test_static_batch_admits_nobody_until_it_is_done():
    sched = make_scheduler(max_num_seqs=2, scheduling="static")
    short = make_seq("short", 4, max_tokens=1)
    long = make_seq("long", 4, max_tokens=4, first_token=2000)
    late = make_seq("late", 4, max_tokens=1, first_token=3000)
    for s in (short, long, late):
        sched.add(s)
    assert ids(advance(sched)) == [("short", 4), ("long", 4)]
    assert short.is_finished
    assert sched.slots == ["short", "long"]          # the finished member's slot stays held
    for _ in range(3):
        out = advance(sched)
        assert ids(out) == [("long", 1)]             # a free seat, but 'late' may not join
        assert late.status == SequenceStatus.WAITING
    assert long.is_finished
    assert sched.slots == [None, None]
    assert ids(advance(sched)) == [("late", 4)]


def test_continuous_batch_refills_at_once():
    sched = make_scheduler(max_num_seqs=2)
    short = make_seq("short", 4, max_tokens=1)
    long = make_seq("long", 4, max_tokens=4, first_token=2000)
    late = make_seq("late", 4, max_tokens=2, first_token=3000)
    for s in (short, long, late):
        sched.add(s)
    assert ids(advance(sched)) == [("short", 4), ("long", 4)]
    assert sched.slots == [None, "long"]              # the finished request's slot is free at once
    assert ids(advance(sched)) == [("long", 1), ("late", 4)]
    assert sched.slots == ["late", "long"]


def test_prefix_cache_hit_counts_cached_tokens_once():
    sched = make_scheduler(block_size=4)
    first = make_seq("first", 10, max_tokens=1)
    sched.add(first)
    run_all(sched)
    second = make_seq("second", 10, max_tokens=1)   # the same prompt
    sched.add(second)
    out = advance(sched)
    assert ids(out) == [("second", 2)]               # 8 tokens (2 blocks) from the cache
    assert second.num_cached_tokens == 8


def test_finish_while_waiting_and_find():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq("a", 4), make_seq("b", 4, first_token=50)
    sched.add(a)
    sched.add(b)
    advance(sched)
    assert sched.find("a") is a and sched.find("b") is b and sched.find("zzz") is None
    sched.finish(b)                                  # aborted while queued
    assert b.is_finished and b not in sched.waiting
    sched.finish(a)                                  # aborted while running
    assert not sched.has_work()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("budget", [1, 3, 16])
def test_every_prompt_token_is_computed_once(budget):
    sched = make_scheduler(max_num_batched_tokens=budget, enable_prefix_caching=False)
    seqs = [make_seq(i, 3 + 5 * i, max_tokens=2, first_token=100 * (i + 1)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    computed = {s.request_id: 0 for s in seqs}
    for out in run_all(sched):
        assert out.num_batched_tokens <= budget
        for s, n in out.scheduled:
            computed[s.request_id] += n
    # each prompt once, plus one decode per output token but the last (it is never fed back)
    assert computed == {s.request_id: s.num_prompt_tokens + 1 for s in seqs}


def test_chunks_deep_in_a_long_prompt_are_smaller_so_every_step_costs_about_the_same():
    """Each chunk's tokens count 1 + start/chunk_context_tokens: the first chunk is the whole
    budget, later ones shrink as the context grows, and the budget's cost is never exceeded."""
    sched = make_scheduler(num_blocks=600, block_size=16, max_num_batched_tokens=256, chunk_context_tokens=2048)
    seq = make_seq(0, 4000, max_tokens=1)
    sched.add(seq)
    starts, sizes = [], []
    while not seq.is_finished:
        start = seq.num_computed_tokens
        out = advance(sched)
        (s, n), = out.scheduled
        starts.append(start)
        sizes.append(n)
    assert sizes[0] == 256
    assert sum(sizes) == 4000
    for start, n in zip(starts[:-1], sizes[:-1]):         # every full chunk: cost within the budget
        assert n == int(256 / (1 + start / 2048))
        assert n * (1 + start / 2048) <= 256 + 1
    assert sizes[-2] < 95                                  # at ~3,900 tokens in: about a third of the budget
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_decodes_cost_one_token_whatever_their_context():
    sched = make_scheduler(num_blocks=600, block_size=16, max_num_batched_tokens=8, chunk_context_tokens=64)
    long = make_seq(0, 1000, max_tokens=20)
    sched.add(long)
    while long.num_output_tokens == 0:
        advance(sched)
    others = [make_seq(i, 1, max_tokens=20, first_token=5000 * i) for i in range(1, 4)]
    for s in others:
        sched.add(s)
    advance(sched)                                         # their one-token prompts join
    out = advance(sched)
    assert sorted(n for _, n in out.scheduled) == [1, 1, 1, 1]   # four decodes fit a budget of 8


def test_chunk_context_tokens_is_validated_by_name():
    with pytest.raises(Exception) as err:
        EngineConfig(model="tiny", chunk_context_tokens=-1)
    assert err.value.param == "chunk_context_tokens"
