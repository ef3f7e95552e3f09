"""The presenter view of a room (issue 25), drawn from a recorded room: the contract's rows,
figures and controls, the step strip as the trace says, a switch to static batching that changes
the strip as the batching widget predicts (finished requests hold their slots idle, no slot is
refilled until the batch drains), and screenshots of a full room at 1920x1080 and 1280x720.

The room's socket is played from room_fixture.py (views.FakeRoomSocket), so these tests need
neither the real model nor the server's rooms; test_room_class_browser.py drives the real ones.
"""

import pytest

from conftest import Page

from .room_fixture import session
from .views import FakeRoomSocket, serve_qr, expected_signature, page_server, serve_template, strip_signature

pytestmark = pytest.mark.browser

CODE = "TESTR00M"
ROOT = f'[data-view="presenter"][data-room="{CODE}"]'
CONTROLS = ["pause", "scheduling", "max_num_seqs", "max_tokens", "send_all", "clear",
            "one_at_a_time", "prefix_caching", "chunked_prefill"]


@pytest.fixture
def presenter(browser, live_server):
    """open(updates, on_control=None, viewport=(w, h)) -> (Page, FakeRoomSocket) on the live presenter."""
    contexts = []

    def open_(updates, on_control=None, viewport=(1920, 1080)):
        context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        contexts.append(context)
        pg = Page(context, page_server(live_server))
        serve_template(context, live_server, f"/room/{CODE}/present", "room_present.html", code=CODE, source="live")
        serve_qr(context, live_server, CODE)
        sock = FakeRoomSocket(pg.page, updates, on_control)
        pg.goto(f"/room/{CODE}/present")
        return pg, sock

    yield open_
    for context in contexts:
        context.close()


def wait_seq(page, seq: int) -> None:
    page.wait_for_selector(f'{ROOT}[data-state="ready"][data-seq="{seq}"]', timeout=60_000)


def figures(page) -> dict:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('[data-figure]')]
        .map((n) => [n.dataset.figure, Number(n.dataset.value)]))""")


def test_presenter_shows_every_request_figure_and_step_of_the_room(presenter):
    room = session(students=8, slots=4, scheduling="continuous", code=CODE)
    pg, sock = presenter(room["updates"])
    page = pg.page
    last = room["updates"][-1]
    wait_seq(page, last["seq"])
    assert sock.watches and sock.watches[0]["room"] == CODE
    rows = page.locator("[data-request-row]")
    assert rows.count() == 8
    assert sorted(rows.nth(i).get_attribute("data-student") for i in range(8)) == sorted(r["student"] for r in last["requests"])
    assert {rows.nth(i).get_attribute("data-state") for i in range(8)} == {"done"}
    assert figures(page) == {"room_students": 8, "room_requests": 8, "room_engine_steps": len(room["export"]["steps"]),
                             "room_mean_requests_per_step": last["totals"]["mean_requests_per_step"]}
    for key in ["room_students", "room_requests", "room_engine_steps", "room_mean_requests_per_step"]:
        tile = page.locator(f'.stat:has([data-figure="{key}"])')
        assert tile.locator(".badge-live").count() == 1, f"{key} is not badged live"
    for name in CONTROLS:
        assert page.locator(f'[data-control="{name}"]').count() == 1, name
    assert page.locator('[data-control="scheduling"] option').evaluate_all("os => os.map((o) => o.value)") == ["continuous", "static"]
    assert strip_signature(page, ROOT) == expected_signature(room["export"]["steps"], 4)
    shared = [row for row in strip_signature(page, ROOT) if len({c[0] for c in row[2] if c[1] in ("prefill", "decode")}) > 1]
    assert shared, "no step shared by several students"
    assert "8 requests, 23 engine steps" in page.inner_text(".room-count")
    pg.assert_clean()


def test_a_name_full_of_markup_is_text(presenter):
    room = session(students=3, slots=2, code=CODE)
    evil = '<img src=x onerror="window.pwned=1">'
    for u in room["updates"]:
        for r in u["requests"]:
            r["student"] = evil if r["student"] == "Ada" else r["student"]
        for s in u["students"]:
            s["name"] = evil if s["name"] == "Ada" else s["name"]
        for step in u["steps"]:
            for c in step["slots"]:
                if c and c["student"] == "Ada":
                    c["student"] = evil
    pg, _ = presenter(room["updates"])
    wait_seq(pg.page, room["updates"][-1]["seq"])
    shown = pg.page.evaluate("(evil) => [...document.querySelectorAll('[data-request-row]')].filter((r) => r.dataset.student === evil)"
                             ".map((r) => r.querySelector('.room-name').textContent)", evil)
    assert shown == [evil]
    assert pg.page.locator("img[src=x]").count() == 0
    assert not pg.page.evaluate("() => window.pwned === 1")
    pg.assert_clean()


def idle_and_prefill_rows(signature) -> tuple[int, int]:
    """(rows with an idle slot, rows with an idle slot and a prefill in the same step)."""
    idle = [row for row in signature if any(kind == "idle" for _, kind in row[2])]
    return len(idle), sum(1 for row in idle if any(kind == "prefill" for _, kind in row[2]))


def test_switching_to_static_batching_sends_the_control_and_the_strip_stops_refilling(presenter):
    continuous = session(students=8, slots=4, scheduling="continuous", code=CODE)
    static = session(students=8, slots=4, scheduling="static", code=CODE)
    offset = len(continuous["updates"])
    then = []
    for u in static["updates"]:   # the static run follows the continuous one in the same room
        steps = [{**s, "step": s["step"] + offset} for s in u["steps"]]
        then.append({**u, "seq": u["seq"] + offset, "steps": steps, "full": False})

    def on_control(msg):
        return then if msg.get("settings") == {"scheduling": "static"} else []

    pg, sock = presenter(continuous["updates"], on_control)
    page = pg.page
    wait_seq(page, continuous["updates"][-1]["seq"])
    assert idle_and_prefill_rows(strip_signature(page, ROOT)) == (0, 0)   # continuous: finished slots refilled at once
    page.select_option('[data-control="scheduling"]', "static")
    wait_seq(page, then[-1]["seq"])
    assert sock.controls[0] == {"type": "room_control", "id": sock.controls[0]["id"], "room": CODE,
                                "action": "settings", "settings": {"scheduling": "static"}}
    assert page.get_attribute(ROOT, "data-scheduling") == "static"
    idle, refilled = idle_and_prefill_rows(strip_signature(page, ROOT))
    assert idle > 0 and refilled == 0, "static batching: slots stay idle until the batch drains, then refill together"
    assert "static batching" in page.inner_text(".room-settings")
    page.click('[data-control="pause"]')
    page.fill('[name="send_all_prompt"]', "Everyone: hello")
    page.click('[data-control="send_all"]')
    page.click('[data-control="clear"]')
    page.wait_for_function("() => document.querySelector('.room-control-status').textContent.startsWith('Done: clear')")
    assert [(c["action"], c.get("prompt")) for c in sock.controls[1:]] == [("pause", None), ("send_all", "Everyone: hello"), ("clear", None)]
    pg.assert_clean()


@pytest.mark.parametrize("size", [(1920, 1080), (1280, 720)])
def test_a_full_room_on_a_projector(presenter, artifacts_dir, size):
    room = session(students=40, slots=8, scheduling="continuous", code=CODE)
    cut = len(room["updates"]) // 2        # mid-session: requests waiting, prefilling, decoding and done
    pg, _ = presenter(room["updates"][:cut], viewport=size)
    page = pg.page
    wait_seq(page, room["updates"][cut - 1]["seq"])
    page.screenshot(path=str(artifacts_dir / f"room-presenter-{size[0]}x{size[1]}.png"))
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the presenter view scrolls sideways by {overflow}px at {size}"
    # large type for a projector: the figures' numbers and the strip's cells
    big = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('[data-figure=room_requests]')).fontSize)")
    cell = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('.rs-cell[data-student]')).fontSize)")
    assert big >= 28 and cell >= 12, (big, cell)
    pg.assert_clean()
