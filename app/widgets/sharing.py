"""Widget `sharing` (sections 11 and 14): KV blocks shared and taken back, step by step, on a small
engine beside the serving one.

After vLLM (Kwon et al., 2023, sections 4.4 and 4.5). Three scenarios, each a job on a sibling
engine with blocks of BLOCK_SIZE tokens, so a short prompt spans several blocks:
- `samples`: n samples of one prompt (SamplingParams.n). Each step's block tables and reference
  counts; the step where the shared, partial last block is copied (copy-on-write); the most blocks
  in use, against the same n samples run as n separate requests (both measured).
- `beams`: a beam search (BeamSearchParams): each step's live beams, their blocks, who forked and
  who was pruned.
- `preemption`: REQUESTS requests in a pool too small for them, once with preemption by recompute
  and once by swap: who was preempted when, the tokens computed again, the blocks swapped and the
  measured copy time, and what the same bytes would take over a GPU's host link (computed,
  app/lab/host_link.py). Both runs give the same tokens, which the reply says.

Message: `sharing` {scenario, prompt, n, beam_width, run} -> a job.
"""

import time

from core.engine.beam_search import BeamSearchParams
from core.engine.sampling_params import SamplingParams, derived_seed
from core.errors import InvalidParameter

from ..jobs import Progress
from ..lab.host_link import HOST_LINK_BYTES_PER_S, HOST_LINK_NAME, host_link_ms
from .base import Widget, integer, message, text
from .seam import machine, ms, remeasure

SCENARIOS = ("samples", "beams", "preemption")
BLOCK_SIZE = 4              # tokens per block on the widget's engines: a short prompt spans several
MAX_PROMPT_TOKENS = 48
MAX_N = 8                   # samples at most
MAX_BEAM_WIDTH = 4
SAMPLE_TOKENS = 10          # tokens each sample generates
BEAM_TOKENS = 6             # steps of the beam search
TEMPERATURE = 0.8
SEED = 0
POOL_BLOCKS = 64            # the samples' and beams' pool: room for everything
SMALL_POOL = 12             # the preemption scenario's pool, in blocks: too small for REQUESTS at once
REQUESTS = ["The capital of France is", "Water boils at", "A haiku about the sea:", "List three colours:"]
PREEMPT_TOKENS = 16         # each request's output tokens in the preemption scenario


def sharing(call) -> None:
    msg = call.msg
    scenario = msg.get("scenario", "samples")
    if scenario not in SCENARIOS:
        raise InvalidParameter("scenario", f"must be one of {list(SCENARIOS)}, got {scenario!r}")
    prompt = text(msg, "prompt") if "prompt" in msg else "Name a colour of the sea:"
    ids = call.tokenizer.encode(prompt)
    if len(ids) > MAX_PROMPT_TOKENS:
        raise InvalidParameter("prompt", f"is {len(ids)} tokens; the most this widget takes is {MAX_PROMPT_TOKENS}")
    n = integer(msg, "n", 2, MAX_N, default=4)
    width = integer(msg, "beam_width", 2, MAX_BEAM_WIDTH, default=3)
    again = remeasure(msg)
    requests = [call.tokenizer.encode(r) for r in REQUESTS]

    def work(engine):
        started = time.time()
        if scenario == "samples":
            result = yield from samples(engine, ids, n)
        elif scenario == "beams":
            result = yield from beams(engine, ids, width)
        else:
            result = yield from preemption(engine, requests)
        return {"scenario": scenario, "block_size": BLOCK_SIZE, "machine": machine(started), **result}
    call.job({"scenario": scenario, "prompt": prompt, "n": n, "beam_width": width, "remeasure": again}, work)


def small_engine(engine, **settings):
    return engine.sibling(block_size=BLOCK_SIZE, enable_prefix_caching=False, max_num_seqs=8,
                          trace_steps=256, **{"num_kv_blocks": POOL_BLOCKS, **settings})


def tables(sibling, names: dict[str, str]) -> list[dict]:
    """Every running sequence's blocks with their reference counts, named for the reader."""
    return [{"name": names.get(t["request_id"], t["request_id"]), "id": t["request_id"], "tokens": t["num_tokens"],
             "blocks": t["blocks"], "refs": t["ref_counts"]} for t in sibling.view.block_tables()]


def samples(engine, ids: list[int], n: int):
    """n samples of one prompt sharing its blocks, then the same n as separate requests."""
    sib = small_engine(engine)
    params = SamplingParams(n=n, temperature=TEMPERATURE, seed=SEED, max_tokens=SAMPLE_TOKENS, ignore_eos=True)
    rid = sib.add_request(ids, params).request_id
    names = {rid: "sample 0", **{f"{rid}#{i}": f"sample {i}" for i in range(1, n)}}
    steps, last = [], None
    while sib.has_unfinished_requests():
        for out in sib.step():
            last = out
        row = sib.view.trace[-1]
        steps.append({"step": len(steps), "tables": tables(sib, names), "used": row.kv_blocks_used,
                      "copied": row.blocks_copied, "copy_ms": ms(row.copy_s), "ms": ms(row.duration_s)})
        yield Progress(len(steps), SAMPLE_TOKENS * 2, f"{n} samples sharing the prompt: step {len(steps)}")
    apart = small_engine(engine)
    for i in range(n):
        apart.add_request(ids, SamplingParams(temperature=TEMPERATURE, seed=derived_seed(SEED, i),
                                              max_tokens=SAMPLE_TOKENS, ignore_eos=True))
    separate = []
    while apart.has_unfinished_requests():
        apart.step()
        separate.append(apart.view.trace[-1].kv_blocks_used)
        yield Progress(SAMPLE_TOKENS + len(separate), SAMPLE_TOKENS * 2, f"the same {n} as separate requests")
    peak_shared, peak_apart = max(s["used"] for s in steps), max(separate)
    return {"n": n, "prompt_tokens": len(ids), "prompt": engine.view.tokenizer.token_texts(ids), "steps": steps,
            "samples": [{"index": c.index, "text": c.text} for c in last.outputs],
            "copies": sum(s["copied"] for s in steps), "peak_blocks_shared": peak_shared,
            "peak_blocks_separate": peak_apart, "blocks_saved": peak_apart - peak_shared,
            "separate_used": separate}


def beams(engine, ids: list[int], width: int):
    """A beam search: each step's live beams, their blocks, forks and prunes."""
    sib = small_engine(engine)
    group = sib.add_beam_search(ids, BeamSearchParams(beam_width=width, max_tokens=BEAM_TOKENS))
    tok = engine.view.tokenizer
    steps, before = [], set()
    while not group.is_finished:
        sib.step()
        live = {s.request_id: s for s in group.live}
        names = {r: f"beam {r.rsplit('#', 1)[-1] if '#' in r else 0}" for r in live}
        row = sib.view.trace[-1]
        steps.append({"step": len(steps), "tables": tables(sib, names), "used": row.kv_blocks_used,
                      "copied": row.blocks_copied,
                      "beams": [{"name": names[r], "text": tok.decode(s.output_token_ids),
                                 "cum_logprob": round(group.cum.get(r, 0.0), 4)} for r, s in live.items()],
                      "forked": sorted(names[r] for r in set(live) - before if before),
                      "pruned": sorted(f"beam {r.rsplit('#', 1)[-1] if '#' in r else 0}" for r in before - set(live))})
        before = set(live)
        yield Progress(len(steps), BEAM_TOKENS + 1, f"beam search, width {width}: step {len(steps)}")
    return {"beam_width": width, "prompt_tokens": len(ids), "steps": steps,
            "best": [{"text": b.text, "cum_logprob": round(b.cum_logprob, 4), "tokens": len(b.token_ids)}
                     for b in group.result.sequences]}


def preemption(engine, requests: list[list[int]]):
    """The same requests in a too-small pool, by recompute and by swap."""
    runs, outputs = {}, {}
    for mode in ("recompute", "swap"):
        sib = small_engine(engine, num_kv_blocks=SMALL_POOL, preemption_mode=mode)
        params = SamplingParams(temperature=0.0, max_tokens=PREEMPT_TOKENS, ignore_eos=True)
        rids = [sib.add_request(ids, params).request_id for ids in requests]
        names = {r: f"request {i + 1}" for i, r in enumerate(rids)}
        done = {}
        while sib.has_unfinished_requests():
            for out in sib.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            yield Progress(len(sib.view.trace), 2 * PREEMPT_TOKENS * len(requests), f"preemption by {mode}")
        outputs[mode] = [done[r] for r in rids]
        runs[mode] = summary(sib, names)
    return {"pool_blocks": SMALL_POOL, "requests": REQUESTS, "runs": runs,
            "same_tokens": outputs["recompute"] == outputs["swap"],
            "host_link": {"name": HOST_LINK_NAME, "gb_s": round(HOST_LINK_BYTES_PER_S / 1e9, 2)}}


def summary(sib, names: dict[str, str]) -> dict:
    trace = list(sib.view.trace)
    block_bytes = sib.view.kv_stats()["bytes"] // sib.view.kv_stats()["total_blocks"]
    rows = [{"step": r.step, "ms": ms(r.duration_s), "used": r.kv_blocks_used, "running": r.running,
             "waiting": r.waiting, "swapped": r.swapped,
             "preempted": [names[p] for p in r.preempted], "swapped_out": [names[p] for p in r.swapped_out],
             "swapped_in": [names[p] for p in r.swapped_in],
             "recomputed": sum(w.num_tokens for w in r.slots if w is not None and w.recompute),
             "blocks_out": r.blocks_swapped_out, "blocks_in": r.blocks_swapped_in, "swap_ms": ms(r.swap_s)}
            for r in trace]
    moved = sum(r["blocks_out"] + r["blocks_in"] for r in rows)
    return {"steps": rows, "total_ms": ms(sum(r.duration_s for r in trace)), "num_steps": len(rows),
            "preemptions": sum(len(r["preempted"]) for r in rows),
            "recomputed_tokens": sum(r["recomputed"] for r in rows),
            "recompute_ms": ms(sum(r.duration_s for r in trace
                                   if any(w is not None and w.recompute for w in r.slots))),
            "blocks_swapped": moved, "swap_bytes": moved * block_bytes, "swap_ms": ms(sum(r.swap_s for r in trace)),
            "host_link_ms": float(f"{host_link_ms(moved * block_bytes):.3g}")}   # 3 significant figures


WIDGET = Widget("sharing", messages=(
    message("sharing", {"scenario", "prompt", "n", "beam_width", "run"}, sharing, job=True),
))
