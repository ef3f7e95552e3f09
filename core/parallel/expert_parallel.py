"""Expert parallelism (GShard: Lepikhin et al., 2020; Switch Transformers: Fedus et al., 2021): the
experts of one MoE layer split across worker processes, and every token sent to the process that
holds its expert and back, with torch.distributed's all-to-all.

W ranks (core/parallel/workers.py), each holding E/W experts (rank r: experts r*E/W to (r+1)*E/W - 1) and
1/W of the tokens, as data parallelism would hand them out. One layer, on every rank:
1. route: the router (a copy on every rank) picks each of its tokens' top-k experts;
2. dispatch: the (token, expert) pairs, sorted by the rank that holds the expert, go there: first
   how many to each rank (an all-to-all of W numbers), then the rows and their expert ids
   (`all_to_all_single` with those uneven splits);
3. compute: the grouped product of core/model/moe.py over the rows received, with its own experts;
4. return and combine: the results travel back by the reverse all-to-all, and each token sums its
   k results in expert order, exactly as the layer does in one process (so the output is equal).
gloo, torch's CPU backend, implements `all_to_all_single` with uneven splits, which is what this
uses; its list form `all_to_all` only takes pieces of equal size.

Each phase is timed on every rank after a barrier: one warm-up run, then `repeats` timed runs.
A phase of the layer lasts as long as its slowest rank, so the summary takes the maximum over
ranks of each run, then the median over runs.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from core.config import WeightFormat
from core.errors import InvalidParameter
from core.model.linear import linear
from core.model.moe import Experts, MoEMLP, check_top_k, combine, grouped, route
from core.parallel.workers import ProcessBudget, WorkerGroup

PHASES = ("route", "dispatch", "compute", "return", "combine")   # in the order they run


def check_world_size(num_experts: int, world_size: int) -> None:
    if world_size < 1 or num_experts % world_size:
        raise InvalidParameter("workers", f"must divide the {num_experts} experts evenly, got {world_size}")


def layer_tensors(mlp: MoEMLP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MoE layer's weights to send to the workers: router (E, C), gate_up (E, 2F, C), down (E, C, F)."""
    return mlp.router.weight.detach(), mlp.experts.gate_up.detach(), mlp.experts.down.detach()


def rank_main(rank: int, world_size: int, x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, top_k: int, repeats: int, weight_format: str | None = None) -> dict:
    """The target of every worker: x (T, C) is the whole batch (the rank takes its share),
    router/gate_up/down the whole layer (the rank keeps its experts), weight_format the experts'
    packing in the process that asked (None: unpacked), so that both multiply alike."""
    E, C = router.shape
    per = E // world_size
    first = rank * per                                                    # its experts: first .. first+per-1
    local = Experts(per, C, down.shape[2])
    local.load_state_dict({"gate_up": gate_up[first:first + per], "down": down[first:first + per]}, assign=True)
    if weight_format is not None:
        local.pack(WeightFormat(weight_format))
    shard = x.tensor_split(world_size)[rank]                              # (Tr, C) its tokens
    T = shard.shape[0]
    times = {p: [] for p in PHASES}
    with torch.inference_mode():
        for run in range(repeats + 1):                                    # run 0 warms up, untimed
            dist.barrier()
            t0 = time.perf_counter()
            chosen = route(linear(shard, router), top_k)                  # (Tr, k)
            tokens = torch.arange(T).repeat_interleave(top_k)            # (Tr k,) each pair's token
            ids = chosen.reshape(-1)                                      # (Tr k,) each pair's expert
            order = torch.argsort(ids // per, stable=True)                # pairs by destination rank
            send = torch.bincount(ids // per, minlength=world_size)       # (W,) pairs to each rank
            t1 = time.perf_counter()
            recv = torch.empty(world_size, dtype=torch.long)
            dist.all_to_all_single(recv, send)                            # how many come from each rank
            n_in, splits_in, splits_out = int(recv.sum()), recv.tolist(), send.tolist()
            rows_in = torch.empty(n_in, C)
            dist.all_to_all_single(rows_in, shard[tokens[order]], splits_in, splits_out)
            ids_in = torch.empty(n_in, dtype=torch.long)
            dist.all_to_all_single(ids_in, ids[order], splits_in, splits_out)
            t2 = time.perf_counter()
            y_in = grouped(local, rows_in, torch.arange(n_in), ids_in - first)   # (n_in, C)
            t3 = time.perf_counter()
            y_back = torch.empty(T * top_k, C)
            dist.all_to_all_single(y_back, y_in, splits_out, splits_in)   # the results, back home
            t4 = time.perf_counter()
            y = torch.empty_like(y_back)
            y[order] = y_back                                             # pairs in token order again
            out = combine(y.view(T, top_k, C))                            # (Tr, C)
            t5 = time.perf_counter()
            if run:
                for p, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                    times[p].append((b - a) * 1000)
    # a numpy array, pickled by value: a tensor would travel as a shared-memory handle that its
    # sender must still be alive to hand over, and this process exits as soon as it has answered
    return {"rank": rank, "pid": os.getpid(), "experts": [first, first + per], "tokens": T, "output": out.numpy(),
            "sent": send.tolist(), "received": recv.tolist(), "times_ms": times}


def worker_group(x: torch.Tensor, mlp: MoEMLP, top_k: int, world_size: int, repeats: int = 5,
                 timeout_s: float = 120.0, budget: ProcessBudget | None = None) -> WorkerGroup:
    """The workers for one layer over the batch x (T, C), not started (a job starts it in slices)."""
    check_world_size(mlp.experts.num_experts, world_size)
    check_top_k(top_k, mlp.experts.num_experts)
    # copies: pickling a tensor for a spawned process moves its storage into shared memory, and the
    # model's own weights should stay where they are; the copies are freed with the group
    tensors = tuple(t.clone() for t in (x.detach(), *layer_tensors(mlp)))
    kernels = mlp.experts.kernels
    fmt = kernels[0][0].format.value if kernels else None      # the same products as this process's
    return WorkerGroup(rank_main, world_size, (*tensors, top_k, repeats, fmt), timeout_s=timeout_s, budget=budget)


def summarize(results: list[dict]) -> dict:
    """The ranks' results -> the layer's output (T, C), the rows each rank sent to each other
    (W x W), and each phase's time: per run the slowest rank, then the median over runs."""
    runs = len(results[0]["times_ms"]["route"])
    slowest = {p: [max(r["times_ms"][p][i] for r in results) for i in range(runs)] for p in PHASES}
    exchange = [max(r["times_ms"]["dispatch"][i] + r["times_ms"]["return"][i] for r in results) for i in range(runs)]
    total = [max(sum(r["times_ms"][p][i] for p in PHASES) for r in results) for i in range(runs)]
    return {"output": torch.cat([torch.from_numpy(r["output"]) for r in results]),
            "sent": [r["sent"] for r in results], "experts": [r["experts"] for r in results],
            "tokens": [r["tokens"] for r in results], "pids": [r["pid"] for r in results], "runs": runs,
            "phase_ms": {p: statistics.median(v) for p, v in slowest.items()},
            "alltoall_ms": statistics.median(exchange), "alltoall_runs_ms": exchange,
            "total_ms": statistics.median(total)}


def run(x: torch.Tensor, mlp: MoEMLP, top_k: int, world_size: int, repeats: int = 5,
        timeout_s: float = 120.0) -> dict:
    """The whole thing at once (scripts and tests): start, wait, close, summarize."""
    return summarize(worker_group(x, mlp, top_k, world_size, repeats, timeout_s).run())
