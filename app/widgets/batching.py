"""Widget `batching` (section 14): one workload through static and through continuous batching,
on two engines of its own beside the serving one; the engines' own step traces, side by side.

After Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative Models"
(OSDI 2022), iteration-level scheduling, as in vLLM. Static batching admits up to `slots`
requests and holds every slot until the whole batch is done: a short request's slot sits idle
while the longest member finishes. Continuous batching re-forms the batch every step: a finished
request's slot takes the next waiting request at once.

Message: `batching` {requests, slots, run} -> a job. `requests` is the workload: a list of
[prompt tokens, output tokens] pairs (at most MAX_REQUESTS, prompts up to MAX_PROMPT tokens,
outputs up to MAX_OUTPUT tokens). Prompts are the first tokens of a fixed passage, each request
starting a few tokens further in; decoding is greedy and ignores the end-of-text token, so each
request produces exactly its output length and both engines must produce the same tokens.
A step computes at most STEP_TOKENS tokens (chunked prefill: a prompt that does not fit is split
over steps, P in each), so every step is a short slice. One engine step per slice. Steps and idle slots are counts (deterministic); times are measured.
"""

import time

from core.engine.sampling_params import SamplingParams
from core.engine.trace import StepKind
from core.errors import InvalidParameter, is_int

from ..jobs import Progress
from .base import Widget, integer, message
from .seam import machine, remeasure, step_until_finished, with_progress

MAX_REQUESTS = 8
MAX_PROMPT = 64
MAX_OUTPUT = 32
MAX_SLOTS = 8
STEP_TOKENS = 64      # token budget of a step: longer prompts prefill in chunks, each step a short slice
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a book "
           "and a small tin of biscuits. From the top he could see the whole bay: the fishing boats coming "
           "home, the gulls circling the harbour wall, the ferry that crossed twice a day to the island, and "
           "far out, the grey line where the sea met the sky. He wrote down the weather, the ships he saw and "
           "the time the light came on, in a thick notebook that his grandfather had started sixty years before.")
MODES = ("static", "continuous")


def batching(call) -> None:
    msg = call.msg
    workload = requests(msg)
    slots = integer(msg, "slots", 1, MAX_SLOTS, default=3)
    again = remeasure(msg)
    prompts = prompt_ids(call.tokenizer, workload)

    def work(engine):
        return (yield from compare(engine, prompts, [out for _, out in workload], slots))
    call.job({"requests": workload, "slots": slots, "remeasure": again}, work)


def requests(msg: dict) -> list[list[int]]:
    """The workload: [[prompt tokens, output tokens], ...], bounded."""
    value = msg.get("requests")
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_REQUESTS:
        raise InvalidParameter("requests", f"must be a list of 1 to {MAX_REQUESTS} [prompt tokens, output tokens] pairs")
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(v) for v in pair)
                and 1 <= pair[0] <= MAX_PROMPT and 1 <= pair[1] <= MAX_OUTPUT):
            raise InvalidParameter("requests", f"each request is [prompt tokens 1..{MAX_PROMPT}, "
                                   f"output tokens 1..{MAX_OUTPUT}], got {pair!r}")
    return [list(p) for p in value]


def prompt_ids(tokenizer, workload: list[list[int]]) -> list[list[int]]:
    """Request i's prompt: `prompt tokens` tokens of the passage, starting 5·i tokens in."""
    ids = tokenizer.encode(PASSAGE)
    return [ids[5 * i: 5 * i + n] for i, (n, _) in enumerate(workload)]


def compare(engine, prompts: list[list[int]], outputs: list[int], slots: int):
    started = time.time()
    results = {}
    total = 2 * (len(prompts) + max(outputs)) * len(prompts)   # a bound on the steps of both runs
    for mode in MODES:
        results[mode] = yield from run_mode(engine, mode, prompts, outputs, slots, total, done=0 if mode == "static" else total // 2)
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(results["static"]["requests"], results["continuous"]["requests"])]
    return {
        "slots": slots, "requests": [[len(p), n] for p, n in zip(prompts, outputs)],
        "static": results["static"], "continuous": results["continuous"], "same_tokens": all(same),
        "static_steps": results["static"]["steps"], "continuous_steps": results["continuous"]["steps"],
        "static_idle_slots": results["static"]["idle_slots"], "continuous_idle_slots": results["continuous"]["idle_slots"],
        "machine": machine(started),
    }


def run_mode(engine, mode: str, prompts, outputs, slots: int, total: int, done: int):
    """The workload on a fresh sibling engine with `mode` scheduling, one step per slice."""
    bs = engine.view.config.block_size
    blocks = sum(-(-(len(p) + n) // bs) for p, n in zip(prompts, outputs)) + 2   # room for all: no preemption
    sibling = engine.sibling(scheduling=mode, max_num_seqs=slots, num_kv_blocks=blocks,
                         max_num_batched_tokens=STEP_TOKENS, enable_prefix_caching=False,
                         enable_chunked_prefill=True, trace_steps=4096)
    ids = [sibling.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)).request_id
           for p, n in zip(prompts, outputs)]
    index = {rid: i for i, rid in enumerate(ids)}
    finished = yield from with_progress(step_until_finished(sibling, ids), lambda: Progress(
        min(done + sibling.view.num_steps, total), total, f"{mode} batching: step {sibling.view.num_steps}"))
    return summarize(sibling, ids, index, finished, slots)


def summarize(sibling, ids, index, finished, slots: int) -> dict:
    rows, clock, done_at = [], 0.0, {}
    for t in sibling.view.trace:
        clock += t.duration_s
        cells = [cell(s, index) for s in t.slots] + [None] * (slots - len(t.slots))
        rows.append({"step": t.step, "ms": round(1000 * t.duration_s, 3), "cells": cells})
        for rid in t.finished:
            done_at[rid] = {"step": len(rows), "ms": round(1000 * clock, 3)}
    busy = sum(1 for r in rows for c in r["cells"] if c and c["kind"] != "idle")
    reqs = []
    for rid in ids:
        out = finished[rid]
        reqs.append({"index": index[rid], "token_ids": out.token_ids, "text": out.text,
                     "done_step": done_at[rid]["step"], "done_ms": done_at[rid]["ms"]})
    return {"steps": len(rows), "idle_slots": len(rows) * slots - busy, "busy_slots": busy,
            "total_ms": round(1000 * clock, 3), "trace": rows, "requests": reqs}


def cell(work, index: dict) -> dict | None:
    """One slot in one step: None (empty), or which request did what: P (prefill), Dn (n-th token), idle."""
    if work is None:
        return None
    req = index[work.request_id]
    if work.kind == StepKind.IDLE:
        return {"request": req, "kind": "idle", "label": "·"}
    if work.kind == StepKind.PREFILL:
        return {"request": req, "kind": "prefill", "label": "P", "tokens": work.num_tokens}
    return {"request": req, "kind": "decode", "label": f"D{work.output_index}", "tokens": work.num_tokens}


WIDGET = Widget("batching", messages=(message("batching", {"requests", "slots", "run"}, batching, job=True),))
