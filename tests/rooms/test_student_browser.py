"""The student's page of a room (issue 25): the join form (its input named display_name, a named
error shown beside it), then the chat widget and "your request in the batch": the same step strip
as the projector with this student's slots marked and the others' dimmed, their own request's row
and the time it waited. Drawn from a recorded room (room_fixture.py); a screenshot at 390 px.
"""

import pytest

from conftest import Page

from .room_fixture import session
from .views import FakeRoomSocket, page_server, serve_template, strip_signature

pytestmark = pytest.mark.browser

CODE = "TESTR00M"
ROOT = f'[data-view="student"][data-room="{CODE}"]'


@pytest.fixture
def phone(browser):
    context = browser.new_context(viewport={"width": 390, "height": 844})
    yield context
    context.close()


def test_the_join_form_names_its_input_and_shows_the_error(phone, live_server, artifacts_dir):
    pg = Page(phone, page_server(live_server))
    message = "display_name: 'Ada' is taken in this room; choose another name"
    serve_template(phone, live_server, f"/room/{CODE}", "room_student.html", code=CODE, joined=False,
                   error=message, value="<b>Ada</b>")
    pg.goto(f"/room/{CODE}")
    page = pg.page
    form = page.locator(f'form[method="post"][action="/room/{CODE}/join"]')
    assert form.locator('input[name="display_name"]').input_value() == "<b>Ada</b>"
    assert page.locator('[data-error-param="display_name"]').inner_text() == message
    assert page.locator("b").count() == 0
    page.screenshot(path=str(artifacts_dir / "room-join-390.png"))
    assert page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth") <= 0
    pg.assert_clean()


def test_your_request_in_the_batch(phone, live_server, artifacts_dir):
    room = session(students=8, slots=4, scheduling="continuous", code=CODE)
    cut = 6                                       # Barbara's request is in prefill, five others decode
    pg = Page(phone, page_server(live_server))
    serve_template(phone, live_server, f"/room/{CODE}", "room_student.html", code=CODE, joined=True, name="Barbara")
    socket = FakeRoomSocket(pg.page, room["updates"][:cut])
    pg.goto(f"/room/{CODE}")
    page = pg.page
    page.wait_for_selector(f'{ROOT}[data-student="Barbara"][data-state="ready"][data-seq="{cut - 1}"]', timeout=60_000)
    assert socket.urls and all(u.endswith(f"/ws?room={CODE}") for u in socket.urls)   # talks in this room
    assert page.locator('[data-widget="chat"]').count() == 1
    mine = page.locator(f"{ROOT} .rs-cell.rs-mine")
    assert mine.count() > 0 and {mine.nth(i).get_attribute("data-student") for i in range(mine.count())} == {"Barbara"}
    others = page.locator(f"{ROOT} .rs-cell.rs-other")
    assert others.count() > 0 and "Barbara" not in {others.nth(i).get_attribute("data-student") for i in range(others.count())}
    rows = page.locator(f"{ROOT} [data-request-row]")
    assert rows.count() == 1 and rows.get_attribute("data-student") == "Barbara"
    record = next(r for r in room["updates"][cut - 1]["requests"] if r["student"] == "Barbara")
    waited = page.locator(f"{ROOT} [data-request-row] td.num").nth(5).get_attribute("data-value")
    assert float(waited) == record["waited_s"]
    text = page.inner_text(f"{ROOT} .room-yours")
    assert text.startswith("Your request: prefill") and "waited" in text and "shared with" in text
    assert len(strip_signature(page, ROOT)) == cut
    page.locator(".room-batch").scroll_into_view_if_needed()
    page.screenshot(path=str(artifacts_dir / "room-student-390.png"), full_page=True)
    assert page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth") <= 0
    # the live batch's table (eight columns) is wider than a phone: it scrolls sideways inside its
    # own box (overflow-x auto), the box stays within the page, and the box scrolled to its end
    # shows the last column ("waited") whole, its head and the student's cell
    box = page.locator(f"{ROOT} .room-table")
    box.scroll_into_view_if_needed()
    panel = page.locator(f"{ROOT} .figure:has(.room-table)")
    panel.screenshot(path=str(artifacts_dir / "room-student-table-390.png"))
    fit = box.evaluate("""(n) => ({ scroll: n.scrollWidth, client: n.clientWidth, left: n.getBoundingClientRect().left,
        right: n.getBoundingClientRect().right, overflowX: getComputedStyle(n).overflowX })""")
    assert fit["scroll"] > fit["client"], f"the table fits at 390 px, so this test checks nothing: {fit}"
    assert fit["overflowX"] == "auto", fit
    assert 0 <= fit["left"] and fit["right"] <= page.evaluate("() => window.innerWidth"), fit
    box.evaluate("(n) => { n.scrollLeft = n.scrollWidth; }")
    assert box.evaluate("(n) => n.scrollLeft") == fit["scroll"] - fit["client"], "the box did not scroll to its end"
    assert page.locator(f"{ROOT} .room-table thead th").last.inner_text() == "waited"
    edges = page.evaluate("""(root) => {
        const box = document.querySelector(root + ' .room-table').getBoundingClientRect();
        const last = [...document.querySelectorAll(root + ' .room-table tr')].map((tr) => tr.lastElementChild.getBoundingClientRect());
        return last.map((r) => [r.left - box.left, box.right - r.right]); }""", ROOT)
    assert len(edges) == 2, edges                  # the head and Barbara's row
    # -1: sub-pixel layout rounding of the rects (each edge is a whole or half CSS pixel off at most)
    assert all(left >= -1 and right >= -1 for left, right in edges), edges
    panel.screenshot(path=str(artifacts_dir / "room-student-table-390-scrolled.png"))
    assert page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth") <= 0
    pg.assert_clean()
