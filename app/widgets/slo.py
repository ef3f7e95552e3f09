"""Widget `slo` (section 21): goodput, the requests per second that meet a latency objective, next to
throughput, as the batch limit and admission control change; measured on this machine.

After DistServe (Zhong et al., 2024), which defines goodput as the rate of requests meeting both a
TTFT and a TPOT objective, and vLLM's serving benchmark (benchmarks/benchmark_serving.py) for the
metrics: TTFT = first token - arrival, TPOT = (finish - first token) / (output tokens - 1),
throughput = completed requests (or their output tokens) / the run's duration.

Message: `slo` {rate, requests, seed, batch_limits, max_waiting, ttft_ms, tpot_ms, run} -> a job.
The load is a seeded Poisson process generated here: exponential inter-arrival times at `rate`
requests/s (at most MAX_REQUESTS per run), each request a seeded prompt length and output length.
Every batch limit runs twice, with admission off and on (on: a request that arrives while
`max_waiting` requests wait is rejected at once, and counts in neither completed nor goodput), each
run on a fresh engine of its own beside the serving one (`engine.sibling(max_num_seqs=...)`, with a
STEP_TOKENS budget per step, so a burst of prompts is prefilled in chunks), one engine step per slice. The clock of a run is virtual: it advances by each engine step's measured
duration and jumps over idle gaps to the next arrival, so time spent serving other readers between
slices never counts, and a request arriving during a step joins at the next one, as in a server.
`run` is the reader's "measure again" counter: a new value is a new job.
"""

import math
import random
import time

from core.engine.sampling_params import SamplingParams
from core.errors import InvalidParameter

from ..jobs import Progress
from .base import Widget, integer, message, number
from .seam import machine, remeasure, run_request

MAX_REQUESTS = 32            # requests per run
MAX_BATCH_LIMITS = 3         # batch limits per job (each runs with admission off and on: 6 runs)
MAX_BATCH = 16               # the largest batch limit
PROMPT_TOKENS = (8, 48)      # each prompt's length, drawn uniformly (tokens)
OUTPUT_TOKENS = (4, 12)      # each answer's length, drawn uniformly (tokens; EOS ignored)
STEP_TOKENS = 64             # token budget of one step on the experiment's engines (chunked prefill): short slices
SOURCE = ("A service answers many people at once. Each request waits in a queue, has its prompt read in "
          "one pass, and then receives its answer one token at a time, while the engine decides at every "
          "step which requests run together and which wait. Latency is what one person feels; throughput "
          "is what the machine delivers; goodput is the part of throughput that kept its promise.")


def slo(call) -> None:
    msg = call.msg
    inputs = {
        "rate": number(msg, "rate", 0.5, 200.0, default=4.0),
        "requests": integer(msg, "requests", 4, MAX_REQUESTS, default=16),
        "seed": integer(msg, "seed", 0, 1_000_000, default=0),
        "batch_limits": batch_limits(msg),
        "max_waiting": integer(msg, "max_waiting", 1, MAX_REQUESTS, default=2),
        "ttft_ms": number(msg, "ttft_ms", 1.0, 60_000.0, default=1000.0),
        "tpot_ms": number(msg, "tpot_ms", 1.0, 10_000.0, default=250.0),
        "run": remeasure(msg),
    }
    source = call.tokenizer.encode(SOURCE)

    def work(engine):
        return (yield from measure(engine, inputs, source))
    call.job(inputs, work)


def batch_limits(msg: dict) -> list[int]:
    value = msg.get("batch_limits", [2, 8])
    if (not isinstance(value, list) or not 1 <= len(value) <= MAX_BATCH_LIMITS
            or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_BATCH for v in value)):
        raise InvalidParameter("batch_limits", f"must be a list of 1 to {MAX_BATCH_LIMITS} integers "
                                               f"from 1 to {MAX_BATCH}, got {value!r}")
    if len(set(value)) != len(value):
        raise InvalidParameter("batch_limits", f"must not repeat a value, got {value!r}")
    return sorted(value)


# -- the load ---------------------------------------------------------------------------------
def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """n arrival times (s) of a Poisson process at `rate` requests/s: the running sum of
    exponential inter-arrival gaps with mean 1/rate, the first request at 0."""
    if not rate > 0:
        raise InvalidParameter("rate", f"must be positive, got {rate!r}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def workload(inputs: dict, source: list[int]) -> list[dict]:
    """The seeded requests: arrival time, prompt ids (a prefix of SOURCE) and output length."""
    rng = random.Random(inputs["seed"] + 1)
    arrivals = poisson_arrivals(inputs["rate"], inputs["requests"], inputs["seed"])
    longest = min(PROMPT_TOKENS[1], len(source))
    return [{"arrival_s": t, "prompt": source[:rng.randint(PROMPT_TOKENS[0], longest)],
             "max_tokens": rng.randint(*OUTPUT_TOKENS)} for t in arrivals]


# -- one run ----------------------------------------------------------------------------------
def serve(engine, requests: list[dict], max_num_seqs: int, max_waiting: int | None, note: str):
    """Serve `requests` on a fresh sibling engine with this batch limit and admission cap (None: no
    cap), one engine step per slice, on a virtual clock. -> (records, steps, duration_s)."""
    bs = engine.view.config.block_size
    blocks = sum(-(-(len(r["prompt"]) + r["max_tokens"]) // bs) for r in requests) + 4   # never preempts
    sibling = engine.sibling(max_num_seqs=max_num_seqs, num_kv_blocks=blocks, trace_steps=16,
                         max_num_batched_tokens=STEP_TOKENS, enable_prefix_caching=False)
    yield Progress(0, len(requests), note)                  # building the engine was this slice
    records = [{"arrival_s": r["arrival_s"], "rejected": False, "first_token_s": None, "finished_s": None,
                "output_tokens": 0} for r in requests]
    clock, nxt, steps = 0.0, 0, 0
    while nxt < len(requests) or sibling.has_unfinished_requests():
        while nxt < len(requests) and requests[nxt]["arrival_s"] <= clock:    # arrivals up to now
            if max_waiting is not None and sibling.view.stats()["waiting"] >= max_waiting:
                records[nxt]["rejected"] = True                                   # turned away at arrival
            else:
                r = requests[nxt]
                sibling.add_request(r["prompt"], SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                                            ignore_eos=True), request_id=str(nxt))
            nxt += 1
        if not sibling.has_unfinished_requests():
            clock = max(clock, requests[nxt]["arrival_s"])                        # idle: skip to the next
            continue
        t0 = time.perf_counter()
        outputs = sibling.step()
        clock += time.perf_counter() - t0
        steps += 1
        for out in outputs:
            rec = records[int(out.request_id)]
            rec["output_tokens"] = len(out.token_ids)
            if rec["first_token_s"] is None:
                rec["first_token_s"] = clock
            if out.finished:
                rec["finished_s"], rec["token_ids"] = clock, list(out.token_ids)
        yield Progress(nxt, len(requests), note)
    return records, steps, clock


# -- the metrics ------------------------------------------------------------------------------
def request_latency(rec: dict) -> tuple[float, float]:
    """(TTFT, TPOT) of a completed request in ms; TPOT is 0 for a one-token answer."""
    ttft = rec["first_token_s"] - rec["arrival_s"]
    n = rec["output_tokens"]
    tpot = (rec["finished_s"] - rec["first_token_s"]) / (n - 1) if n > 1 else 0.0
    return 1000 * ttft, 1000 * tpot


def summarize(records: list[dict], duration_s: float, ttft_ms: float, tpot_ms: float) -> dict:
    """Throughput and goodput of one run. A rejected request is neither completed nor good; a good
    request is a completed one whose TTFT and TPOT are both within the objective."""
    completed = [r for r in records if not r["rejected"] and r["finished_s"] is not None]
    good = []
    for r in completed:
        ttft, tpot = request_latency(r)
        r["ttft_ms"], r["tpot_ms"] = round(ttft, 3), round(tpot, 3)
        r["met"] = ttft <= ttft_ms and tpot <= tpot_ms
        if r["met"]:
            good.append(r)
    span = duration_s if duration_s > 0 else math.inf
    return {
        "completed": len(completed), "good": len(good),
        "rejected": sum(r["rejected"] for r in records), "duration_s": duration_s,
        "throughput_rps": len(completed) / span, "goodput_rps": len(good) / span,
        "output_tok_s": sum(r["output_tokens"] for r in completed) / span,
        "good_tok_s": sum(r["output_tokens"] for r in good) / span,
    }


def best(runs: list[dict], key: str) -> int:
    """Index of the run with the highest `key` (ties: the earlier run, the smaller batch limit)."""
    return max(range(len(runs)), key=lambda i: (runs[i][key], -i))


def measure(engine, inputs: dict, source: list[int]):
    requests = workload(inputs, source)
    settings = [(b, cap) for b in inputs["batch_limits"] for cap in (None, inputs["max_waiting"])]
    yield Progress(0, len(requests), "starting")
    yield from warm_up(engine.sibling(max_num_seqs=1, num_kv_blocks=8, trace_steps=4))
    started = time.time()
    runs = []
    for k, (b, cap) in enumerate(settings):
        note = f"run {k + 1} of {len(settings)}: batch limit {b}, " + ("no admission limit" if cap is None else
                                                                       f"reject beyond {cap} waiting")
        records, steps, duration = yield from serve(engine, requests, b, cap, note)
        runs.append({"max_num_seqs": b, "max_waiting": cap, "steps": steps,
                     **summarize(records, duration, inputs["ttft_ms"], inputs["tpot_ms"]), "requests": records})
    by_goodput, by_throughput = best(runs, "goodput_rps"), best(runs, "output_tok_s")
    return {
        "inputs": inputs, "runs": runs,
        "arrivals_s": [r["arrival_s"] for r in requests],
        "mean_interarrival_s": (requests[-1]["arrival_s"] / (len(requests) - 1)),
        "best_by_goodput": by_goodput, "best_by_throughput": by_throughput,
        "goodput_rps": runs[by_goodput]["goodput_rps"], "best_max_num_seqs": runs[by_goodput]["max_num_seqs"],
        "machine": machine(started),
    }


def warm_up(sibling):
    """A short request, one step per slice, so first-call costs stay out of the timed runs."""
    yield from run_request(sibling, [sibling.view.model_config.bos_token_id] * 3, 2, ignore_eos=False)


WIDGET = Widget("slo", messages=(
    message("slo", {"rate", "requests", "seed", "batch_limits", "max_waiting", "ttft_ms", "tpot_ms", "run"},
            slo, job=True),
))
