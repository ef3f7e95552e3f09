"""Widget `phases` (section 8): prefill and decode, timed on this server's own engine.

A request runs in two phases (Orca, Yu et al., 2022; vLLM; "Splitwise", Patel et al., 2024):
prefill pushes every prompt token through the weights at once, decode pushes one token per step.
The arithmetic per token is the same, but the weights read from memory per token are not: a
prefill chunk of T tokens uses each weight T times, a decode step once. So prefill is bound by
the arithmetic units (FLOP/s) and decode by memory bandwidth: the roofline model (Williams,
Waterman & Patterson, 2009). This widget measures all four on this machine:

- the prefill time of prompts of 16, 32, ... `max_prompt` tokens, run as chunked prefill steps of
  a sibling engine (CHUNK_TOKENS a step, one step per slice) and timed as a whole, best of PREFILL_TRIES;
- the time of each decode step of a generation that continues the longest prompt, as the
  context grows by one token a step;
- memory read bandwidth (a timed sum over a tensor far larger than the caches) and matmul FLOP/s
  (a timed square matmul), best of a few tries each, one try per slice;
- from those, the roofline's bounds for this model: the decode step can be no faster than reading
  every weight once (in the serving engine's weight format: fp32, bf16 or 4-bit q4_1), and
  prefill no faster than 2 FLOPs per weight per token at the matmul rate.

Message: `phases` {max_prompt, decode_tokens, run} -> a job (cached by its inputs: `run` is the
reader's "measure again" counter). The reply carries the machine, its thread count and the time
of the measurement. Timings come from the engine's own step records (RequestOutput.metrics).
"""

import itertools
import statistics
import time

import torch

from core.engine.trace import StepKind
from core.errors import InvalidParameter, is_int

from ..jobs import Progress
from .base import Widget, integer, message
from .seam import filler_ids, machine, ms, read_bandwidth, remeasure, run_request, with_progress

CHUNK_TOKENS = 32                      # prefill tokens per engine step (chunked prefill): one slice
PROMPT_LENGTHS = tuple(16 << i for i in range(8))   # 16, 32, ... 2,048: the sweep's points
DEFAULT_MAX_PROMPT = 256
MAX_DECODE_TOKENS = 128
DEFAULT_DECODE_TOKENS = 16
MATMUL_SIZE = 1024                     # (N, N) @ (N, N): 2 N^3 FLOPs
TRIES = 3                              # best of: the machine is shared, the best try is the machine
PREFILL_TRIES = 2                      # ... and for each prompt of the sweep


def phases(call) -> None:
    msg = call.msg
    limit = call.info["context_window"] - MAX_DECODE_TOKENS
    choices = [n for n in PROMPT_LENGTHS if n <= limit]
    max_prompt = msg.get("max_prompt", min(DEFAULT_MAX_PROMPT, choices[-1]))
    if not is_int(max_prompt) or max_prompt not in choices:
        raise InvalidParameter("max_prompt", f"must be one of {choices} (the sweep's longest prompt), "
                                             f"got {max_prompt!r}")
    decode_tokens = integer(msg, "decode_tokens", 1, MAX_DECODE_TOKENS, default=DEFAULT_DECODE_TOKENS)
    inputs = {"max_prompt": max_prompt, "decode_tokens": decode_tokens, "remeasure": remeasure(msg)}

    def work(engine):
        return (yield from phases_job(engine, **inputs))
    call.job(inputs, work)


def phases_job(engine, max_prompt: int, decode_tokens: int, remeasure: int):
    lengths = [n for n in PROMPT_LENGTHS if n <= max_prompt]
    prefill_slices = PREFILL_TRIES * sum(-(-n // CHUNK_TOKENS) for n in lengths)
    total = 1 + prefill_slices + decode_tokens + 2 * TRIES
    block = engine.view.config.block_size
    sibling = engine.sibling(num_kv_blocks=-(-(max_prompt + decode_tokens + 1) // block) + 1, max_num_seqs=1,
                         max_num_batched_tokens=CHUNK_TOKENS, enable_prefix_caching=False,
                         enable_chunked_prefill=True, chunk_context_tokens=0)   # CHUNK_TOKENS every step
    yield Progress(0, total, "a fresh engine beside the serving one")
    for _ in run_request(sibling, filler_ids(sibling.view.tokenizer, 16), 1):   # warm-up: first calls pay setup
        yield None
    count = itertools.count(2)

    prefill, decode = [], []
    for n in lengths:
        last = n == max_prompt
        note = f"{n}-token prompt" + (", then decode" if last else "")
        tries = []
        for i in range(PREFILL_TRIES):       # the last try of the longest prompt goes on to decode
            max_tokens = decode_tokens + 1 if last and i == PREFILL_TRIES - 1 else 1
            out = yield from with_progress(run_request(sibling, filler_ids(sibling.view.tokenizer, n), max_tokens),
                                           lambda: Progress(min(next(count), total), total, note))
            tries.append(prefill_row(out, n))
        prefill.append(min(tries, key=lambda t: t["ms"]))
        if last:
            decode = decode_rows(out, n)

    done = next(count) - 1
    bandwidth = yield from best_of(read_bandwidth, "memory bandwidth", done, total)
    flop_s = yield from best_of(matmul_flop_s, "matmul FLOP/s", done + TRIES, total)
    return summary(sibling, prefill, decode, bandwidth, flop_s, max_prompt, decode_tokens, remeasure)


def prefill_row(out, n: int) -> dict:
    """A prompt's prefill from its request's step records: each chunk, and their total."""
    chunks = [s for s in out.metrics.steps if s.kind == StepKind.PREFILL]
    return {"prompt_tokens": n, "ms": ms(sum(s.duration_s for s in chunks)),
            "steps": [{"tokens": s.num_tokens, "ms": ms(s.duration_s)} for s in chunks]}


def decode_rows(out, n: int) -> list[dict]:
    """Each decode step after an n-token prompt: decode step i feeds token i, attending over n + i."""
    steps = [s for s in out.metrics.steps if s.kind == StepKind.DECODE]
    return [{"index": i, "context": n + i, "ms": ms(s.duration_s)} for i, s in enumerate(steps, 1)]


def best_of(measure, note: str, done: int, total: int):
    """The best of TRIES runs of measure() (one per slice): the shared machine's least-disturbed run."""
    best = 0.0
    for i in range(TRIES):
        best = max(best, measure())
        yield Progress(done + i + 1, total, note)
    return best


def matmul_flop_s() -> float:
    """FLOP/s of one (N, N) @ (N, N) float32 matmul: 2 N^3 FLOPs (compute-bound)."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE)        # (N, N)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE)        # (N, N)
    t0 = time.perf_counter()
    a @ b
    return 2 * MATMUL_SIZE ** 3 / (time.perf_counter() - t0)


def summary(engine, prefill: list, decode: list, bandwidth: float, flop_s: float, max_prompt: int,
            decode_tokens: int, remeasure: int) -> dict:
    mc = engine.view.model_config
    num_params = sum(p.numel() for p in engine.view.model.parameters())
    weight_bytes = engine.view.model.decode_weight_bytes()     # in the format the engine multiplies
    # The weight matmuls: 2 FLOPs per weight per token, less the embedding table (a lookup, and
    # the tied output head runs only for the one sampled position). Attention adds ~4 T C a layer.
    flops_per_token = 2 * (num_params - mc.vocab_size * mc.hidden_size)
    longest = prefill[-1]
    decode_ms = [d["ms"] for d in decode]
    return {
        "machine": machine(), "run": remeasure, "max_prompt": max_prompt, "decode_tokens": decode_tokens,
        "chunk_tokens": CHUNK_TOKENS, "prefill": prefill, "decode": decode,
        "prefill_tokens_per_s": longest["prompt_tokens"] / (longest["ms"] / 1000.0),
        "decode_step_ms": statistics.median(decode_ms),
        "memory_bandwidth_gb_s": bandwidth / 1e9, "matmul_gflop_s": flop_s / 1e9,
        "num_params": num_params, "weight_format": engine.view.config.weight_format.value,
        "activation_rounding": engine.view.model.activation_rounding(),
        "attention_operands": engine.view.model.attention_operands(),
        "weight_bytes": weight_bytes, "flops_per_token": flops_per_token,
        # the roofline's bounds for this model on this machine
        "decode_floor_ms": weight_bytes / bandwidth * 1000.0,
        "prefill_ceiling_tokens_per_s": flop_s / flops_per_token,
        "machine_balance": flop_s / bandwidth,                               # FLOPs per byte to be compute-bound
        "decode_intensity": flops_per_token / weight_bytes,                  # FLOPs per weight byte, 1 token
        "prefill_intensity": flops_per_token * CHUNK_TOKENS / weight_bytes,  # ... a chunk of tokens
    }


WIDGET = Widget("phases", messages=(
    message("phases", {"max_prompt", "decode_tokens", "run"}, phases, job=True),
))
