"""The replay of a recorded room (issue 25, /room/<code>/replay): the presenter view with
data-source="recording", driven by the export's steps with play, pause and step, no engine work.
It draws the same strip and figures as the live room did (here: as the presenter drew the same
session from its live updates, room_fixture.py); a file of another shape is refused by name.
"""

import json

import pytest

from conftest import Page

from .room_fixture import session
from .views import FakeRoomSocket, serve_qr, expected_signature, page_server, serve_json, serve_template, strip_signature

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


def test_a_file_of_another_shape_is_refused_by_name(context, live_server, tmp_path):
    room = session(students=3, slots=2, code=CODE)
    pg = open_replay(context, live_server, room["export"])
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"schema": "something/else", "steps": []}))
    pg.page.set_input_files('[data-control="file"]', str(bad))
    pg.page.wait_for_function("() => document.querySelector('.room-player-where').textContent.includes('sendlens.room/1')")
    assert pg.page.get_attribute(ROOT, "data-state") == "error"
    assert pg.page_errors == []
