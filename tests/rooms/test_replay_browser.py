"""The replay of a recorded room (issue 25, /room/<code>/replay): the presenter view with
data-source="recording", driven by the export's steps with play, pause and step, no engine work.
It draws the same strip and figures as the live room did (here: as the presenter drew the same
session from its live updates, room_fixture.py), and when the teacher changed a setting mid-session
it shows, at each step, the settings the live presenter showed when that step came in; a file of
another shape is refused by name.
"""

import json

import pytest

from conftest import Page

from .room_fixture import session
from .views import (FakeRoomSocket, expected_signature, page_server, serve_json, serve_qr, serve_template, shown_settings,
                    strip_content, strip_signature)

pytestmark = pytest.mark.browser

CODE = "TESTR00M"
ROOT = f'[data-view="presenter"][data-room="{CODE}"][data-source="recording"]'
PLAYER = ".room-player"


@pytest.fixture
def context(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    yield context
    context.close()


def open_replay(context, live_server, export: dict) -> Page:
    pg = Page(context, page_server(live_server))
    serve_template(context, live_server, f"/room/{CODE}/replay", "room_present.html", code=CODE, source="recording")
    serve_json(context, f"{live_server.http}/room/{CODE}/export", export)
    pg.goto(f"/room/{CODE}/replay")
    pg.page.wait_for_selector(f'{ROOT}[data-state="ready"]', timeout=60_000)
    return pg


def position(page) -> tuple[int, int]:
    node = page.locator(PLAYER)
    return int(node.get_attribute("data-position")), int(node.get_attribute("data-total"))


def test_replay_steps_plays_and_ends_with_the_recorded_strip_and_figures(context, live_server):
    room = session(students=8, slots=4, scheduling="static", code=CODE)
    export = room["export"]
    pg = open_replay(context, live_server, export)
    page = pg.page
    total = len(export["steps"])
    assert position(page) == (1, total)                 # the first step is drawn at once
    assert page.locator('[data-control="scheduling"]').count() == 0, "a replay has no teacher controls"
    assert page.locator(".badge-live").count() == 0, "a replay computes nothing live"
    for key in ["room_students", "room_requests", "room_engine_steps", "room_mean_requests_per_step"]:
        assert page.locator(f'.stat:has([data-figure="{key}"]) .badge-recorded').count() == 1, key
    page.click('[data-control="step"]')
    page.click('[data-control="step"]')
    assert position(page) == (3, total)
    page.wait_for_selector(f'{ROOT}[data-seq="3"]')      # drawn (the view draws at most every 50 ms)
    assert strip_signature(page, ROOT) == expected_signature(export["steps"][:3], 4)
    page.select_option('[data-control="speed"]', "2")
    page.click('[data-control="play"]')
    page.wait_for_selector(f'{PLAYER}[data-playing="true"]')
    page.click('[data-control="play"]')                  # pause
    paused_at = position(page)[0]
    page.wait_for_timeout(1200)                          # more than two steps' time at 2 steps/s
    assert position(page)[0] == paused_at, "paused, the replay moved on"
    page.select_option('[data-control="speed"]', "30")
    page.click('[data-control="play"]')
    page.wait_for_selector(f'{PLAYER}[data-position="{total}"][data-playing="false"]', timeout=60_000)
    page.wait_for_selector(f'{ROOT}[data-seq="{total}"]')
    assert strip_signature(page, ROOT) == expected_signature(export["steps"], 4)
    busy = sum(1 for s in export["steps"] for c in s["slots"] if c and c["kind"] != "idle")
    got = page.evaluate("() => Object.fromEntries([...document.querySelectorAll('[data-figure]')].map((n) => [n.dataset.figure, Number(n.dataset.value)]))")
    assert got == {"room_students": 8, "room_requests": len(export["requests"]), "room_engine_steps": total,
                   "room_mean_requests_per_step": busy / total}
    rows = page.locator("[data-request-row]")
    assert rows.count() == 8 and {rows.nth(i).get_attribute("data-state") for i in range(8)} == {"done"}
    pg.assert_clean()


def test_the_replay_draws_the_strip_the_live_presenter_drew(browser, context, live_server):
    room = session(students=8, slots=4, scheduling="continuous", code=CODE)
    live_context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        live = Page(live_context, page_server(live_server))
        serve_template(live_context, live_server, f"/room/{CODE}/present", "room_present.html", code=CODE, source="live")
        serve_qr(live_context, live_server, CODE)
        FakeRoomSocket(live.page, room["updates"])
        live.goto(f"/room/{CODE}/present")
        live.page.wait_for_selector(f'[data-view="presenter"][data-seq="{room["updates"][-1]["seq"]}"]', timeout=60_000)
        drawn_live = strip_signature(live.page)
    finally:
        live_context.close()
    pg = open_replay(context, live_server, room["export"])
    pg.page.click('[data-control="play"]')
    total = len(room["export"]["steps"])
    pg.page.wait_for_selector(f'{PLAYER}[data-position="{total}"]', timeout=60_000)
    pg.page.wait_for_selector(f'{ROOT}[data-seq="{total}"]')
    assert strip_signature(pg.page, ROOT) == drawn_live


def play_live_with_a_change(browser, live_server, room) -> dict:
    """The live presenter on the room's first round; then the teacher switches to static batching
    and to 2 batch slots (the fake room answers each control with its update, the last one with
    the second round's steps). -> the strip's content and the settings shown after each round."""
    first, second = room["rounds"]

    def on_control(msg):
        change = next((c for c in second["changes"] if c["settings"] == msg.get("settings")), None)
        if change is None:
            return []
        return [change["update"], *(second["updates"] if change is second["changes"][-1] else [])]

    live_root = f'[data-view="presenter"][data-room="{CODE}"][data-source="live"]'
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        live = Page(context, page_server(live_server))
        serve_template(context, live_server, f"/room/{CODE}/present", "room_present.html", code=CODE, source="live")
        serve_qr(context, live_server, CODE)
        sock = FakeRoomSocket(live.page, first["updates"], on_control)
        live.goto(f"/room/{CODE}/present")
        live.page.wait_for_selector(f'{live_root}[data-seq="{first["updates"][-1]["seq"]}"]', timeout=60_000)
        drawn = {"first": (strip_content(live.page, live_root), shown_settings(live.page, live_root))}
        live.page.select_option('[data-control="scheduling"]', "static")
        live.page.wait_for_selector(f'{live_root}[data-seq="{second["changes"][0]["update"]["seq"]}"][data-scheduling="static"]')
        live.page.fill('[data-control="max_num_seqs"]', "2")
        live.page.dispatch_event('[data-control="max_num_seqs"]', "change")
        live.page.wait_for_selector(f'{live_root}[data-seq="{second["updates"][-1]["seq"]}"]', timeout=60_000)
        drawn["second"] = (strip_content(live.page, live_root), shown_settings(live.page, live_root))
        assert [c["settings"] for c in sock.controls] == [{"scheduling": "static"}, {"max_num_seqs": 2}]
        live.assert_clean()
    finally:
        context.close()
    return drawn


def test_a_settings_change_mid_session_replays_as_the_live_presenter_showed_it(browser, context, live_server, artifacts_dir):
    room = session(students=8, slots=4, scheduling="continuous", code=CODE, changes=[{"scheduling": "static", "max_num_seqs": 2}])
    export, log = room["export"], room["export"]["settings_log"]
    changed_at = len(room["rounds"][0]["updates"])       # steps done when the teacher changed the settings
    total = len(export["steps"])
    assert [e["step"] for e in log] == [0, changed_at, changed_at] and changed_at + 1 < total
    old, new = log[0]["settings"], log[-1]["settings"]
    assert (old["scheduling"], old["max_num_seqs"], new["scheduling"], new["max_num_seqs"]) == ("continuous", 4, "static", 2)
    # what the live presenter showed as each step came in: that step's update's settings
    when_step_came = {u["steps"][0]["step"]: u["settings"] for u in room["updates"] if u["steps"]}
    drawn = play_live_with_a_change(browser, live_server, room)
    assert drawn["first"][1] == old and drawn["second"][1] == new

    pg = open_replay(context, live_server, export)
    page = pg.page

    def shows(position: int) -> None:
        page.wait_for_selector(f'{PLAYER}[data-position="{position}"]')
        page.wait_for_selector(f'{ROOT}[data-seq="{position}"]')      # drawn (the view draws at most every 50 ms)
        assert shown_settings(page, ROOT) == when_step_came[position - 1], position
        assert page.get_attribute(ROOT, "data-scheduling") == when_step_came[position - 1]["scheduling"]

    def seek(position: int) -> None:
        page.fill('[data-control="seek"]', str(position))
        shows(position)

    changes = page.locator(f"{PLAYER} [data-settings-step]")
    assert changes.all_inner_texts() == [f"step #{changed_at} static batching · 2 batch slots"]   # two controls between the same steps
    # scrubbing to the end of the first round: the strip and the settings the live presenter had then
    seek(changed_at)
    assert strip_content(page, ROOT) == drawn["first"][0]
    assert shown_settings(page, ROOT) == old and "continuous batching · 4 batch slots" in page.inner_text(f"{ROOT} .room-settings")
    # stepping past the change: the first step of the second round ran with the new settings
    page.click('[data-control="step"]')
    shows(changed_at + 1)
    assert shown_settings(page, ROOT) == new and "static batching · 2 batch slots" in page.inner_text(f"{ROOT} .room-settings")
    assert strip_signature(page, ROOT) == expected_signature(export["steps"][:changed_at + 1], 4)
    # each request the replay shows is in the state the live room gave it after that step (the
    # replay shows a request from its first slot on; the live room from its arrival)
    live_states = {r["id"]: r["state"] for u in room["updates"] if u["steps"] and u["steps"][0]["step"] == changed_at for r in u["requests"]}
    shown = page.evaluate("() => [...document.querySelectorAll('[data-request-row]')].map((r) => [r.dataset.requestRow, r.dataset.state])")
    assert len(shown) > 8 and all(live_states[rid] == state for rid, state in shown), (shown, live_states)
    for width, height in [(1280, 800), (1920, 1080)]:
        page.set_viewport_size({"width": width, "height": height})
        page.screenshot(path=str(artifacts_dir / f"room-replay-settings-change-{width}x{height}.png"))
        assert page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth") <= 0, (width, height)
    # back before the change, and forth by the change's own button
    seek(changed_at - 1)
    assert shown_settings(page, ROOT) == old
    page.click(f'{PLAYER} [data-control="seek-change"] >> nth=0')
    shows(changed_at + 1)
    # the whole session: the strip and the settings the live presenter ended with
    seek(total)
    assert strip_content(page, ROOT) == drawn["second"][0]
    assert shown_settings(page, ROOT) == new
    pg.assert_clean()


def test_a_file_of_another_shape_is_refused_by_name(context, live_server, tmp_path):
    room = session(students=3, slots=2, code=CODE)
    pg = open_replay(context, live_server, room["export"])
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"schema": "something/else", "steps": []}))
    pg.page.set_input_files('[data-control="file"]', str(bad))
    pg.page.wait_for_function("() => document.querySelector('.room-player-where').textContent.includes('sendlens.room/1')")
    assert pg.page.get_attribute(ROOT, "data-state") == "error"
    assert pg.page_errors == []
