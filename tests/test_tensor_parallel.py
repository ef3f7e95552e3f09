"""core/parallel/tensor_parallel.py: the model split by heads and MLP columns across real processes gives
one process's logits and greedy tokens. The reference is computed here, in the test's own
process, with the unsharded model; the logits' bound is derived against a float64 reference
(tests/bounds.py: SPLIT_SUM_ERROR_RATIO); the workers are checked gone afterwards."""

import pytest
import torch

from bounds import SPLIT_SUM_ERROR_RATIO, against_f64, llama_logits_f64
from conftest import alive
from core.config import ModelConfig
from core.errors import InvalidParameter
from core.model.model import Transformer
from core.parallel.tensor_parallel import (Kind, TPSettings, check_degree, head_range, mlp_range, shard_plan, tp_worker,
                                  valid_degrees)
from core.parallel.workers import WorkerGroup

SMOL = ModelConfig(name="smollm2-135m")          # the defaults are SmolLM2-135M's shape
PROMPT = "The capital of France is Paris, and the capital of Italy is"
SETTINGS = TPSettings(new_tokens=4, sweep_rows=(1, 64), sweep_repeats=3, return_logits=True)


def test_the_degrees_that_split_smollm2s_heads_into_whole_groups():
    assert valid_degrees(SMOL, 12) == [1, 3, 9]          # divide 3 KV heads, or multiples of 3 dividing 9
    tiny = ModelConfig(name="tiny", num_heads=4, num_kv_heads=2, intermediate_size=128)
    assert valid_degrees(tiny, 8) == [1, 2, 4]
    for n in (2, 4, 0):
        with pytest.raises(InvalidParameter) as err:
            check_degree(SMOL, n)
        assert err.value.param == "tp_degree"
    with pytest.raises(InvalidParameter, match="9 query heads in 3 groups"):
        check_degree(SMOL, 2)


@pytest.mark.parametrize("cfg,n", [(SMOL, 1), (SMOL, 3), (SMOL, 9),
                                   (ModelConfig(name="t", num_heads=4, num_kv_heads=2, intermediate_size=128), 4)])
def test_every_query_head_is_on_one_rank_with_the_kv_head_it_reads(cfg, n):
    group = cfg.num_heads // cfg.num_kv_heads
    heads, cols = [], []
    for rank in range(n):
        q, kv = head_range(cfg, n, rank)
        heads += list(q)
        cols += list(mlp_range(cfg, n, rank))
        assert {h // group for h in q} == set(kv)          # whole groups, or one copied KV head
    assert heads == list(range(cfg.num_heads))
    assert cols == list(range(cfg.intermediate_size))
    plan = shard_plan(cfg, n)
    C, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    full_layer = (cfg.num_heads + 2 * cfg.num_kv_heads) * D * C + C * cfg.num_heads * D + 3 * C * I
    copies = max(1, n // cfg.num_kv_heads)                 # each KV head's k and v rows, that many times
    extra = (copies - 1) * 2 * cfg.num_kv_heads * D * C
    assert sum(p["layer_params"] for p in plan) == full_layer + extra


def reference(model: Transformer, ids: list[int], new_tokens: int):
    """Logits (T, V) and greedy tokens of the unsharded model in this process."""
    with torch.inference_mode():
        logits = model.score(ids)
        seq = list(ids)
        for _ in range(new_tokens):
            seq.append(int(model.score(seq)[-1].argmax()))
    return logits, seq[len(ids):]


@pytest.fixture(scope="module")
def smol(smollm_loaded):
    model = Transformer.from_state_dict(smollm_loaded.config, smollm_loaded.state_dict)
    ids = smollm_loaded.tokenizer.encode(PROMPT)
    return model, ids, reference(model, ids, SETTINGS.new_tokens)


@pytest.mark.real_model
@pytest.mark.parametrize("degree", [1, 3])
def test_tensor_parallel_gives_one_process_logits_and_tokens(smol, degree):
    model, ids, (logits, tokens) = smol
    results = WorkerGroup(tp_worker, degree, ("smollm2-135m", ids, SETTINGS), timeout_s=240).run()
    first = results[0]
    got = torch.from_numpy(first["logits"])
    diff = float((got - logits).abs().max())
    err_tp, bound, err_one = against_f64(got, logits, llama_logits_f64(model, ids), SPLIT_SUM_ERROR_RATIO)
    assert err_tp <= bound, (err_tp, bound, err_one, diff)
    # the worker's own check agrees: its reference is the same model with the same kernels, which are
    # invariant to batch and threads (tests/test_gemm.py), so the same bits
    assert first["max_logit_diff"] == diff
    if degree == 1:
        assert diff == 0.0                                  # no split: the same products exactly
    assert first["tokens"] == tokens == first["reference_tokens"]
    assert all(r["tokens"] == tokens for r in results)     # every rank followed rank 0's choice
    C, T = model.config.hidden_size, len(ids)
    for r in results:
        layers = [s for s in r["timeline"] if 0 <= s[0] < model.config.num_layers]
        # per layer: attention and MLP compute, each followed by an all-reduce, in order on one clock
        assert [(s[1], s[2]) for s in layers[:4]] == [("attention", Kind.COMPUTE), ("attention", Kind.ALLREDUCE),
                                                      ("mlp", Kind.COMPUTE), ("mlp", Kind.ALLREDUCE)]
        assert len(layers) == 4 * model.config.num_layers
        assert all(a[4] <= b[3] for a, b in zip(r["timeline"], r["timeline"][1:]))
        assert r["allreduce_bytes_per_layer"] == 2 * T * C * 4
        assert [(s["rows"], s["bytes"]) for s in r["sweep"]] == [(1, C * 4), (64, 64 * C * 4)]
        assert all(s["ms"] >= s["min_ms"] > 0 for s in r["sweep"])
    assert not any(alive(r["pid"]) for r in results)


def test_tiny_model_split_with_kv_heads_copied(tiny_loaded):
    """tiny has 4 query heads and 2 KV heads: degree 4 gives each rank one query head, its KV
    head copied on two ranks (degree 2, a group each, runs in tests/widgets/test_tensor_parallel.py)."""
    degree = 4
    model = Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict)
    ids = tiny_loaded.tokenizer.encode(PROMPT)
    logits, tokens = reference(model, ids, 3)
    settings = TPSettings(new_tokens=3, sweep_rows=(1,), sweep_repeats=1, return_logits=True)
    results = WorkerGroup(tp_worker, degree, ("tiny", ids, settings), timeout_s=120).run()
    err_tp, bound, err_one = against_f64(torch.from_numpy(results[0]["logits"]), logits,
                                         llama_logits_f64(model, ids), SPLIT_SUM_ERROR_RATIO)
    assert err_tp <= bound, (err_tp, bound, err_one)
    assert results[0]["tokens"] == tokens
    assert not any(alive(r["pid"]) for r in results)


@pytest.mark.parametrize("torchrun", [False, True])
def test_the_check_command_runs_here_and_under_torchrun(torchrun):
    """`python -m core.parallel.tensor_parallel --check` (the README's command), with its own worker
    processes and as torchrun's ranks (env:// rendezvous: the path that spans machines)."""
    import os
    import subprocess
    import sys

    if torchrun:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
               "-m", "core.parallel.tensor_parallel", "--check", "--model", "tiny"]
    else:
        cmd = [sys.executable, "-m", "core.parallel.tensor_parallel", "--check", "--model", "tiny", "--degree", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and "2" in out.stdout
