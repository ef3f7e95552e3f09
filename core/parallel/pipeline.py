"""Pipeline parallelism: the layers split into stages in separate processes, microbatches passed
from stage to stage (GPipe, Huang et al., 2019), forward only, as in inference.

Stage s of p holds a contiguous range of the 30 blocks (near-equal: 30 into 4 is 7, 8, 7, 8);
stage 0 also holds the embedding, the last stage the final norm and the LM head (tied to the
embedding, so both ends hold that table). The batch is cut into m microbatches of the same shape
(T tokens each), so a receiving stage knows the shape without being told. Each stage loops over
the microbatches: receive the (T, C) activations from the stage before (dist.recv; stage 0 embeds
instead), run its blocks, send the result on (dist.isend, so the stage starts on the next
microbatch while the send completes). The schedule fills (warm-up: stage s starts after s
microbatch-steps), runs in a steady state with every stage busy, and drains.

Every stage records each microbatch's (start, end) of computing and of waiting to receive on
time.monotonic(), CLOCK_MONOTONIC on Linux: one clock for every process on the machine, so the
parent lines the stages up without any clock exchange. The bubble measured is the idle share of
the stages' time between the first start and the last end:
    1 - sum(busy time of every stage) / (p x (last end - first start)),
against GPipe's (p - 1) / (m + p - 1), which assumes p stages of equal cost and free sends.

The output is bit-equal to one process: each stage runs the model's own blocks on the same
(T, C) tensors a single process would, in the same order, and a send copies the floats exactly
(tests/test_pipeline.py checks it with torch.equal).
"""

import os
import time
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from core.errors import InvalidParameter
from core.model.model import Transformer

MAX_STAGES = 8


class Kind(str, Enum):
    """What a span of a stage's timeline was spent on."""
    COMPUTE = "compute"        # its blocks over one microbatch (stage 0: embedding too; last: norm and logits)
    WAIT = "wait"              # inside dist.recv: waiting for the stage before


@dataclass
class PPSettings:
    schedules: tuple[int, ...] = (1, 2, 4, 8)   # microbatch counts m run one after another (one timeline each)
    check: bool = True                          # the last stage compares its output with one process's


def stage_ranges(num_layers: int, stages: int) -> list[range]:
    """Contiguous, near-equal layer ranges, one per stage."""
    if not 1 <= stages <= min(num_layers, MAX_STAGES):
        raise InvalidParameter("stages", f"must be 1 to {min(num_layers, MAX_STAGES)}, got {stages}")
    return [range(s * num_layers // stages, (s + 1) * num_layers // stages) for s in range(stages)]


def bubble_formula(stages: int, microbatches: int) -> float:
    """GPipe's idle share: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def bubble_measured(spans: list[list], stages: int) -> float:
    """Idle share of p stages between the first start and the last end of computing.
    spans: (stage, microbatch, kind, start, end) rows of one schedule."""
    busy = [s for s in spans if s[2] == Kind.COMPUTE.value]
    start, end = min(s[3] for s in busy), max(s[4] for s in busy)
    return 1.0 - sum(s[4] - s[3] for s in busy) / (stages * (end - start))


class Stage:
    """Stage `rank` of `stages`: its blocks, and the ends of the model it holds."""

    def __init__(self, model: Transformer, rank: int, stages: int):
        self.rank, self.stages = rank, stages
        self.layers = stage_ranges(model.config.num_layers, stages)[rank]
        self.first, self.last = rank == 0, rank == stages - 1
        self.blocks = [model.layers[i] for i in self.layers]
        self.model = model
        self.hidden = model.config.hidden_size

    @torch.inference_mode()
    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """Stage 0: ids (T,) -> (T, C). Others: (T, C) -> (T, C); the last normalizes."""
        positions = torch.arange(x.shape[0])
        if self.first:
            x = self.model.embed_tokens(x)                          # (T, C)
        for block in self.blocks:
            x = block(x, positions, self.model.rotary)
        return self.model.norm(x) if self.last else x

    def run(self, batch: list[list[int]], spans: list) -> list[torch.Tensor]:
        """One schedule over the microbatches in `batch`; spans get (stage, mb, kind, start, end).
        Returns the last stage's outputs (final hidden states (T, C) per microbatch)."""
        T = len(batch[0])
        outputs, sends = [], []
        for mb, ids in enumerate(batch):
            if self.first:
                x = torch.tensor(ids)
            else:
                x = torch.empty(T, self.hidden)
                t0 = time.monotonic()
                dist.recv(x, src=self.rank - 1)
                spans.append((self.rank, mb, Kind.WAIT.value, t0, time.monotonic()))
            t0 = time.monotonic()
            y = self.compute(x)
            if self.last:
                outputs.append(y)
                self.model.logits(y[-1:])                           # the next token's logits, as serving would
            spans.append((self.rank, mb, Kind.COMPUTE.value, t0, time.monotonic()))
            if not self.last:
                sends.append(dist.isend(y, dst=self.rank + 1))
        for work in sends:
            work.wait()
        return outputs


def pp_worker(rank: int, world_size: int, model_name: str, batch: list[list[int]], settings: PPSettings) -> dict:
    """One stage: load, keep its layers, run each schedule of settings.schedules (the first m
    microbatches of `batch`). The last stage returns the outputs of the largest schedule and,
    with settings.check, their comparison with the whole model in one process."""
    from core.registry import load

    if len({len(ids) for ids in batch}) != 1:
        raise InvalidParameter("batch", "every microbatch must have the same number of tokens")
    t0 = time.monotonic()
    loaded = load(model_name)
    model = Transformer.from_state_dict(loaded.config, loaded.state_dict)
    stage = Stage(model, rank, world_size)
    reference = model.layers if stage.last and settings.check else None
    model.layers = None                                 # this stage keeps only its own blocks
    del loaded
    out = {"rank": rank, "pid": os.getpid(), "threads": torch.get_num_threads(),
           "layers": [stage.layers.start, stage.layers.stop], "load_s": time.monotonic() - t0}
    stage.run(batch[:1], [])                             # warm-up: first calls pay setup
    out["runs"], outputs = [], []
    for m in settings.schedules:
        spans = []
        dist.barrier()
        result = stage.run(batch[:m], spans)
        outputs = result if len(result) > len(outputs) else outputs
        out["runs"].append({"microbatches": m, "spans": spans})
    if stage.last:
        out["outputs"] = [o.numpy() for o in outputs]  # by value (see tensor_parallel.tp_worker)
        if reference is not None:
            model.layers = reference                     # the whole model, for the check only
            with torch.inference_mode():
                single = [model.forward(torch.tensor(ids), torch.arange(len(ids))) for ids in batch[:len(outputs)]]
            out["bit_equal"] = all(torch.equal(a, b) for a, b in zip(outputs, single))
            out["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(outputs, single))
    return out


# ---- python -m core.parallel.pipeline --check: here, or across machines under torchrun -------------------

BATCH_TEXT = ("A pipeline passes work from one stage to the next. The first stage starts on the first item "
              "while the others wait; once it hands that item on, it takes the second, and soon every stage is "
              "busy with a different item. At the end the first stages run out of work and sit idle while the "
              "last ones finish. Those idle stretches at the start and at the end are the bubble. Cutting the "
              "batch into more, smaller microbatches shortens them, because each stage waits for less before "
              "its first item arrives, but each microbatch must still be large enough to keep a stage's "
              "arithmetic efficient, and every one of them crosses the links between the stages.")
WINDOW_STEP = 5           # microbatch i starts WINDOW_STEP * i tokens into the text


def check_batch(tokenizer, microbatches: int, tokens: int) -> list[list[int]]:
    """m different microbatches of `tokens` tokens each: overlapping windows of a fixed text."""
    ids = tokenizer.encode(BATCH_TEXT)
    need = WINDOW_STEP * (microbatches - 1) + tokens
    ids = ids * (need // len(ids) + 1)
    return [ids[WINDOW_STEP * i:WINDOW_STEP * i + tokens] for i in range(microbatches)]


def main(argv=None) -> int:
    import argparse

    from core.parallel.workers import WorkerGroup, launched_by_torchrun, run_torchrun_rank
    from core.registry import load

    parser = argparse.ArgumentParser(prog="python -m core.parallel.pipeline",
                                     description="Run the model as a pipeline and compare with one process.")
    parser.add_argument("--check", action="store_true", help="run the check (the only action)")
    parser.add_argument("--stages", type=int, default=3, help="processes here when not under torchrun")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per microbatch")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if not args.check:
        parser.error("nothing to do: pass --check")
    batch = check_batch(load(args.model).tokenizer, args.microbatches, args.tokens)
    settings = PPSettings(schedules=(args.microbatches,))
    if launched_by_torchrun():
        rank, stages, out = run_torchrun_rank(pp_worker, (args.model, batch, settings), args.timeout)
        if rank != stages - 1:
            return 0
        bubble = None                            # machines do not share a monotonic clock
        note = "(no bubble measured: each machine has its own clock) "
    else:
        stages = args.stages
        results = WorkerGroup(pp_worker, stages, (args.model, batch, settings), timeout_s=args.timeout).run()
        out = results[-1]
        spans = [s for r in results for s in r["runs"][0]["spans"]]
        bubble = bubble_measured(spans, stages)
        note = ""
    ok = out["bit_equal"]
    measured = f"bubble measured {bubble:.3f}, " if bubble is not None else ""
    print(f"pipeline, {stages} stages, {args.microbatches} microbatches of {args.tokens} tokens: output "
          f"{'bit-equal to' if ok else 'DIFFERENT from'} one process (max |diff| {out['max_abs_diff']:.1e}); "
          f"{measured}formula (p-1)/(m+p-1) = {bubble_formula(stages, args.microbatches):.3f} {note}"
          f"-> {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
