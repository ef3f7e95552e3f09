"""Widget `paging` (section 11): the live engine's block tables, free blocks as /healthz counts
them, blocks shared by a common prefix, and every block back when the requests end."""

import json
import time
import urllib.request

import pytest

from conftest import WS, figure_value, healthz, shoot_widget, wait_for, wait_ready

PAGING = '[data-widget="paging"]'
SYSTEM = ("You are a patient tutor. Explain one idea at a time with an everyday example, keep answers short, "
          "and say what every technical word means before you use it.")


def test_paging_registers_one_message_that_is_not_a_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["paging"].messages
    assert m.type == "paging" and not m.job and m.fields == frozenset()


def test_paging_refuses_fields_it_does_not_take(ws):
    err = ws.error({"type": "paging", "id": "bad", "request": 1}, "bad")
    assert err["param"] == "request", err
    assert ws.call("paging")["type"] == "paging"       # the connection is still usable


def test_idle_snapshot_matches_healthz(ws, live_server):
    wait_for(lambda: healthz(live_server)["running"] == 0, what="an idle engine")
    s = ws.call("paging")
    kv = healthz(live_server)["kv"]
    assert s["free_blocks"] == kv["free_blocks"] == kv["total_blocks"] == s["total_blocks"]
    assert s["requests"] == [] and s["shared_blocks"] == 0 and set(s["ref_counts"]) == {0}
    assert s["naive_waste_fraction"] is None
    assert s["cached_free_blocks"] == len(s["cached_block_ids"]) == kv["cached_blocks"]


def step_until(engine, predicate, limit=200):
    for _ in range(limit):
        if predicate():
            return
        engine.step()
    raise AssertionError("the engine never got there")


def test_summary_of_requests_sharing_a_prefix(make_tiny_engine, assert_pool_clean):
    """Step an engine by hand: the second request takes the first one's full prompt blocks."""
    from app.widgets.paging import snapshot
    from core import SamplingParams

    engine = make_tiny_engine(num_kv_blocks=64, max_num_batched_tokens=512)
    window = engine.max_model_len
    prefix = list(range(10, 10 + 40))                           # 2 full blocks of 16, and 8 more
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    first = engine.add_request(prefix + [100, 101], params)
    step_until(engine, lambda: first.num_output_tokens > 0)    # its prompt blocks are published
    second = engine.add_request(prefix + [200, 201, 202], params)
    step_until(engine, lambda: second.num_output_tokens > 0)
    s = snapshot(engine, window)
    tables = {r["request_id"]: r for r in s["requests"]}
    a, b = tables[first.request_id], tables[second.request_id]
    assert a["blocks"][:2] == b["blocks"][:2], "the two full prefix blocks are the same physical blocks"
    assert a["ref_counts"][:2] == b["ref_counts"][:2] == [2, 2]
    assert b["num_cached_tokens"] == 32
    assert not a["yours"] and not b["yours"]
    assert s["shared_blocks"] == 2 and s["shared_refs"] == 4
    held = set(a["blocks"]) | set(b["blocks"])
    assert s["free_blocks"] == s["total_blocks"] - len(held)
    assert s["paged_slots"] == 16 * len(held)
    tokens = first.num_computed_tokens + second.num_computed_tokens   # K and V in the pool
    assert tokens == first.num_tokens + second.num_tokens - 2          # each newest token is not yet computed
    assert s["tokens"] == tokens
    assert s["naive_reserved_slots"] == 2 * window
    assert s["naive_waste_fraction"] == 1 - tokens / (2 * window)     # the server's expression on the same integers: exact
    assert s["paged_empty_slots"] == sum(16 * len(r["blocks"]) - r["num_computed_tokens"] for r in (a, b))
    assert all(r["empty_slots"] >= 0 for r in (a, b))
    while engine.has_unfinished_requests():
        engine.step()
    s = snapshot(engine, window)
    assert s["free_blocks"] == s["total_blocks"] and s["requests"] == []
    assert s["cached_free_blocks"] > 0                         # free, yet they keep the prefix
    assert_pool_clean(engine)


@pytest.mark.real_model
def test_free_blocks_drop_while_a_request_runs(real_ws, server):
    def health():
        with urllib.request.urlopen(server.base + "/healthz", timeout=10) as resp:
            return json.load(resp)
    wait_for(lambda: health()["running"] == 0, timeout=60, what="an idle engine")
    idle = real_ws.call("paging")
    assert idle["free_blocks"] == health()["kv"]["free_blocks"] == idle["total_blocks"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a volcano?"}]
    first = real_ws.start(messages=messages, max_tokens=40)
    real_ws.accepted(first)
    while real_ws.recv_for(first)["type"] != "token":          # its prompt blocks are written
        pass
    second = real_ws.start(messages=[messages[0], {"role": "user", "content": "Why is the sea salty?"}], max_tokens=40)
    busy, deadline = None, time.monotonic() + 60
    while time.monotonic() < deadline:
        s = real_ws.call("paging")
        if len(s["requests"]) == 2:
            busy = s
            break
    assert busy is not None, "never saw both requests running"
    assert busy["free_blocks"] < idle["free_blocks"]
    assert busy["free_blocks"] == busy["total_blocks"] - len({b for r in busy["requests"] for b in r["blocks"]})
    assert busy["shared_blocks"] > 0
    assert all(r["yours"] for r in busy["requests"]), "both were sent on this connection"
    other = WS(f"ws://127.0.0.1:{server.port}/ws")       # another reader sees them, not as its own
    try:
        seen = other.call("paging")["requests"]
        assert seen and not any(r["yours"] for r in seen)
    finally:
        other.close()
    assert figure_keys_present(busy)
    for mid in (first, second):
        while real_ws.recv_for(mid, timeout=120)["type"] not in ("done", "error"):
            pass
    wait_for(lambda: health()["running"] == 0, timeout=60, what="the requests to end")
    after = real_ws.call("paging")
    assert after["free_blocks"] == after["total_blocks"] == health()["kv"]["free_blocks"]   # every block back


def figure_keys_present(s) -> bool:
    return all(k in s for k in ("free_blocks", "total_blocks", "shared_blocks", "cached_free_blocks",
                                "naive_waste_fraction", "paged_waste_fraction"))


@pytest.mark.browser
@pytest.mark.real_model
def test_paging_page_shows_shared_blocks_and_gives_them_back(pg, server, artifacts_dir):
    shoot_widget(pg, "paging", artifacts_dir)
    page = pg.page
    page.set_viewport_size({"width": 1280, "height": 800})
    pg.goto("/embed/paging?demo=3")
    wait_ready(page, PAGING)
    wait_for(lambda: figure_value(page, "free_blocks", PAGING) == figure_value(page, "total_blocks", PAGING),
             timeout=60, what="an idle pool")
    with urllib.request.urlopen(server.base + "/healthz", timeout=10) as resp:
        assert figure_value(page, "free_blocks", PAGING) == json.load(resp)["kv"]["free_blocks"]
    total = figure_value(page, "total_blocks", PAGING)
    page.click(f"{PAGING} button.pg-demo")
    page.wait_for_function(
        """() => Number(document.querySelector('[data-figure="shared_blocks"]').dataset.value) > 0""", timeout=60_000)
    assert figure_value(page, "free_blocks", PAGING) < total
    assert 0 < figure_value(page, "naive_waste_fraction", PAGING) < 1
    assert figure_value(page, "paged_waste_fraction", PAGING) < figure_value(page, "naive_waste_fraction", PAGING)
    page.screenshot(path=str(artifacts_dir / "paging-running-1280.png"))
    page.wait_for_selector(f"{PAGING} .pg-demo:not([disabled])", timeout=90_000)
    assert "took" in page.inner_text(f"{PAGING} .pg-demo-note")
    wait_for(lambda: figure_value(page, "free_blocks", PAGING) == total, timeout=30, what="every block back")
    assert figure_value(page, "cached_free_blocks", PAGING) > 0
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
@pytest.mark.fresh_page   # a fake clock of its own
def test_paging_polls_only_while_on_screen(pg):
    """On the walkthrough, snapshots are asked for while the widget is in view, at most once per
    500 ms of the page's own clock (plus one on coming into view), one in flight at a time, and
    not at all once it is scrolled far away. The page runs on Playwright's fake clock, paused:
    the test advances it interval by interval and counts the polls, so a slow machine cannot
    change the count."""
    poll_ms = 500
    page = pg.page
    sent, answered = [], []

    def watch(socket):
        socket.on("framesent", lambda p: json.loads(p).get("type") == "paging" and sent.append(p))
        socket.on("framereceived", lambda p: json.loads(p).get("type") == "paging" and answered.append(p))
    page.on("websocket", watch)
    page.clock.install()
    pg.goto("/#paging")
    # The widget polls only while on screen, and widgets above it grow as they mount and can push it
    # out of view before its first snapshot (section 11 also holds `sharing` now): keep it in view.
    into_view = "document.querySelector('[data-widget=\"paging\"]').scrollIntoView()"
    page.wait_for_selector(PAGING, state="attached")
    page.evaluate(into_view)
    wait_ready(page, PAGING)
    page.evaluate(into_view)
    page.clock.pause_at(page.evaluate("Date.now()") + poll_ms)

    def settle() -> None:
        """Until every snapshot asked for is answered (real time; a hang-stopping bound only)."""
        deadline = time.monotonic() + 60
        while len(answered) < len(sent):
            assert time.monotonic() < deadline, f"{len(sent)} snapshots asked for, {len(answered)} answered"
            page.wait_for_timeout(50)     # (playwright hears frames only while it waits)

    def polls_over(intervals: int) -> int:
        settle()
        before = len(sent)
        for _ in range(intervals):
            page.clock.run_for(poll_ms)
            page.wait_for_timeout(50)
            settle()
        return len(sent) - before

    in_view = polls_over(6)
    assert 5 <= in_view <= 6 + 1, f"{in_view} snapshots in 6 poll intervals on screen"
    page.evaluate("window.scrollTo(0, 0)")
    # The observer reports on the next rendering, in real time: wait for it before advancing the clock.
    page.wait_for_selector(f'{PAGING}[data-on-screen="false"]', state="attached", timeout=30_000)
    settle()
    assert polls_over(6) == 0, "snapshots asked for while scrolled away"
    page.evaluate(into_view)
    page.wait_for_selector(f'{PAGING}[data-on-screen="true"]', state="attached", timeout=30_000)
    back = polls_over(6)
    assert 5 <= back <= 6 + 1, f"{back} snapshots in 6 poll intervals back on screen"
    pg.assert_clean()
