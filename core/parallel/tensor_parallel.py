"""Tensor parallelism: each layer's matrices split across worker processes (Megatron-LM,
Shoeybi et al., 2019), with an all-reduce after each row-parallel product.

In a block, the first product of each half is column-parallel (rank r keeps some output rows of
the weight) and the second is row-parallel (rank r keeps the matching input columns):

- attention: qkv_proj is fused [q heads | k heads | v heads]; rank r keeps its query heads and the
  KV heads they read, attends over them alone, and multiplies by its columns of o_proj. Its (T, C)
  result is a partial sum; an all-reduce adds the ranks' parts.
- MLP: gate_up_proj is fused [gate | up]; rank r keeps its columns of both, applies SwiGLU to its
  slice of the 1,536-wide middle, and multiplies by its columns of down_proj: another partial
  sum, another all-reduce. Two all-reduces a block, each of T x C floats.
- the embedding, the norms and the tied LM head are replicated: every rank holds them.

Which degrees: a rank must hold whole grouped-query groups (a query head and the KV head it reads
must be on the same rank). SmolLM2 has 9 query heads in 3 groups of 3, so a degree that divides
the 3 KV heads (1 or 3) gives each rank whole groups. A degree that is a multiple of the KV heads
and divides the query heads (9 here) also works: each KV head is then copied on degree / 3 ranks,
as Megatron-LM and vLLM do when the degree exceeds the KV heads. Any other degree (2, 4 ...) is
refused with InvalidParameter("tp_degree"): 9 heads in 3 groups do not split into equal whole
groups. The MLP's middle is split into near-equal slices, which need not be equal.

Each rank runs the model's own Attention and MLP modules, built with its share of the heads and
columns (core/model/model.py), so the arithmetic is the one-process model's; only the sums' order
differs, so the logits agree with one process to rounding, not bit for bit (the check below bounds
how far, against a float64 run).
"""

import dataclasses
import math
import time
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from core.config import ModelConfig
from core.errors import InvalidParameter
from core.model.model import MLP, Attention, Transformer


class Kind(str, Enum):
    """What a span of a rank's timeline was spent on."""
    COMPUTE = "compute"        # arithmetic on this rank's share
    ALLREDUCE = "allreduce"    # inside dist.all_reduce: the exchange, and waiting for the slowest rank


@dataclass
class TPSettings:
    new_tokens: int = 4                                  # greedy tokens after the prompt (a full recompute each)
    sweep_rows: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)  # batch rows of the all-reduce timing
    sweep_repeats: int = 5                               # all-reduces timed per row count (the median is kept)
    return_logits: bool = False                          # rank 0 returns the prompt's (T, V) logits (tests)
    check: bool = True                                   # rank 0 also runs the model in one piece to compare
    float64: bool = False                                # ... and in float64 too, for --check's bound


def valid_degrees(cfg: ModelConfig, up_to: int) -> list[int]:
    return [n for n in range(1, up_to + 1) if split_error(cfg, n) is None]


def split_error(cfg: ModelConfig, n: int) -> str | None:
    """Why degree n cannot split this model's heads into whole groups, or None if it can."""
    H, Hkv = cfg.num_heads, cfg.num_kv_heads
    if n < 1:
        return f"must be at least 1, got {n}"
    if Hkv % n == 0 or (n % Hkv == 0 and H % n == 0):
        return None
    return (f"{n} does not split {H} query heads in {Hkv} groups into equal whole groups: a degree must divide "
            f"the {Hkv} KV heads, or be a multiple of them that divides the {H} query heads (each KV head then "
            f"copied on several ranks)")


def check_degree(cfg: ModelConfig, n: int) -> None:
    problem = split_error(cfg, n)
    if problem is not None:
        raise InvalidParameter("tp_degree", problem)


def head_range(cfg: ModelConfig, n: int, rank: int) -> tuple[range, range]:
    """Rank's query heads and the KV heads they read (one shared KV head when n > KV heads)."""
    per = cfg.num_heads // n
    group = cfg.num_heads // cfg.num_kv_heads
    q = range(rank * per, (rank + 1) * per)
    return q, range(q.start // group, (q.stop - 1) // group + 1)


def mlp_range(cfg: ModelConfig, n: int, rank: int) -> range:
    """Rank's columns of the MLP's middle: near-equal contiguous slices."""
    I = cfg.intermediate_size
    return range(rank * I // n, (rank + 1) * I // n)


def shard_plan(cfg: ModelConfig, n: int) -> list[dict]:
    """Who holds what, for drawing: per rank its heads, MLP columns and weight counts."""
    plan = []
    for rank in range(n):
        q, kv = head_range(cfg, n, rank)
        cols = mlp_range(cfg, n, rank)
        D, C = cfg.head_dim, cfg.hidden_size
        per_layer = (len(q) + 2 * len(kv)) * D * C + C * len(q) * D + 3 * C * len(cols)
        replicated = cfg.vocab_size * C + (2 * cfg.num_layers + 1) * C
        plan.append({"rank": rank, "q_heads": [q.start, q.stop], "kv_heads": [kv.start, kv.stop],
                     "mlp_cols": [cols.start, cols.stop], "layer_params": per_layer,
                     "params": per_layer * cfg.num_layers + replicated, "replicated_params": replicated})
    return plan


class ShardedBlocks:
    """Rank r's share of every block: the model's own Attention and MLP with fewer heads/columns."""

    def __init__(self, model: Transformer, n: int, rank: int):
        cfg = model.config
        q, kv = head_range(cfg, n, rank)
        cols = mlp_range(cfg, n, rank)
        H, Hkv, D, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        local = dataclasses.replace(cfg, num_heads=len(q), num_kv_heads=len(kv), intermediate_size=len(cols))
        qkv_rows = torch.cat([torch.arange(q.start * D, q.stop * D),                       # its q heads
                              torch.arange((H + kv.start) * D, (H + kv.stop) * D),         # its k heads
                              torch.arange((H + Hkv + kv.start) * D, (H + Hkv + kv.stop) * D)])  # its v heads
        mlp_rows = torch.cat([torch.arange(cols.start, cols.stop), torch.arange(I + cols.start, I + cols.stop)])
        self.attn, self.mlp = [], []
        for i, block in enumerate(model.layers):
            attn, mlp = Attention(local, i), MLP(local)
            attn.qkv_proj.weight.data = block.attn.qkv_proj.weight[qkv_rows].contiguous()        # column-parallel
            attn.o_proj.weight.data = block.attn.o_proj.weight[:, q.start * D:q.stop * D].contiguous()  # row-parallel
            mlp.gate_up_proj.weight.data = block.mlp.gate_up_proj.weight[mlp_rows].contiguous()  # column-parallel
            mlp.down_proj.weight.data = block.mlp.down_proj.weight[:, cols.start:cols.stop].contiguous()  # row-parallel
            if block.attn.qkv_proj.kernel is not None:   # the model multiplies packed weights: so do the shards
                for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                    linear.pack(model.weight_format)
            self.attn.append(attn.requires_grad_(False))
            self.mlp.append(mlp.requires_grad_(False))
        self.norms = [(b.attn_norm, b.mlp_norm) for b in model.layers]   # replicated
        self.embed, self.norm, self.rotary, self.model = model.embed_tokens, model.norm, model.rotary, model

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, timeline: list | None = None) -> torch.Tensor:
        """ids (T,) -> final hidden states (T, C), the same on every rank. With `timeline`, each
        span is appended as (layer, part, Kind, start, end) on the system-wide monotonic clock."""
        def span(layer, part, kind, t0):
            t1 = time.monotonic()
            if timeline is not None:
                timeline.append((layer, part, kind.value, t0, t1))
            return t1

        positions = torch.arange(ids.shape[0])
        t = time.monotonic()
        x = self.embed(ids)                                           # (T, C)
        t = span(-1, "embed", Kind.COMPUTE, t)
        for i, (attn_norm, mlp_norm) in enumerate(self.norms):
            part = self.attn[i](attn_norm(x), positions, self.rotary, None)   # (T, C), a partial sum
            t = span(i, "attention", Kind.COMPUTE, t)
            dist.all_reduce(part)
            t = span(i, "attention", Kind.ALLREDUCE, t)
            x = x + part
            part = self.mlp[i](mlp_norm(x))                           # (T, C), a partial sum
            t = span(i, "mlp", Kind.COMPUTE, t)
            dist.all_reduce(part)
            t = span(i, "mlp", Kind.ALLREDUCE, t)
            x = x + part
        x = self.norm(x)
        span(len(self.norms), "norm", Kind.COMPUTE, t)
        return x


def greedy(forward, logits, ids: list[int], new_tokens: int, broadcast: bool) -> list[int]:
    """new_tokens greedy tokens, each from a full recompute of the sequence so far."""
    ids = list(ids)
    for _ in range(new_tokens):
        token = torch.tensor([int(logits(forward(torch.tensor(ids))[-1:]).argmax())])
        if broadcast:
            dist.broadcast(token, src=0)          # the ranks agree on rank 0's choice
        ids.append(int(token))
    return ids[len(ids) - new_tokens:]


def measure_allreduce(rows: tuple[int, ...], width: int, repeats: int) -> list[dict]:
    """The time of one all-reduce of (rows, width) fp32 against rows: the volume grows with the
    batch (rows x width x 4 bytes, twice a layer). Every rank must call it together."""
    out = []
    for r in rows:
        x = torch.ones(r, width)
        dist.all_reduce(x)                                            # a first call sets up buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.monotonic()
            dist.all_reduce(x)
            times.append(time.monotonic() - t0)
        times.sort()
        out.append({"rows": r, "bytes": r * width * 4, "ms": times[len(times) // 2] * 1e3, "min_ms": times[0] * 1e3})
    return out


def tp_worker(rank: int, world_size: int, model_name: str, ids: list[int], settings: TPSettings) -> dict:
    """One rank: load, shard, run the prompt (timed span by span) and a few greedy tokens, time
    the all-reduce sweep. Rank 0 also returns the check against the whole model in one process.
    Arrays come back as numpy: torch pickles a tensor between processes as a handle to shared
    memory that its sender serves, and a worker may have exited before the parent reads it."""
    import os

    from core.registry import load

    t0 = time.monotonic()
    loaded = load(model_name)
    check_degree(loaded.config, world_size)
    model = Transformer.from_state_dict(loaded.config, loaded.state_dict)
    out = {"rank": rank, "pid": os.getpid(), "threads": torch.get_num_threads()}
    reference = None
    if rank == 0 and settings.check:                 # the whole model in one process, before sharding
        exact = float64_logits(loaded.config, loaded.state_dict, ids) if settings.float64 else None
        with torch.inference_mode():
            reference = model.score(ids)             # (T, V)
            out["reference_tokens"] = greedy(lambda x: model.forward(x, torch.arange(len(x))), model.logits,
                                             ids, settings.new_tokens, broadcast=False)
    shards = ShardedBlocks(model, world_size, rank)
    model.layers = None                              # this rank keeps only its share of the blocks
    del loaded
    out["load_s"] = time.monotonic() - t0
    shards.forward(torch.tensor(ids[:4]))            # warm-up: first calls pay setup
    dist.barrier()
    timeline = []
    hidden = shards.forward(torch.tensor(ids), timeline)
    with torch.inference_mode():
        logits = model.logits(hidden)                # (T, V), replicated LM head
        out["tokens"] = greedy(shards.forward, model.logits, ids, settings.new_tokens, broadcast=True)
    out["timeline"] = timeline
    out["allreduce_bytes_per_layer"] = 2 * len(ids) * model.config.hidden_size * 4
    out["sweep"] = measure_allreduce(settings.sweep_rows, model.config.hidden_size, settings.sweep_repeats)
    if reference is not None:
        out["max_logit_diff"] = float((logits - reference).abs().max())
        if exact is not None:
            out["tp_error"], out["one_process_error"] = (float((x.double() - exact).abs().max()) for x in (logits, reference))
            out["bound"] = check_bound(out["one_process_error"], exact)
        out["top_ids"] = logits[-1].topk(10).indices.tolist()
        out["top_logits"] = logits[-1].topk(10).values.tolist()
    if rank == 0 and settings.return_logits:
        out["logits"] = logits.numpy()               # by value: a tensor would go through shared memory
    return out


# ---- python -m core.parallel.tensor_parallel --check: here, or across machines under torchrun ---------

# The check's bound, derived (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3):
# tensor parallelism changes only the row-parallel products' sums (o_proj, down_proj), each output's
# chain of n roundings becoming d chains of n/d and d - 1 additions in the all-reduce, n/d + d - 1 <= n:
# the same a-priori bound, gamma_n * sum |a b|, whatever the order. Every other operation is the one
# process's arithmetic on the same inputs. So both runs' logits are measured against a float64 run of
# the same weights: tensor parallel's error may be at most ERROR_RATIO times the one process's (another
# draw of the same rounding process, whose max over T x V logits can land higher), plus FLOOR_ULPS
# units in the last place of fp32 at the logits' scale (for a one-process error that happens to be
# ~0). Both errors are measured here, with this CPU's kernels, so the bound holds on any CPU; the
# tests derive theirs the same way (tests/bounds.py: against_f64). And the same greedy tokens.
ERROR_RATIO = 2.0
FLOOR_ULPS = 4.0
CHECK_PROMPT = "The capital of France is Paris, and the capital of Italy is"


def float64_logits(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The model's logits (T, V) on one sequence with every operation in float64 (unit roundoff
    2^-53: within ~1e-12 relative of exact at this depth): the same fp32 weights and RoPE tables,
    the model's own modules, unpacked, run in float64."""
    model = Transformer.from_state_dict(cfg, {k: v.double() for k, v in state_dict.items()}, packed=False)
    return model.score(ids)


def check_bound(one_process_error: float, exact: torch.Tensor) -> float:
    """The largest error against float64 tensor parallel's logits may have: ERROR_RATIO times the
    one process's, plus FLOOR_ULPS fp32 ulps at the scale of the logits (2^(floor(log2 max|x|) - 23))."""
    scale = float(exact.abs().max())
    ulp = 2.0 ** (math.floor(math.log2(scale)) - 23) if scale > 0 else 0.0
    return ERROR_RATIO * one_process_error + FLOOR_ULPS * ulp


def summary(out: dict, degree: int) -> tuple[bool, str]:
    """Rank 0's result in words, and whether it passed the check."""
    spans = [s for s in out["timeline"] if 0 <= s[0]]
    layers = len({s[0] for s in spans})
    busy = sum(s[4] - s[3] for s in spans if s[2] == Kind.COMPUTE.value) / layers * 1e3
    talk = sum(s[4] - s[3] for s in spans if s[2] == Kind.ALLREDUCE.value) / layers * 1e3
    ok = out["tp_error"] <= out["bound"] and out["tokens"] == out["reference_tokens"]
    return ok, (f"tensor parallel, degree {degree}: max |logit - one process| = {out['max_logit_diff']:.2e}; "
                f"max |logit - float64| = {out['tp_error']:.2e}, bound {out['bound']:.2e} "
                f"({ERROR_RATIO:g} x one process's {out['one_process_error']:.2e} + {FLOOR_ULPS:g} ulps); "
                f"greedy tokens {out['tokens']} "
                f"{'==' if out['tokens'] == out['reference_tokens'] else '!='} one process's "
                f"{out['reference_tokens']}; per layer on rank 0: compute {busy:.2f} ms, all-reduce {talk:.2f} ms "
                f"({out['allreduce_bytes_per_layer']:,} bytes) -> {'PASS' if ok else 'FAIL'}")


def main(argv=None) -> int:
    import argparse

    from core.parallel.workers import WorkerGroup, launched_by_torchrun, run_torchrun_rank
    from core.registry import load

    parser = argparse.ArgumentParser(prog="python -m core.parallel.tensor_parallel",
                                     description="Run the model tensor-parallel and compare with one process.")
    parser.add_argument("--check", action="store_true", help="run the check (the only action)")
    parser.add_argument("--degree", type=int, default=3, help="processes here when not under torchrun")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", default=CHECK_PROMPT)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if not args.check:
        parser.error("nothing to do: pass --check")
    ids = load(args.model).tokenizer.encode(args.prompt)
    settings = TPSettings(float64=True)
    if launched_by_torchrun():
        rank, degree, out = run_torchrun_rank(tp_worker, (args.model, ids, settings), args.timeout)
        if rank != 0:
            return 0
    else:
        degree = args.degree
        out = WorkerGroup(tp_worker, degree, (args.model, ids, settings), timeout_s=args.timeout).run()[0]
    ok, text = summary(out, degree)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
