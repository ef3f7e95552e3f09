"""Widget `slo` (section 21): goodput against throughput as the batch limit and admission control change.

No test asserts a speed (the machine is shared). They check what holds by construction: goodput
never exceeds throughput (in every run of a job on the tiny model, and on made-up records), a
request rejected by admission control counts in neither completed nor goodput, the arrival
generator follows the requested rate, and the served tokens are transformers' greedy tokens.
"""

import math
import statistics

import pytest

from app.widgets import slo as slo_widget
from conftest import figure_value, shoot_widget, wait_ready

SLO = '[data-widget="slo"]'


def record(arrival, first=None, finished=None, tokens=0, rejected=False) -> dict:
    return {"arrival_s": arrival, "rejected": rejected, "first_token_s": first, "finished_s": finished,
            "output_tokens": tokens}


def test_slo_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["slo"].messages
    assert m.type == "slo" and m.job
    assert m.fields == {"rate", "requests", "seed", "batch_limits", "max_waiting", "ttft_ms", "tpot_ms", "run"}


def test_goodput_counts_only_completed_requests_within_the_objective():
    records = [
        record(0.0, 0.1, 0.5, 5),                   # TTFT 100 ms, TPOT 100 ms: meets 200/150
        record(0.2, 0.6, 1.0, 5),                   # TTFT 400 ms: misses
        record(0.3, 0.4, 1.2, 3),                   # TPOT 400 ms: misses
        record(0.4, 0.5, 0.5, 1),                   # one token: TPOT 0, meets
        record(0.5, rejected=True),                 # turned away at arrival
        record(0.6, 0.7),                           # started, not finished
    ]
    s = slo_widget.summarize(records, 2.0, ttft_ms=200.0, tpot_ms=150.0)
    assert s["completed"] == 4 and s["good"] == 2 and s["rejected"] == 1
    # whole counts over a span of 2.0 s: float64 divisions with exact results
    assert s["throughput_rps"] == 2.0 and s["goodput_rps"] == 1.0
    assert s["output_tok_s"] == 7.0 and s["good_tok_s"] == 3.0
    assert s["goodput_rps"] <= s["throughput_rps"]
    assert [r.get("met") for r in records] == [True, False, False, True, None, None]
    # a difference of two float64 times (off by an ulp of 1 s, 2e-13 ms) rounded to 3 places: within
    # half a unit of the third place
    half = 0.5e-3 * (1 + 1e-9)
    assert records[1]["ttft_ms"] == pytest.approx(400.0, abs=half) and records[2]["tpot_ms"] == pytest.approx(400.0, abs=half)


def test_goodput_never_exceeds_throughput_on_random_records():
    import random
    rng = random.Random(5)
    for _ in range(200):
        records = []
        for i in range(rng.randint(1, 32)):
            arrival = rng.uniform(0, 5)
            if rng.random() < 0.2:
                records.append(record(arrival, rejected=True))
                continue
            first = arrival + rng.uniform(0, 2)
            n = rng.randint(1, 16)
            records.append(record(arrival, first, first + rng.uniform(0, 2) * (n > 1), n))
        s = slo_widget.summarize(records, max(r["finished_s"] or r["arrival_s"] for r in records),
                                 rng.uniform(1, 2000), rng.uniform(1, 500))
        assert s["goodput_rps"] <= s["throughput_rps"] and s["good_tok_s"] <= s["output_tok_s"]
        assert s["completed"] + s["rejected"] == len(records)


def test_a_rejected_request_counts_nowhere_even_with_its_times_set():
    # a rejected record that (wrongly) carried times must still count in neither total
    records = [record(0.0, 0.1, 0.2, 2), {**record(0.1, 0.15, 0.3, 2), "rejected": True}]
    s = slo_widget.summarize(records, 1.0, 1000.0, 1000.0)
    assert s["completed"] == 1 and s["good"] == 1 and s["rejected"] == 1


def test_arrivals_follow_the_requested_rate():
    for rate in (0.5, 4.0, 50.0):
        times = slo_widget.poisson_arrivals(rate, 4000, seed=3)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert times[0] == 0.0 and all(g >= 0 for g in gaps)
        # exponential gaps: mean 1/rate, standard deviation 1/rate; the sample mean of n gaps lies
        # within 4 standard errors (1/rate/sqrt(n)) of 1/rate
        assert abs(statistics.fmean(gaps) - 1 / rate) < 4 / rate / math.sqrt(len(gaps))
        # the sample standard deviation of n exponential gaps: relative standard error
        # sqrt((kurtosis - 1) / (4 n)) (delta method), kurtosis 9 for an exponential; within 4 of those
        assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=4 * math.sqrt(8 / (4 * len(gaps))))
    assert slo_widget.poisson_arrivals(4.0, 10, 1) == slo_widget.poisson_arrivals(4.0, 10, 1)   # seeded
    assert slo_widget.poisson_arrivals(4.0, 10, 1) != slo_widget.poisson_arrivals(4.0, 10, 2)


def test_slo_refuses_bad_input_naming_the_field(ws):
    for fields, param in [
        ({"rate": 0}, "rate"), ({"rate": "fast"}, "rate"), ({"rate": 1e6}, "rate"),
        ({"requests": 3}, "requests"), ({"requests": 33}, "requests"), ({"requests": 8.5}, "requests"),
        ({"batch_limits": []}, "batch_limits"), ({"batch_limits": [1, 2, 4, 8]}, "batch_limits"),
        ({"batch_limits": [0]}, "batch_limits"), ({"batch_limits": [17]}, "batch_limits"),
        ({"batch_limits": [2, 2]}, "batch_limits"), ({"batch_limits": "4"}, "batch_limits"),
        ({"batch_limits": [True]}, "batch_limits"),
        ({"max_waiting": 0}, "max_waiting"), ({"max_waiting": 33}, "max_waiting"),
        ({"ttft_ms": 0}, "ttft_ms"), ({"tpot_ms": "fast"}, "tpot_ms"),
        ({"seed": -1}, "seed"), ({"run": -1}, "run"),
    ]:
        err = ws.error({"type": "slo", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
        assert param in err["message"]
    r = ws.job("slo", timeout=180, requests=4, batch_limits=[1])                 # the connection is still usable
    assert r["type"] == "slo", r


def check_job(r, inputs: dict) -> None:
    runs = r["runs"]
    assert [(x["max_num_seqs"], x["max_waiting"]) for x in runs] == [
        (b, cap) for b in sorted(inputs["batch_limits"]) for cap in (None, inputs["max_waiting"])]
    for run in runs:
        reqs = run["requests"]
        assert len(reqs) == inputs["requests"]
        assert run["goodput_rps"] <= run["throughput_rps"]
        assert run["good_tok_s"] <= run["output_tok_s"]
        assert run["completed"] + run["rejected"] == inputs["requests"]      # every request ends one way
        assert run["good"] == sum(q.get("met", False) for q in reqs)
        for q in reqs:
            if q["rejected"]:
                # rejected: never served, so in neither completed nor goodput
                assert q["first_token_s"] is None and q["finished_s"] is None and "met" not in q
            else:
                # times on one virtual clock that only moves forward, the run's duration its last reading
                assert q["arrival_s"] <= q["first_token_s"] <= q["finished_s"] <= run["duration_s"]
                assert q["output_tokens"] == len(q["token_ids"])
        if run["max_waiting"] is None:
            assert run["rejected"] == 0
        duration = run["duration_s"]
        assert run["throughput_rps"] == run["completed"] / duration        # the widget's own float64 expression
    assert r["goodput_rps"] == max(x["goodput_rps"] for x in runs)
    assert r["best_max_num_seqs"] == runs[r["best_by_goodput"]]["max_num_seqs"]
    assert runs[r["best_by_throughput"]]["output_tok_s"] == max(x["output_tok_s"] for x in runs)
    assert r["machine"]["threads"] >= 1 and r["machine"]["measured_at"]


def test_slo_job_on_the_tiny_model(ws):
    inputs = {"rate": 50.0, "requests": 12, "seed": 1, "batch_limits": [1, 4], "max_waiting": 1,
              "ttft_ms": 50.0, "tpot_ms": 20.0, "run": 3}
    r = ws.job("slo", timeout=180, **inputs)
    assert r["type"] == "slo", r
    check_job(r, inputs)
    # at 50 requests/s into a batch of 1, the queue grows past one waiting: admission turns some away
    assert next(x for x in r["runs"] if x["max_num_seqs"] == 1 and x["max_waiting"] == 1)["rejected"] > 0
    # every run serves the same seeded workload: the admitted requests' answers are the same
    answers = {}
    for run in r["runs"]:
        for i, q in enumerate(run["requests"]):
            if not q["rejected"]:
                assert answers.setdefault(i, q["token_ids"]) == q["token_ids"]
    assert ws.job("slo", timeout=180, **inputs)["machine"] == r["machine"], "the same inputs come from the job cache"


@pytest.mark.real_model
def test_served_tokens_are_the_requests_own_greedy_tokens(real_ws, smollm_served):
    """Batched and queued as the scheduler pleased, each request gets exactly the greedy tokens it
    gets alone in the same weight format (batch invariance). That those are transformers' greedy
    tokens wherever its choice is clear of the format's bounds is test_parity's to check."""
    from core import SamplingParams

    fmt = real_ws.hello["weight_format"]
    assert fmt == smollm_served.engine.config.weight_format.value
    inputs = {"rate": 8.0, "requests": 6, "seed": 2, "batch_limits": [4], "max_waiting": 2,
              "ttft_ms": 2000.0, "tpot_ms": 500.0, "run": 1}
    r = real_ws.job("slo", timeout=180, **inputs)
    assert r["type"] == "slo", r
    check_job(r, inputs)
    source = smollm_served.engine.tokenizer.encode(slo_widget.SOURCE)
    requests = slo_widget.workload(r["inputs"], source)
    assert [q["arrival_s"] for q in requests] == r["arrivals_s"]
    run = r["runs"][0]
    assert len(run["requests"]) == len(requests) == 6
    for q, req in zip(run["requests"], requests):
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
        (alone,) = smollm_served.generate([list(req["prompt"])], params)
        assert q["token_ids"] == alone.token_ids


@pytest.mark.browser
@pytest.mark.real_model
def test_slo_page(pg, artifacts_dir):
    query = "?rate=4&requests=12&batch=2,8&waiting=2"
    shoot_widget(pg, "slo", artifacts_dir, query, ready_timeout=300_000)
    page = pg.page
    pg.goto(f"/embed/slo{query}")
    wait_ready(page, SLO, timeout=300_000)
    assert page.input_value(f'{SLO} input[name="rate"]') == "4"
    goodput = figure_value(page, "goodput_rps", SLO)
    assert goodput >= 0
    assert figure_value(page, "best_max_num_seqs", SLO) in (2, 8)
    rows = page.locator(f"{SLO} .slo-tr.slo-run")
    assert rows.count() == 4
    for i in range(4):
        assert float(rows.nth(i).get_attribute("data-goodput")) <= float(rows.nth(i).get_attribute("data-throughput"))
    assert "thread" in page.inner_text(f"{SLO} .slo-machine")
    pg.assert_clean()
