"""core/parallel/pipeline.py: the layers in stages across real processes, microbatches sent stage to stage.
The output is bit-equal to the unsharded model run here; the timeline is read on one clock
across processes (a stage never starts a microbatch before the stage before has finished it);
the bubble formula is checked on an ideal schedule built here."""

import pytest
import torch

from bounds import U64, gamma
from conftest import alive
from core.errors import InvalidParameter
from core.model.model import Transformer
from core.parallel.pipeline import Kind, PPSettings, bubble_formula, bubble_measured, check_batch, pp_worker, stage_ranges
from core.parallel.workers import WorkerGroup


def test_stages_are_contiguous_near_equal_layer_ranges():
    for p in range(1, 9):
        ranges = stage_ranges(30, p)
        assert [i for r in ranges for i in r] == list(range(30))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    assert [len(r) for r in stage_ranges(30, 4)] == [7, 8, 7, 8]
    for bad in (0, 9):
        with pytest.raises(InvalidParameter) as err:
            stage_ranges(30, bad)
        assert err.value.param == "stages"


@pytest.mark.parametrize("p,m", [(2, 1), (2, 8), (3, 4), (4, 1), (4, 6)])
def test_the_measured_bubble_of_an_ideal_schedule_is_the_formula(p, m):
    """Unit-cost stages, free sends: stage s runs microbatch i during [s + i, s + i + 1]."""
    spans = [(s, i, Kind.COMPUTE.value, float(s + i), float(s + i + 1)) for s in range(p) for i in range(m)]
    spans += [(s, i, Kind.WAIT.value, float(s + i - 1), float(s + i)) for s in range(1, p) for i in range(m)]
    idle = p * (m + p - 1) - p * m                       # stage-slots in a span of m + p - 1, less the busy ones
    # small integers: the spans' sums and the span are exact, then 1 - busy / total rounds twice
    # (busy / total <= 1: within u, then u of the result <= 1) where idle / total rounds once
    assert bubble_measured(spans, p) == pytest.approx(idle / (p * (m + p - 1)), rel=0, abs=3 * U64)
    # (p - 1) / (m + p - 1) and p (p - 1) / (p (m + p - 1)): one correctly rounded divide of the same rational
    assert bubble_formula(p, m) == idle / (p * (m + p - 1))


@pytest.fixture(scope="module")
def smol(smollm_loaded):
    model = Transformer.from_state_dict(smollm_loaded.config, smollm_loaded.state_dict)
    batch = check_batch(smollm_loaded.tokenizer, 4, 12)
    with torch.inference_mode():
        single = [model.forward(torch.tensor(ids), torch.arange(len(ids))) for ids in batch]
    return batch, single


@pytest.mark.real_model
@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_output_is_bit_equal_to_one_process(smol, stages):
    batch, single = smol
    assert len({tuple(ids) for ids in batch}) == len(batch)          # different sequences
    settings = PPSettings(schedules=(1, 4))
    results = WorkerGroup(pp_worker, stages, ("smollm2-135m", batch, settings), timeout_s=240).run()
    last = results[-1]
    assert len(last["outputs"]) == 4
    for out, ref in zip(last["outputs"], single):
        assert torch.equal(torch.from_numpy(out), ref)
    assert last["bit_equal"] and last["max_abs_diff"] == 0.0
    assert [tuple(r["layers"]) for r in results] == [(r.start, r.stop) for r in stage_ranges(30, stages)]
    for run_index, m in enumerate(settings.schedules):
        spans = [s for r in results for s in r["runs"][run_index]["spans"]]
        compute = {(s[0], s[1]): s for s in spans if s[2] == Kind.COMPUTE.value}
        assert set(compute) == {(st, i) for st in range(stages) for i in range(m)}
        for (st, i), span in compute.items():
            if st > 0:       # one clock for every process: stage s starts mb i after stage s-1 ended it
                assert span[3] >= compute[(st - 1, i)][4]
            if i > 0:        # and a stage does its microbatches in order
                assert span[3] >= compute[(st, i - 1)][4]
        measured = bubble_measured(spans, stages)
        assert 0.0 < measured < 1.0
        if m == 1:           # one microbatch: the stages run one after another, never overlapping
            # exactly, busy <= stages x span (no overlap), so measured >= (p - 1) / p; in float64 the
            # p durations, their p - 1 adds, the span, its product, the divide and 1 - x are 2p + 3
            # roundings of numbers relative to busy / total <= 1, and the formula one more
            assert measured >= bubble_formula(stages, 1) - 2 * gamma(2 * stages + 4, U64)
    assert not any(alive(r["pid"]) for r in results)


@pytest.mark.parametrize("torchrun", [False, True])
def test_the_check_command_runs_here_and_under_torchrun(torchrun):
    """`python -m core.parallel.pipeline --check` (the README's command), with its own stage processes and
    as torchrun's ranks (env:// rendezvous: the path that spans machines, no shared clock)."""
    import os
    import subprocess
    import sys

    if torchrun:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
               "-m", "core.parallel.pipeline", "--check", "--model", "tiny", "--microbatches", "3", "--tokens", "8"]
    else:
        cmd = [sys.executable, "-m", "core.parallel.pipeline", "--check", "--model", "tiny", "--stages", "2",
               "--microbatches", "3", "--tokens", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bit-equal to one process" in out.stdout and "PASS" in out.stdout
    assert ("no bubble measured" in out.stdout) == torchrun
