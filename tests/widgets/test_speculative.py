"""Widget `speculative` (section 20): bad input names its field; the job's passes add up to its
counters and its output; both drafts give plain decoding's tokens for every k; the page shows
every figure badged and keyed, in an embed, an iframe and on a phone."""

from urllib.parse import quote_plus

import pytest

from conftest import figure_value, on_a_phone, shoot_widget, wait_ready

SP = '[data-widget="speculative"]'
LIST = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
TEXT_Q = quote_plus(LIST)
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


def test_speculative_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["speculative"].messages
    assert m.type == "speculative" and m.job and m.fields == {"draft", "k", "text", "run"}


def measure(ws, **fields) -> dict:
    """The job's reply, past its progress messages."""
    mid = ws.next_id()
    ws.send({"type": "speculative", "id": mid, **fields})
    while True:
        m = ws.recv_for(mid, timeout=300)
        if m["type"] != "progress":
            return m
        assert 0 <= m["done"] <= m["total"] and m["note"]


def test_speculative_refuses_bad_input_naming_the_field(ws):
    good = {"type": "speculative", "id": "bad", "text": CODE}
    cases = [({"draft": "medusa"}, "draft"), ({"draft": 1}, "draft"), ({"k": 0}, "k"), ({"k": 9}, "k"),
             ({"k": "4"}, "k"), ({"text": ""}, "text"), ({"text": None}, "text"), ({"text": "word " * 100}, "text"),
             ({"run": -1}, "run"), ({"color": 1}, "color")]
    for change, param in cases:
        msg = {k: v for k, v in {**good, **change}.items() if v is not None}
        err = ws.error(msg, "bad")
        assert err["param"] == param, (change, err)


def check_reply(r):
    assert r["type"] == "speculative", r
    stats_tokens = sum(p["accepted"] + 1 for p in r["passes"])
    assert stats_tokens == r["generated_tokens"] - 1 == len(r["tokens"]) - 1   # the first comes from the prefill
    assert r["tokens_per_pass"] == pytest.approx(stats_tokens / len(r["passes"]), rel=1e-12)
    proposed = sum(len(p["proposed"]) for p in r["passes"])
    kept = sum(p["accepted"] for p in r["passes"])
    assert r["proposed_per_position"] and sum(r["proposed_per_position"]) == proposed
    assert r["acceptance_rate"] == (pytest.approx(kept / proposed, rel=1e-12) if proposed else None)
    assert all(0 <= p["accepted"] <= len(p["proposed"]) <= r["k"] for p in r["passes"])
    assert r["same_as_plain"] == 1
    for draft in ("ngram", "self"):
        sweep = r["sweep"][draft]
        assert [row["k"] for row in sweep] == list(range(1, 9))
        assert all(row["same_as_plain"] == 1 and row["speedup"] > 0 for row in sweep)
    chosen = r["sweep"][r["draft"]][r["k"] - 1]
    # the tiles are the sweep's own row for the chosen draft and k: one measurement, one number
    assert {key: r[key] for key in chosen} == chosen
    assert r["machine"]["threads"] >= 1 and r["machine"]["measured_at"]


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_the_job_reports_passes_counters_and_the_sweep(ws, draft):
    r = measure(ws, text=CODE, draft=draft, k=3, run=1)
    check_reply(r)
    assert r["draft"] == draft and r["k"] == 3


@pytest.mark.browser
@pytest.mark.real_model
def test_speculative_page(pg, artifacts_dir):
    query = "?draft=ngram&k=4&text=" + TEXT_Q
    shoot_widget(pg, "speculative", artifacts_dir, query, ready_timeout=300_000)
    page = pg.page
    pg.goto(f"/embed/speculative{query}")
    wait_ready(page, SP, timeout=300_000)
    assert page.input_value(f'{SP} textarea[name="text"]') == LIST
    assert figure_value(page, "same_as_plain", SP) == 1
    rate = figure_value(page, "acceptance_rate", SP)
    assert 0 <= rate <= 1
    assert figure_value(page, "tokens_per_pass", SP) >= 1
    assert figure_value(page, "speedup", SP) > 0
    assert page.locator(f"{SP} .sp-pass").count() >= 1
    assert page.locator(f"{SP} .sp-tr:not(.sp-th)").count() == 8
    for key in ("acceptance_rate", "tokens_per_pass", "speedup", "same_as_plain"):
        assert page.locator(f'{SP} [data-figure="{key}"]').count() == 1
        assert page.locator(f'{SP} figure:has([data-figure="{key}"]) .badge').count() >= 1, f"{key} has no badge"
    # the sweep's bars share one scale: each track spans its column, whatever its label's length
    tracks = page.eval_on_selector_all(f"{SP} .sp-tr:not(.sp-th) .sp-bar", "bars => bars.map(b => b.getBoundingClientRect().width)")
    # equal grid columns: the same width up to the layout's sub-pixel rounding (well under a pixel)
    assert len(tracks) == 16 and max(tracks) - min(tracks) <= 1, tracks
    pg.assert_clean()
    # the same inputs: the job cache answers
    snippet = on_a_phone(pg, "speculative", f"?speculative.draft=ngram&speculative.k=4&speculative.text={TEXT_Q}",
                         artifacts_dir, ready_timeout=300_000)
    assert f"text={TEXT_Q}" in snippet          # draft and k are the defaults: left out
