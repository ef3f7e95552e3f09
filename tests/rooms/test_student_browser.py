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
    pg.assert_clean()
