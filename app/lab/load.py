"""A load generator and the serving metrics, after vLLM's serving benchmark (benchmarks/benchmark_serving.py).

Arrivals: a Poisson process of `rate` requests per second, i.e. exponential inter-arrival times
with mean 1/rate, drawn from a seeded RNG (the same seed gives the same schedule). The first
request arrives at t = 0.

Metrics, as benchmark_serving defines them, from each request's arrival time and the times its
output tokens were ready (seconds on one clock):
- TTFT: first token time − arrival.
- TPOT: (last token time − first token time) / (output tokens − 1), the first token excluded;
  requests with a single output token have none.
- ITL: every gap between consecutive tokens of a request, all requests pooled.
- output throughput: all output tokens / duration; request throughput: requests / duration, where
  duration runs from the first arrival to the last token.
Percentiles interpolate linearly between order statistics (numpy.percentile's default).
"""

import math
import random
from dataclasses import dataclass, field

from core.engine.outputs import gaps, mean_gap


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """n arrival times (seconds, the first at 0) of a Poisson process of `rate` per second."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number, got {rate!r}")
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n must be a positive integer, got {n!r}")
    rng = random.Random(seed)
    times, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        times.append(t)
    return times


@dataclass
class RequestTiming:
    """One request as the clock saw it."""

    arrival: float
    token_times: list[float] = field(default_factory=list)   # when each output token was ready


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0..100), linear between order statistics; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary_ms(values: list[float]) -> dict:
    """Mean, median and p99 of seconds, in milliseconds."""
    if not values:
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
    return {"mean_ms": 1000 * sum(values) / len(values), "p50_ms": 1000 * percentile(values, 50),
            "p99_ms": 1000 * percentile(values, 99)}


def serving_metrics(requests: list[RequestTiming]) -> dict:
    """The benchmark's numbers for finished requests (each with at least one token)."""
    if not requests or any(not r.token_times for r in requests):
        raise ValueError("every request needs at least one output token")
    start = min(r.arrival for r in requests)
    end = max(r.token_times[-1] for r in requests)
    duration = end - start
    tokens = sum(len(r.token_times) for r in requests)
    return {
        "completed": len(requests), "output_tokens": tokens, "duration_s": duration,
        "output_throughput_tok_s": tokens / duration if duration > 0 else None,
        "request_throughput_rps": len(requests) / duration if duration > 0 else None,
        "ttft": summary_ms([r.token_times[0] - r.arrival for r in requests]),
        "tpot": summary_ms([t for r in requests if (t := mean_gap(r.token_times)) is not None]),
        "itl": summary_ms([gap for r in requests for gap in gaps(r.token_times)]),
    }
