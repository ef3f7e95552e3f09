"""core/parallel/expert_parallel.py: the experts of a layer across worker processes, tokens sent by
all-to-all, the output equal to the layer in one process; no worker left behind."""

import statistics

import pytest
import torch

from core.config import ModelConfig, WeightFormat
from core.errors import InvalidParameter
from core.model.moe import MoEMLP, route
from core.parallel.expert_parallel import PHASES, rank_main, run, summarize, worker_group

from test_workers import alive


def random_layer(experts: int = 16, k: int = 2, hidden: int = 64, width: int = 128, seed: int = 0) -> MoEMLP:
    cfg = ModelConfig(name="t", hidden_size=hidden, intermediate_size=width, num_experts=experts,
                      num_experts_per_token=k)
    mlp = MoEMLP(cfg)
    g = torch.Generator().manual_seed(seed)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
    return mlp.requires_grad_(False)


@pytest.mark.parametrize("world_size,top_k,tokens,fmt", [(2, 2, 37, None), (4, 4, 50, None), (2, 2, 37, "fp32"),
                                                        (4, 4, 50, "q4_1")])
def test_expert_parallel_equals_one_process(world_size, top_k, tokens, fmt):
    """Unpacked experts, or packed as a served model's are (fp32 on the engine's kernel, q4_1): the
    workers pack theirs alike, so the output is the layer's in one process, bit for bit."""
    mlp = random_layer(width=128 if fmt != "q4_1" else 512)    # q4_1: experts of 32 units at least
    if fmt is not None:
        mlp.experts.pack(WeightFormat(fmt))
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1))
    group = worker_group(x, mlp, top_k, world_size, repeats=2, timeout_s=90)
    r = summarize(group.run())
    assert group.procs == [] and not any(alive(p) for p in r["pids"])
    expected = mlp(x, top_k=top_k)
    assert torch.equal(torch.as_tensor(r["output"]), expected)
    # the dispatch is the routing: rank i sent rank j as many rows as i's tokens chose j's experts
    chosen = route(mlp.router(x), top_k)
    per = 16 // world_size
    for i, shard in enumerate(torch.arange(tokens).tensor_split(world_size)):
        owners = torch.bincount((chosen[shard] // per).reshape(-1), minlength=world_size).tolist()
        assert r["sent"][i] == owners
        assert r["experts"][i] == [i * per, (i + 1) * per]
    assert sum(map(sum, r["sent"])) == tokens * top_k and sum(r["tokens"]) == tokens
    # every phase timed on every run; the exchange is the dispatch and the return of the slowest rank
    assert r["runs"] == 2 and set(r["phase_ms"]) == set(PHASES)
    assert all(v >= 0 for v in r["phase_ms"].values())
    assert r["alltoall_ms"] == statistics.median(r["alltoall_runs_ms"])     # the same median of the same list: exact
    assert r["total_ms"] >= r["alltoall_ms"] > 0


def test_a_rank_can_receive_nothing():
    """Two tokens, both routed to rank 0's experts: rank 1 receives no rows and still takes part."""
    mlp = random_layer()
    mlp.router.weight.data[:] = 0
    mlp.router.weight.data[0, 0] = mlp.router.weight.data[1, 0] = 1.0
    x = torch.zeros(2, 64)
    x[:, 0] = 1.0
    r = run(x, mlp, 2, 2, repeats=1, timeout_s=90)
    assert r["sent"] == [[2, 0], [2, 0]]
    assert torch.equal(r["output"], mlp(x))


def test_bad_splits_are_refused_by_name():
    mlp = random_layer()
    with pytest.raises(InvalidParameter) as err:
        worker_group(torch.zeros(4, 64), mlp, 2, 3)
    assert err.value.param == "workers"
    with pytest.raises(InvalidParameter) as err:
        worker_group(torch.zeros(4, 64), mlp, 17, 2)
    assert err.value.param == "top_k"


def test_one_rank_is_the_layer_itself(tmp_path):
    """world_size 1 without processes: rank_main's arithmetic alone (the all-to-alls are the identity)."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mlp = random_layer(k=3)
        x = torch.randn(9, 64)
        out = rank_main(0, 1, x, *(t for t in (mlp.router.weight, mlp.experts.gate_up, mlp.experts.down)), 3, 1)
    finally:
        dist.destroy_process_group()
    assert torch.equal(torch.from_numpy(out["output"]), mlp(x, top_k=3))
    assert out["sent"] == out["received"] == [27]
