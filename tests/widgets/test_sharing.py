"""Widget `sharing` (sections 11 and 14): n samples share the prompt's blocks and copy the partial
one once per sample that diverges, the shared run holds fewer blocks than n separate requests,
beams fork and prune with their blocks, and a too-small pool preempts by recompute and by swap
with the same tokens. The engine-level properties are tested in tests/test_sharing.py."""

import pytest

from conftest import figure_value, on_a_phone, shoot_widget, wait_ready

SH = '[data-widget="sharing"]'


def test_sharing_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["sharing"].messages
    assert m.type == "sharing" and m.job and m.fields == {"scenario", "prompt", "n", "beam_width", "run"}


def run(ws, **fields) -> dict:
    """The job's reply, past its progress messages."""
    mid = ws.next_id()
    ws.send({"type": "sharing", "id": mid, **fields})
    while True:
        m = ws.recv_for(mid, timeout=180)
        if m["type"] != "progress":
            return m
        assert 0 <= m["done"] and m["note"]


def test_sharing_refuses_bad_input_naming_the_field(ws):
    for change, param in [({"scenario": "fork"}, "scenario"), ({"n": 1}, "n"), ({"n": 9}, "n"),
                          ({"beam_width": 5}, "beam_width"), ({"prompt": ""}, "prompt"),
                          ({"prompt": "word " * 200}, "prompt"), ({"run": -1}, "run"), ({"color": 1}, "color")]:
        err = ws.error({"type": "sharing", "id": "bad", **change}, "bad")
        assert err["param"] == param, (change, err)


def test_n_samples_share_blocks_and_save_against_separate_requests(ws):
    r = run(ws, scenario="samples", prompt="Name a colour:", n=4)
    assert r["type"] == "sharing", r
    bs, p = r["block_size"], r["prompt_tokens"]
    first = r["steps"][0]                     # the prompt's step: every sample on the same blocks
    assert len(first["tables"]) == 4 and len({tuple(t["blocks"]) for t in first["tables"]}) == 1
    assert all(t["refs"] == [4] * -(-p // bs) for t in first["tables"])
    # a partial last prompt block is copied by every sample but the last writer, once
    assert r["copies"] == (3 if p % bs else 0)
    assert sum(s["copied"] for s in r["steps"]) == r["copies"]
    assert r["peak_blocks_shared"] < r["peak_blocks_separate"]
    assert r["blocks_saved"] == r["peak_blocks_separate"] - r["peak_blocks_shared"]
    assert [s["index"] for s in r["samples"]] == [0, 1, 2, 3]


def test_beams_fork_and_prune_with_their_blocks(ws):
    r = run(ws, scenario="beams", prompt="Name a colour:", beam_width=3)
    assert r["type"] == "sharing", r
    assert len(r["best"]) == 3
    for s in r["steps"][:-1]:
        assert len(s["beams"]) == 3 and len(s["tables"]) == 3
        refs = {}
        for t in s["tables"]:
            for b, c in zip(t["blocks"], t["refs"]):
                refs[b] = c
        held = [b for t in s["tables"] for b in t["blocks"]]
        assert all(refs[b] == held.count(b) for b in refs), "reference counts match the tables"
    assert r["steps"][-1]["tables"] == []     # done: every block back


def test_a_small_pool_preempts_by_recompute_and_by_swap_with_the_same_tokens(ws):
    r = run(ws, scenario="preemption")
    assert r["type"] == "sharing", r
    rec, swap = r["runs"]["recompute"], r["runs"]["swap"]
    assert r["same_tokens"] is True
    assert rec["preemptions"] > 0 and rec["recomputed_tokens"] > 0 and rec["blocks_swapped"] == 0
    assert swap["preemptions"] > 0 and swap["blocks_swapped"] > 0
    assert swap["swap_bytes"] > 0 and swap["host_link_ms"] == pytest.approx(
        1e3 * swap["swap_bytes"] / (r["host_link"]["gb_s"] * 1e9), rel=1e-2)
    assert max(s["used"] for s in swap["steps"]) <= r["pool_blocks"]
    assert sum(len(s["swapped_out"]) for s in swap["steps"]) == sum(len(s["swapped_in"]) for s in swap["steps"])


@pytest.mark.browser
@pytest.mark.real_model
def test_sharing_page(pg, artifacts_dir):
    shoot_widget(pg, "sharing", artifacts_dir, "?n=4", ready_timeout=180_000)
    page = pg.page
    pg.goto("/embed/sharing?n=4")
    wait_ready(page, SH, timeout=180_000)
    assert figure_value(page, "blocks_saved", SH) == figure_value(page, "peak_blocks_separate", SH) - figure_value(
        page, "peak_blocks_shared", SH) > 0
    assert figure_value(page, "copies", SH) == 3     # the default prompt's 7 tokens leave a partial block
    assert page.locator(f"{SH} .sh-block.is-shared").count() > 0
    page.select_option(f'{SH} select[name="scenario"]', "preemption")
    page.wait_for_function(f"""() => document.querySelector('{SH} [data-figure="same_tokens"]').dataset.value === "1" """,
                           timeout=180_000)
    assert figure_value(page, "host_link_ms", SH) > 0
    assert figure_value(page, "swap_ms", SH) > 0 and figure_value(page, "recompute_ms", SH) > 0
    page.screenshot(path=str(artifacts_dir / "sharing-preemption-1280.png"))
    on_a_phone(pg, "sharing", "?sharing.scenario=beams", artifacts_dir, ready_timeout=180_000)
    pg.assert_clean()
