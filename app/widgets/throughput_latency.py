"""Widget `throughput-latency` (section 13): the real engine under generated Poisson load, one point
per run: output tokens/s against TTFT and TPOT (p50 and p99), measured on this machine.

After vLLM's serving benchmark (benchmarks/benchmark_serving.py): requests arrive at exponential
inter-arrival times (app/lab/load.py, seeded), and the metrics are its TTFT, TPOT (first token
excluded), ITL and output throughput. Raising the arrival rate or the batch limit (`max_num_seqs`)
raises throughput until the engine saturates, and every step, now larger, makes each token slower.

Message: `throughput_latency` {rate, max_num_seqs, num_requests, run} -> a job, one point. It runs
on an engine of its own beside the serving one (`engine.sibling`), on a clock that advances only by
that engine's measured step times (and jumps ahead to the next arrival when the engine is idle),
so time spent serving other readers between slices is not counted: a request is added when the
clock passes its arrival time, one engine step per slice. Every request has the same prompt
length (PROMPT_TOKENS) and output length (OUTPUT_TOKENS, greedy, past the end-of-text token).
`run` is the reader's "measure again" counter: results are cached for every reader by all inputs.
"""

import time

from app.lab.load import RequestTiming, poisson_arrivals, serving_metrics
from core.engine.sampling_params import SamplingParams

from ..jobs import Progress
from .base import Widget, integer, message, number
from .seam import machine, remeasure

MAX_REQUESTS = 32
MAX_SEQS = 32
MIN_RATE, MAX_RATE = 0.5, 100.0      # requests per second
PROMPT_TOKENS = 24
OUTPUT_TOKENS = 12
STEP_TOKENS = 32                     # token budget of a step (a prompt and 8 decodes): short slices
SEED = 0
PASSAGE = ("A river starts as rain on the hills. It gathers in small streams that run down through the "
           "woods, join one another in the valleys, and grow into a wide, slow river that winds past farms "
           "and towns until it reaches the sea, where the water rises again as cloud and falls as rain.")


def throughput_latency(call) -> None:
    msg = call.msg
    rate = number(msg, "rate", MIN_RATE, MAX_RATE, default=4.0)
    seqs = integer(msg, "max_num_seqs", 1, MAX_SEQS, default=8)
    n = integer(msg, "num_requests", 2, MAX_REQUESTS, default=16)
    again = remeasure(msg)
    ids = call.tokenizer.encode(PASSAGE)
    prompts = [ids[i % 8: i % 8 + PROMPT_TOKENS] for i in range(n)]    # a few different prompts

    def work(engine):
        return (yield from measure(engine, rate, seqs, prompts))
    call.job({"rate": rate, "max_num_seqs": seqs, "num_requests": n, "remeasure": again}, work)


def measure(engine, rate: float, seqs: int, prompts: list[list[int]]):
    started = time.time()
    arrivals = poisson_arrivals(rate, len(prompts), seed=SEED)
    bs = engine.view.config.block_size
    blocks = len(prompts) * -(-(PROMPT_TOKENS + OUTPUT_TOKENS) // bs) + 2      # no preemption
    sibling = engine.sibling(max_num_seqs=seqs, num_kv_blocks=blocks, max_num_batched_tokens=STEP_TOKENS,
                         enable_prefix_caching=False, enable_chunked_prefill=True, scheduling="continuous",
                         trace_steps=16)
    timings, tokens = yield from drive(sibling, arrivals, prompts)
    metrics = serving_metrics(timings)
    return {
        "rate": rate, "max_num_seqs": seqs, "num_requests": len(prompts),
        "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "seed": SEED,
        "arrivals_s": [round(a, 6) for a in arrivals], "metrics": rounded(metrics),
        "throughput_tok_s": round(metrics["output_throughput_tok_s"], 3),
        "ttft_p50_ms": round(metrics["ttft"]["p50_ms"], 3), "ttft_p99_ms": round(metrics["ttft"]["p99_ms"], 3),
        "tpot_p50_ms": round(metrics["tpot"]["p50_ms"], 3), "tpot_p99_ms": round(metrics["tpot"]["p99_ms"], 3),
        "sample_token_ids": tokens, "steps": sibling.view.num_steps, "machine": machine(started),
    }


def drive(sibling, arrivals: list[float], prompts: list[list[int]]):
    """Add each request when the clock passes its arrival; one engine step per slice; the clock
    advances by each step's measured time. -> a RequestTiming per request, on that clock, and the
    first request's output token ids."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    timings = [RequestTiming(a) for a in arrivals]
    by_id, clock, added, first = {}, 0.0, 0, []
    while added < len(prompts) or sibling.has_unfinished_requests():
        while added < len(prompts) and arrivals[added] <= clock:
            by_id[sibling.add_request(prompts[added], params).request_id] = timings[added]
            added += 1
        if not sibling.has_unfinished_requests():
            clock = arrivals[added]                 # idle: jump to the next arrival
            continue
        t0 = time.perf_counter()
        outputs = sibling.step()
        clock += time.perf_counter() - t0
        for out in outputs:
            timing = by_id[out.request_id]
            timing.token_times += [clock] * (len(out.token_ids) - len(timing.token_times))
            if timing is timings[0]:
                first = list(out.token_ids)
        done = sum(len(t.token_times) == OUTPUT_TOKENS for t in timings)
        yield Progress(done, len(prompts), f"{added} of {len(prompts)} arrived, {done} finished, t = {clock:.2f} s")
    return timings, first


def rounded(metrics: dict) -> dict:
    """Every figure to the microsecond: seconds to 6 places, everything else (ms, tok/s) to 3, so
    that a rate recomputed from a short run's duration is what the reply says."""
    return {k: rounded(v) if isinstance(v, dict) else round(v, 6 if k.endswith("_s") else 3)
            if isinstance(v, float) else v for k, v in metrics.items()}


WIDGET = Widget("throughput-latency", messages=(
    message("throughput_latency", {"rate", "max_num_seqs", "num_requests", "run"}, throughput_latency, job=True),
))
