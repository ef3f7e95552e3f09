"""Widget `batching` (section 14): for the same workload and the same greedy tokens, continuous
batching takes fewer steps and leaves fewer idle slots than static batching; the grid is the
engine's own trace; the tokens are the serving engine's own greedy tokens, and transformers' where
its choice is clear of the weight format's bound."""

import pytest

from bounds import U64, decimal_half, gamma
from conftest import figure_value, shoot_widget, wait_ready
from greedy_steps import check_engine_is_the_model

BT = '[data-widget="batching"]'
WORKLOAD = [[12, 4], [40, 16], [8, 8], [24, 2], [16, 12], [30, 6]]


def run_job(ws, **fields) -> dict:
    mid = ws.next_id()
    ws.send({"type": "batching", "id": mid, **fields})
    while True:
        m = ws.recv_for(mid, timeout=180)
        if m["type"] != "progress":
            return m
        assert 0 <= m["done"] <= m["total"] and m["note"]


def test_batching_refuses_bad_input_naming_the_field(ws):
    good = {"type": "batching", "id": "bad", "requests": WORKLOAD, "slots": 3}
    cases = [
        ({"requests": None}, "requests"), ({"requests": []}, "requests"), ({"requests": [[1, 1]] * 9}, "requests"),
        ({"requests": [[65, 1]]}, "requests"), ({"requests": [[4, 33]]}, "requests"), ({"requests": [[0, 3]]}, "requests"),
        ({"requests": [[4]]}, "requests"), ({"requests": [["4", 2]]}, "requests"), ({"requests": "12:4"}, "requests"),
        ({"slots": 0}, "slots"), ({"slots": 9}, "slots"), ({"slots": 2.5}, "slots"),
        ({"run": -1}, "run"), ({"color": 1}, "color"),
    ]
    for change, param in cases:
        msg = {k: v for k, v in {**good, **change}.items() if v is not None}
        err = ws.error(msg, "bad")
        assert err["param"] == param, (change, err)
        assert param in err["message"] or param == "color", err
    assert run_job(ws, requests=[[4, 2]], slots=1)["type"] == "batching"     # still usable


def check_run(run: dict, workload, slots: int) -> None:
    """The trace is the workload's: one P per request, D2..Dn after it, counts that add up."""
    assert run["steps"] == len(run["trace"])
    for row in run["trace"]:
        assert len(row["cells"]) == slots
    busy = 0
    for i, (prompt, out) in enumerate(workload):
        labels = [c["label"] for row in run["trace"] for c in row["cells"] if c and c["request"] == i and c["kind"] != "idle"]
        chunks = [c["tokens"] for row in run["trace"] for c in row["cells"] if c and c["request"] == i and c["kind"] == "prefill"]
        assert sum(chunks) == prompt and all(0 < n <= 64 for n in chunks)   # the prompt, in chunks of the step budget
        assert labels == ["P"] * len(chunks) + [f"D{n}" for n in range(2, out + 1)], (i, labels)
        busy += len(chunks) + out - 1            # its prefill steps (the last makes token 1), then out − 1 decodes
    assert run["busy_slots"] == busy
    assert run["idle_slots"] == run["steps"] * slots - busy
    assert [len(q["token_ids"]) for q in run["requests"]] == [out for _, out in workload]
    # the server rounds each step's ms and the total (its float64 sum of the seconds, x 1000) to 3 places:
    # steps + 1 half-units; the float64 sums of `steps` positive terms there and here, and the x 1000s,
    # within gamma_{steps + 2} of the total each
    n = run["steps"]
    assert run["total_ms"] == pytest.approx(sum(r["ms"] for r in run["trace"]), rel=0,
                                            abs=decimal_half(3) * (n + 1) + 2 * gamma(n + 2, U64) * run["total_ms"])


def check_reply(r, workload, slots):
    check_run(r["static"], workload, slots)
    check_run(r["continuous"], workload, slots)
    assert r["same_tokens"]
    assert [q["token_ids"] for q in r["static"]["requests"]] == [q["token_ids"] for q in r["continuous"]["requests"]]
    assert r["static_steps"] == r["static"]["steps"] and r["continuous_steps"] == r["continuous"]["steps"]
    assert r["static_idle_slots"] == r["static"]["idle_slots"]
    assert r["continuous_idle_slots"] == r["continuous"]["idle_slots"]
    assert r["continuous_steps"] < r["static_steps"]
    assert r["continuous_idle_slots"] < r["static_idle_slots"]


def test_continuous_takes_fewer_steps_and_idle_slots_for_the_same_tokens(ws):
    r = run_job(ws, requests=WORKLOAD, slots=3, run=5)
    assert r["type"] == "batching", r
    check_reply(r, WORKLOAD, 3)
    # static: batches of 3 in order, each as long as its longest member (its prompt step + its decodes;
    # the second batch's 70 prompt tokens take two steps of 64, while its other members decode)
    assert r["static_steps"] == max(4, 16, 8) + max(2, 12, 6)
    assert r["machine"]["threads"] >= 1 and r["machine"]["measured_at"]
    assert run_job(ws, requests=WORKLOAD, slots=3, run=5)["machine"] == r["machine"], "cached"


def test_one_slot_makes_both_the_same(ws):
    workload = [[8, 3], [5, 2]]
    r = run_job(ws, requests=workload, slots=1)
    assert r["static_steps"] == r["continuous_steps"] == 5
    assert r["static_idle_slots"] == r["continuous_idle_slots"] == 0


@pytest.mark.real_model
def test_tokens_are_the_engines_and_the_models(real_ws, hf_reference, logit_bounds, smollm_served, smollm,
                                               smollm_loaded):
    """Static and continuous give the same tokens (exact), the serving engine's own greedy tokens
    (exact), and transformers' wherever its choice is clear of the format's bound; our engine in
    fp32 gives transformers' on the same prompts (tests/greedy_steps.py)."""
    from app.widgets.batching import prompt_ids
    hf_model, _ = hf_reference
    workload = [[12, 6], [20, 3], [9, 5]]
    r = run_job(real_ws, requests=workload, slots=2, run=1)
    assert r["type"] == "batching", r
    check_reply(r, workload, 2)
    tokens = [q["token_ids"] for q in r["continuous"]["requests"]]
    check_engine_is_the_model(hf_model, logit_bounds, smollm_served, smollm,
                              prompt_ids(smollm_loaded.tokenizer, workload), tokens)


@pytest.mark.browser
@pytest.mark.real_model
def test_batching_page(pg, artifacts_dir):
    query = "?workload=12:4,40:16,8:8,24:2,16:12,30:6&slots=3"
    shoot_widget(pg, "batching", artifacts_dir, query, ready_timeout=180_000)
    page = pg.page
    pg.goto(f"/embed/batching{query}")
    wait_ready(page, BT, timeout=180_000)
    assert page.input_value(f'{BT} input[name="workload"]') == "12:4,40:16,8:8,24:2,16:12,30:6"
    static, cont = figure_value(page, "static_steps", BT), figure_value(page, "continuous_steps", BT)
    assert cont < static == 28
    assert figure_value(page, "continuous_idle_slots", BT) < figure_value(page, "static_idle_slots", BT)
    assert figure_value(page, "static_total_ms", BT) > 0 and figure_value(page, "continuous_total_ms", BT) > 0
    assert page.locator(f"{BT} .bt-row").count() == static + cont + 2       # rows plus the two headers
    assert "thread" in page.inner_text(f"{BT} .machine")
    pg.assert_clean()
