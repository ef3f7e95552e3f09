"""Widget `throughput-latency` (section 13): the load generator's arrivals follow the requested rate
(on its own timestamps), the serving metrics of a made-up trace equal hand-computed values, and a
run on the engine reports numbers consistent with its own arrivals and tokens."""

import math

import pytest

from bounds import U64, decimal_half
from conftest import figure_value, shoot_widget, wait_ready
from app.lab.load import RequestTiming, percentile, poisson_arrivals, serving_metrics

TL = '[data-widget="throughput-latency"]'


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_arrivals_follow_the_requested_rate(rate):
    n = 2000
    times = poisson_arrivals(rate, n, seed=11)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and len(times) == n and all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    # exponential gaps: the mean of 1999 has standard deviation (1/rate)/sqrt(1999); allow 4 of them
    assert abs(mean - 1 / rate) < 4 * (1 / rate) / math.sqrt(len(gaps))
    # and they are exponential: P(gap < 1/rate) = 1 − 1/e, within 4 binomial standard deviations
    frac = sum(g < 1 / rate for g in gaps) / len(gaps)
    p = 1 - math.exp(-1)
    assert abs(frac - p) < 4 * math.sqrt(p * (1 - p) / len(gaps))
    assert poisson_arrivals(rate, n, seed=11) == times, "seeded"
    assert poisson_arrivals(rate, n, seed=12) != times


def test_arrivals_refuse_bad_arguments():
    for rate in (0, -1, float("nan"), float("inf"), "2"):
        with pytest.raises(ValueError, match="rate"):
            poisson_arrivals(rate, 10)
    with pytest.raises(ValueError, match="n"):
        poisson_arrivals(1.0, 0)


def test_metrics_of_a_made_up_trace_equal_hand_computed_values():
    a = RequestTiming(0.0, [0.5, 0.6, 0.8, 0.9])     # TTFT 0.5, gaps .1 .2 .1, TPOT .4/3
    b = RequestTiming(0.2, [1.2, 1.5])               # TTFT 1.0, gap .3, TPOT .3
    c = RequestTiming(1.0, [1.4])                    # TTFT 0.4, one token: no TPOT
    m = serving_metrics([a, b, c])
    # Both sides are float64 formulas of at most 16 roundings (decimal literals included), each of a
    # number at most 5 in seconds or tokens/s (at most 1,500 in ms), dividing only by 1.5, 2, 3 or 4 and
    # multiplying by 0.98, 0.99 or 1000: each side within 16 u x that scale of the exact value, absolute
    # (differences of the literals, such as 0.6 - 0.5, cancel: hence absolute, not relative)
    def near(x, scale):
        return pytest.approx(x, rel=0, abs=2 * 16 * U64 * scale)
    assert m["completed"] == 3 and m["output_tokens"] == 7
    assert m["duration_s"] == near(1.5, 5)                          # first arrival 0 to last token 1.5
    assert m["output_throughput_tok_s"] == near(7 / 1.5, 5)
    assert m["request_throughput_rps"] == near(3 / 1.5, 5)
    # TTFT: 0.5, 1.0, 0.4 -> sorted .4 .5 1.0: median .5; p99 = .5 + (1.0 − .5)·0.98
    assert m["ttft"]["mean_ms"] == near(1000 * 1.9 / 3, 1500)
    assert m["ttft"]["p50_ms"] == near(500, 1500)
    assert m["ttft"]["p99_ms"] == near(1000 * (0.5 + 0.5 * 0.98), 1500)
    # TPOT: .1333 and .3 -> median (.1333 + .3)/2; p99 = .1333 + (.3 − .1333)·0.99
    t1 = 0.4 / 3
    assert m["tpot"]["p50_ms"] == near(1000 * (t1 + 0.3) / 2, 1500)
    assert m["tpot"]["p99_ms"] == near(1000 * (t1 + (0.3 - t1) * 0.99), 1500)
    # ITL: .1 .2 .1 .3 -> sorted .1 .1 .2 .3: median .15, mean .175
    assert m["itl"]["p50_ms"] == near(150, 1500)
    assert m["itl"]["mean_ms"] == near(175, 1500)
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        serving_metrics([RequestTiming(0.0, [])])


def run_job(ws, **fields) -> dict:
    mid = ws.next_id()
    ws.send({"type": "throughput_latency", "id": mid, **fields})
    while True:
        m = ws.recv_for(mid, timeout=240)
        if m["type"] != "progress":
            return m
        assert 0 <= m["done"] <= m["total"] and m["note"]


def test_throughput_latency_refuses_bad_input_naming_the_field(ws):
    good = {"type": "throughput_latency", "id": "bad", "rate": 4, "max_num_seqs": 4, "num_requests": 4}
    cases = [
        ({"rate": 0}, "rate"), ({"rate": 101}, "rate"), ({"rate": "4"}, "rate"),
        ({"max_num_seqs": 0}, "max_num_seqs"), ({"max_num_seqs": 33}, "max_num_seqs"), ({"max_num_seqs": 1.5}, "max_num_seqs"),
        ({"num_requests": 1}, "num_requests"), ({"num_requests": 33}, "num_requests"),
        ({"run": -1}, "run"), ({"color": 1}, "color"),
    ]
    for change, param in cases:
        err = ws.error({**good, **change}, "bad")
        assert err["param"] == param, (change, err)
        assert param in err["message"] or param == "color", err
    assert run_job(ws, rate=8, max_num_seqs=2, num_requests=3)["type"] == "throughput_latency"   # still usable


def check_point(r, rate, seqs, n):
    assert (r["rate"], r["max_num_seqs"], r["num_requests"]) == (rate, seqs, n)
    # the same seeded schedule, each arrival rounded to 6 places by the server (plus the float64's own u)
    arrivals = poisson_arrivals(rate, n, seed=r["seed"])
    assert r["arrivals_s"] == pytest.approx(arrivals, rel=0, abs=decimal_half(6) + 2 * U64 * max(arrivals))
    m = r["metrics"]
    assert m["completed"] == n and m["output_tokens"] == n * r["output_tokens"]
    assert len(r["sample_token_ids"]) == r["output_tokens"]
    # the server rounds tokens / duration to 3 places, and the duration we divide by to 6 (h = half a unit,
    # plus u): tokens / duration_s is within rate x h / (duration - h) of tokens / duration, and our divide u
    d, tps = m["duration_s"], m["output_tokens"] / m["duration_s"]
    h = decimal_half(6) + 2 * U64 * d
    assert r["throughput_tok_s"] == pytest.approx(tps, rel=0, abs=decimal_half(3) + tps * h / (d - h) + 2 * U64 * tps)
    assert m["duration_s"] >= r["arrivals_s"][-1]                 # the run lasts past the last arrival
    assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    assert r["machine"]["threads"] >= 1 and r["machine"]["measured_at"]


def test_a_run_is_one_point_consistent_with_its_arrivals(ws):
    # The highest rate and the most requests: the seeded arrivals (slo.poisson_arrivals) then come
    # 1.1, 2.9 and 3.0 ms apart in places, shorter than a request's 12 steps take even on the tiny
    # model at its fastest, so that some overlap. (With 8 requests the closest two came 3.0 ms
    # apart, and on a fast day the tiny model served each in less: nothing overlapped.)
    r = run_job(ws, rate=100, max_num_seqs=4, num_requests=32, run=3)
    assert r["type"] == "throughput_latency", r
    check_point(r, 100, 4, 32)
    assert run_job(ws, rate=100, max_num_seqs=4, num_requests=32, run=3)["machine"] == r["machine"], "cached"
    one = run_job(ws, rate=100, max_num_seqs=1, num_requests=32, run=3)
    check_point(one, 100, 1, 32)
    # one at a time: every request needs its own prefill step and output − 1 decode steps
    assert one["steps"] >= 32 * one["output_tokens"]
    # four slots: requests that overlap share steps, so the same work takes fewer steps and the later
    # arrivals wait fewer of them (a count: a busy machine only makes them overlap more)
    assert r["steps"] < one["steps"], "one slot makes later arrivals wait longer"


@pytest.mark.real_model
def test_real_engine_point_and_its_tokens_are_transformers_greedy_tokens(real_ws, hf_reference, smollm_loaded):
    import torch
    from app.widgets.throughput_latency import PASSAGE, PROMPT_TOKENS
    hf_model, _ = hf_reference
    r = run_job(real_ws, rate=8, max_num_seqs=4, num_requests=6, run=1)
    assert r["type"] == "throughput_latency", r
    check_point(r, 8, 4, 6)
    ids = smollm_loaded.tokenizer.encode(PASSAGE)[:PROMPT_TOKENS]       # request 1's prompt
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=r["output_tokens"], do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    assert r["sample_token_ids"] == ref, "batched under load, the tokens are still the greedy ones"


@pytest.mark.browser
@pytest.mark.real_model
def test_throughput_latency_page(pg, artifacts_dir):
    query = "?rates=4,16&max_num_seqs=1,4&num_requests=6"
    shoot_widget(pg, "throughput-latency", artifacts_dir, query, ready_timeout=300_000)
    page = pg.page
    pg.goto(f"/embed/throughput-latency{query}")
    wait_ready(page, TL, timeout=300_000)
    assert page.input_value(f'{TL} input[name="rates"]') == "4,16"
    assert figure_value(page, "throughput_tok_s", TL) > 0
    assert figure_value(page, "tpot_p99_ms", TL) > 0
    assert figure_value(page, "ttft_p99_ms", TL) > 0
    assert page.locator(f"{TL} .tl-table tr").count() == 1 + 4
    assert "thread" in page.inner_text(f"{TL} .machine")
    pg.assert_clean()
