"""Widget `kv-cache` (section 9): N tokens generated with the KV cache and without it, timed.

Attention at step n needs the keys and values of all n earlier tokens in every layer. An engine
with a KV cache (as every serving engine since the original Transformer's decoder, and vLLM's
paged one, Kwon et al., 2023) computes them once and keeps them: after the prompt's prefill, each
step pushes ONE token through the layers. Without a cache each step recomputes the whole prefix:
step n pushes P + n - 1 tokens, and N steps push N P + N (N - 1) / 2 tokens, a triangle.

Message: `kv_cache` {text, max_tokens, run} -> a job on a sibling engine (its own KV pool, prefix
caching off) that generates `max_tokens` greedy tokens after the prompt twice:

- with the cache: one request, one engine step per slice (a prefill of P tokens, then decodes);
- without it: for every step a fresh request over prompt + the tokens so far, asking for one
  token, so the step recomputes the whole prefix (prefix caching off: nothing is reused).

Prefills run in chunks of CHUNK_TOKENS (one engine step, one slice each) so no slice is long; a
generation step's work and time are the sums over its engine steps.

The reply: both token lists (greedy, so equal), each step's time and tokens pushed through the
layers (from the engine's step records), the totals, the speedup and the machine it ran on.
"""

import itertools

from core.engine.trace import StepKind
from core.errors import InvalidParameter

from ..jobs import Progress
from .base import Widget, encode, integer, message, text
from .seam import machine, ms, remeasure, run_request, with_progress

CHUNK_TOKENS = 32             # prefill tokens per engine step (chunked prefill): one slice
MAX_PROMPT_TOKENS = 128        # the prompt: bounded so the uncached steps stay short slices
MAX_TOKENS = 64                # tokens generated: the uncached side costs ~N^2 / 2 token passes
DEFAULT_MAX_TOKENS = 16


def kv_cache(call) -> None:
    ids = encode(call, text(call.msg))
    if len(ids) > MAX_PROMPT_TOKENS:
        raise InvalidParameter("text", f"is {len(ids)} tokens; this comparison takes at most "
                                       f"{MAX_PROMPT_TOKENS} (each uncached step recomputes them all)")
    max_tokens = integer(call.msg, "max_tokens", 1, MAX_TOKENS, default=DEFAULT_MAX_TOKENS)
    inputs = {"ids": ids, "max_tokens": max_tokens, "remeasure": remeasure(call.msg)}

    def work(engine):
        return (yield from compare_job(engine, **inputs))
    call.job(inputs, work)


def compare_job(engine, ids: list[int], max_tokens: int, remeasure: int):
    P, N = len(ids), max_tokens
    block = engine.view.config.block_size
    sibling = engine.sibling(num_kv_blocks=-(-(P + N + 1) // block) + 1, max_num_seqs=1,
                         max_num_batched_tokens=CHUNK_TOKENS, enable_prefix_caching=False,
                         enable_chunked_prefill=True)
    # slices: the warm-up; the cached run's prefill chunks and N - 1 decodes; the uncached prefills
    total = 1 + -(-P // CHUNK_TOKENS) + N - 1 + sum(-(-(P + i) // CHUNK_TOKENS) for i in range(N))
    for _ in run_request(sibling, ids[:1], 1):           # warm-up: the first calls pay for setup
        yield None
    count = itertools.count(2)

    def step_note(note):
        return lambda: Progress(min(next(count), total), total, note)

    # With the cache: one request. Generation step 1 is the prompt's prefill (in chunks of
    # CHUNK_TOKENS, one engine step per slice), then each step is one decode of one token.
    cached = yield from with_progress(run_request(sibling, ids, N), step_note("with the cache"))
    steps = cached.metrics.steps
    prefill = [s for s in steps if s.kind == StepKind.PREFILL]
    with_cache = [step_work(prefill)] + [step_work([s]) for s in steps if s.kind == StepKind.DECODE]

    # Without: every step a fresh request over everything so far, asking for one token.
    generated, without_cache = [], []
    for i in range(N):
        out = yield from with_progress(run_request(sibling, ids + generated, 1),
                                       step_note(f"without the cache: step {i + 1} of {N}"))
        generated.append(out.token_ids[0])
        without_cache.append(step_work(out.metrics.steps))
    return summary(sibling.view.tokenizer, ids, list(cached.token_ids), generated, with_cache, without_cache, remeasure)


def step_work(steps) -> dict:
    """Engine steps taken as one generation step: tokens through the layers, and time."""
    return {"tokens": sum(s.num_tokens for s in steps), "ms": ms(sum(s.duration_s for s in steps))}


def summary(tokenizer, ids: list[int], cached: list[int], uncached: list[int], with_cache: list[dict],
            without_cache: list[dict], remeasure: int) -> dict:
    with_ms = sum(s["ms"] for s in with_cache)
    without_ms = sum(s["ms"] for s in without_cache)
    return {
        "machine": machine(), "run": remeasure, "prompt_tokens": len(ids), "max_tokens": len(cached),
        "prompt": [{"id": i, "text": t} for i, t in zip(ids, tokenizer.token_texts(ids))],
        "with_cache": {"token_ids": cached, "tokens": tokenizer.token_texts(cached),
                       "text": tokenizer.decode(cached), "steps": with_cache},
        "without_cache": {"token_ids": uncached, "tokens": tokenizer.token_texts(uncached),
                          "text": tokenizer.decode(uncached), "steps": without_cache},
        "same": cached == uncached,
        "tokens_computed_with_cache": sum(s["tokens"] for s in with_cache),
        "tokens_computed_without_cache": sum(s["tokens"] for s in without_cache),
        "with_cache_ms": with_ms, "without_cache_ms": without_ms,
        "speedup": without_ms / with_ms if with_ms else None,
    }


WIDGET = Widget("kv-cache", messages=(
    message("kv_cache", {"text", "max_tokens", "run"}, kv_cache, job=True),
))
