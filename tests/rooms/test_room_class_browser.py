"""Issue 25's classroom test: one presenter and 8 students (Playwright contexts, each its own
cookies and socket) in one room of a real server, sending at once.

- every student gets an answer, and the presenter shows all 8 rows;
- the step strip shows requests of several students sharing steps;
- the figures equal the room's own trace (its export);
- switching to static batching changes the strip as the batching widget predicts: no request
  joins a batch while another of it still runs (continuous batching refills a finished slot at once);
- the replay of the export draws the live strip, and shows the settings in force at each step;
- bad names get the named error (display_name), and a student cannot use the teacher's controls.

The server is the app on the `tiny` model (random weights: the answers are noise, the engine's
scheduling is the real one), served in a thread like conftest's live_server, with room limits
that fit the test. Screenshots of the presenter with the full room at 1920x1080 and 1280x720.
"""

import threading
from types import SimpleNamespace

import pytest

from conftest import Page

from .views import expected_signature, strip_signature

pytestmark = pytest.mark.browser

STUDENTS = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken"]
PRESENTER = '[data-view="presenter"]'
STUDENT = '[data-view="student"]'
HANG_MS = 120_000          # hang-stopping only


@pytest.fixture(scope="module")
def room_server(tiny_loaded, tmp_path_factory):
    from werkzeug.serving import make_server

    from app import create_app

    settings = {"model": "tiny", "testing": True, "num_kv_blocks": 512, "max_tokens_limit": 64, "default_max_tokens": 16,
                # the default work budget: a student's second message (its chat's history and a long
                # question) may find its connection's budget low after a fast first wave; the page's
                # client waits the server's retry_after_s and sends it again (static/js/client.js)
                "room_join_rate_per_minute": 200, "room_max_rooms": 16, "rooms_db_path": str(tmp_path_factory.mktemp("rooms") / "rooms.sqlite3")}
    app = create_app(settings, loaded=tiny_loaded)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="room-server", daemon=True)
    thread.start()
    port = server.server_port
    yield SimpleNamespace(app=app, port=port, base=f"http://127.0.0.1:{port}")
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)
    app.extensions["sendlens"].shutdown()


@pytest.fixture
def contexts(browser):
    made = []

    def new(width=1280, height=900):
        context = browser.new_context(viewport={"width": width, "height": height})
        made.append(context)
        return context
    yield new
    for context in made:
        context.close()


def open_room(contexts, room_server) -> tuple[Page, str]:
    pg = Page(contexts(1920, 1080), room_server)
    pg.goto("/room/new")
    pg.page.wait_for_selector(f'{PRESENTER}[data-source="live"][data-state="ready"]', timeout=HANG_MS)
    return pg, pg.page.get_attribute(PRESENTER, "data-room")


def join(contexts, room_server, code: str, name: str) -> Page:
    pg = Page(contexts(1100, 900), room_server)
    pg.goto(f"/room/{code}")
    pg.page.fill('input[name="display_name"]', name)
    pg.page.click('form[action$="/join"] button[type="submit"]')
    pg.page.wait_for_selector(f'{STUDENT}[data-student="{name}"][data-state="ready"]', timeout=HANG_MS)
    pg.page.wait_for_selector('[data-widget="chat"][data-state="ready"]', timeout=HANG_MS)
    return pg


def control(pg, name: str, value) -> None:
    """Set a teacher control and wait for the room's settings to say so."""
    node = pg.page.locator(f'[data-control="{name}"]')
    if name == "scheduling":
        node.select_option(value)
    elif isinstance(value, bool):
        node.set_checked(value)
    else:
        node.fill(str(value))
        node.dispatch_event("change")
    pg.page.wait_for_function("([k, v]) => { const s = document.querySelector('[data-settings]').dataset.settings;"
                              " return s && JSON.parse(s)[k] === v; }", arg=[name, value], timeout=HANG_MS)


def message(i: int) -> str:
    """Student i's question: short for even i, long (several prefill chunks) for odd i, so that the
    requests of one batch end at different steps (the room gives everyone the same max_tokens)."""
    question = f"Question {i + 1} from the class: what is {i + 2} times {i + 3}?"
    return question if i % 2 == 0 else question + " Some context first: " + "the river runs to the sea and back again, " * 70


def send_together(students: list[Page]) -> None:
    """Every student's chat sends at once: the texts first, then each form submitted without
    waiting for the others; then every answer must end with its tokens counted."""
    for i, pg in enumerate(students):
        pg.page.fill('[data-widget="chat"] textarea[name="message"]', message(i))
    for pg in students:
        pg.page.evaluate("() => document.querySelector('[data-widget=chat] form').requestSubmit()")
    for pg in students:
        pg.page.wait_for_function("() => /^(Stopped|The server refused)/.test(document.querySelector('[data-widget=chat] .finish').textContent)",
                                  timeout=HANG_MS)
        finish = pg.page.inner_text('[data-widget="chat"] .finish')
        assert finish.startswith("Stopped"), finish
        # the tiny model's greedy answer may be all whitespace: count its tokens
        assert float(pg.page.get_attribute('[data-widget="chat"] [data-figure="completion_tokens"]', "data-value")) > 0


def requests_by_step(steps: list[dict]) -> list[list[str]]:
    """Per step of the trace: the requests holding a slot in it (working or idle)."""
    return [[c["request"] for c in s["slots"] if c] for s in steps]


def refills(steps: list[dict]) -> int:
    """Steps where a request takes a slot while its batch still runs although a member of that
    batch has already finished: continuous batching's refill, which static batching never does
    (a static batch may take several steps to admit its members under the prefill budget, but
    no member finishes that soon). A batch starts when a request arrives and none runs."""
    first, last = {}, {}
    for t, s in enumerate(steps):
        for c in s["slots"]:
            if c:
                first.setdefault(c["request"], t)
                if c["kind"] != "idle":
                    last[c["request"]] = t
    count, batch = 0, set()
    for t in range(len(steps)):
        new = {r for r, f in first.items() if f == t}
        if not new:
            continue
        if not any(last.get(r, -1) >= t for r in batch):
            batch = set()                                  # the batch drained: a new one starts
        elif any(last.get(r, -1) < t for r in batch):
            count += 1                                     # a member is done, yet others run: a refill
        batch |= new
    return count


def figures(page) -> dict:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('[data-view=presenter] [data-figure]')]
        .map((n) => [n.dataset.figure, Number(n.dataset.value)]))""")


def export_of(pg, code: str) -> dict:
    resp = pg.page.request.get(f"{pg.server.base}/room/{code}/export")
    assert resp.status == 200, resp.status
    return resp.json()


def wait_drawn_as_exported(presenter: Page, code: str, slots: int) -> dict:
    """The export, once the presenter's figures equal its trace and its strip draws the trace's
    last steps (the last update may still be on its way when the export is read)."""
    for _ in range(100):
        exp = export_of(presenter, code)
        busy = sum(1 for s in exp["steps"] for c in s["slots"] if c and c["kind"] != "idle")
        want = {"room_students": len(exp["room"]["students"]), "room_requests": len(exp["requests"]),
                "room_engine_steps": len(exp["steps"]), "room_mean_requests_per_step": busy / len(exp["steps"])}
        got, strip = figures(presenter.page), strip_signature(presenter.page, PRESENTER)
        if got == want and strip == expected_signature(exp["steps"], slots):
            return exp
        presenter.page.wait_for_timeout(200)
    assert got == want
    assert strip == expected_signature(exp["steps"], slots)
    return exp


def done_rows(presenter: Page, n: int) -> None:
    presenter.page.wait_for_function(
        "(n) => document.querySelectorAll('[data-view=presenter] [data-request-row][data-state=done]').length === n", arg=n, timeout=HANG_MS)


def wave(presenter: Page, students: list[Page]) -> None:
    """The class sends: every student's own chat at once (each must get its answer), then the
    teacher's "everyone, send now" with a prompt of several prefill chunks: eight requests in the
    same instant, whose first four share each step's token budget for their chunks, so they start
    decoding, and end, at different steps (the chats may not overlap much: `tiny` is quick)."""
    send_together(students)
    presenter.page.fill('[name="send_all_prompt"]', "Everyone at once: " + "the river runs to the sea and back again, " * 40)
    presenter.page.click('[data-control="send_all"]')


def test_one_presenter_and_eight_students(contexts, room_server, artifacts_dir):
    presenter, code = open_room(contexts, room_server)
    control(presenter, "max_num_seqs", 4)
    control(presenter, "max_tokens", 48)
    control(presenter, "one_at_a_time", False)
    students = [join(contexts, room_server, code, name) for name in STUDENTS]
    presenter.page.wait_for_selector(f'{PRESENTER} [data-figure="room_students"][data-value="8"]', timeout=HANG_MS)

    # continuous batching: every student gets an answer; steps are shared; a freed slot is refilled at once
    wave(presenter, students)
    done_rows(presenter, 16)
    rows = presenter.page.locator(f"{PRESENTER} [data-request-row]")
    assert {rows.nth(i).get_attribute("data-student") for i in range(16)} == set(STUDENTS)
    exp = wait_drawn_as_exported(presenter, code, 4)
    shared = [s for s in exp["steps"] if len({c["student"] for c in s["slots"] if c and c["kind"] != "idle"}) > 1]
    assert shared, "no step was shared by several students"
    assert any(len({c[0] for c in row[2] if c[1] in ("prefill", "decode")}) > 1 for row in strip_signature(presenter.page, PRESENTER)), \
        "the strip shows no step shared by several students"
    assert refills(exp["steps"]) > 0, "continuous batching never refilled a slot while others ran"
    for size in [(1920, 1080), (1280, 720)]:
        presenter.page.set_viewport_size({"width": size[0], "height": size[1]})
        presenter.page.screenshot(path=str(artifacts_dir / f"room-class-presenter-{size[0]}x{size[1]}.png"))
    students[4].page.screenshot(path=str(artifacts_dir / "room-class-student-1100.png"), full_page=True)

    # static batching: a batch runs until its last member is done, its finished slots idle; only then do the next join
    control(presenter, "scheduling", "static")
    first = len(exp["steps"])
    wave(presenter, students)
    done_rows(presenter, 32)
    exp = wait_drawn_as_exported(presenter, code, 4)
    static = exp["steps"][first:]
    assert max(len(row) for row in requests_by_step(static)) == 4, "no static batch of four"
    assert refills(static) == 0, "static batching refilled a slot before its batch drained"
    idle = [s["step"] for s in static if any(c and c["kind"] == "idle" for c in s["slots"])]
    assert idle, "static batching: no finished request held its slot idle"
    assert presenter.page.get_attribute(PRESENTER, "data-scheduling") == "static"

    # the replay of the recorded session draws the strip the live presenter drew
    drawn_live = strip_signature(presenter.page, PRESENTER)
    replay = Page(contexts(1280, 720), room_server)
    replay.page.context.add_cookies(presenter.page.context.cookies())
    replay.goto(f"/room/{code}/replay")
    replay.page.wait_for_selector(f'{PRESENTER}[data-source="recording"][data-state="ready"]', timeout=HANG_MS)
    replay.page.select_option('[data-control="speed"]', "30")
    replay.page.click('[data-control="play"]')
    total = len(exp["steps"])
    replay.page.wait_for_selector(f'.room-player[data-position="{total}"][data-total="{total}"]', timeout=HANG_MS)
    replay.page.wait_for_selector(f'{PRESENTER}[data-seq="{total}"]', timeout=HANG_MS)
    assert strip_signature(replay.page, PRESENTER) == drawn_live
    assert figures(replay.page) == figures(presenter.page)
    replay.page.screenshot(path=str(artifacts_dir / "room-class-replay-1280x720.png"))
    # and the settings in force at each step, from the room's own log: continuous batching up to
    # the switch, static from the first step after it
    assert replay.page.get_attribute(PRESENTER, "data-scheduling") == "static"
    switch = replay.page.locator('.room-player [data-settings-step]').last
    assert switch.get_attribute("data-settings-step") == str(first) and "static batching" in switch.inner_text()
    replay.page.fill('[data-control="seek"]', str(first))
    replay.page.wait_for_selector(f'{PRESENTER}[data-seq="{first}"][data-scheduling="continuous"]', timeout=HANG_MS)
    replay.page.click('[data-control="step"]')
    replay.page.wait_for_selector(f'{PRESENTER}[data-seq="{first + 1}"][data-scheduling="static"]', timeout=HANG_MS)
    replay.assert_clean()

    # a student cannot use the teacher's controls
    refused = students[0].page.evaluate("""(code) => import('/static/js/client.js').then(({ getClient }) =>
        getClient().call({ type: 'room_control', room: code, action: 'pause' }).then(() => null, (err) => ({ code: err.code, param: err.param })))""", code)
    assert refused == {"code": "not_presenter", "param": "action"}
    assert students[0].page.locator("[data-control]").count() == 0
    presenter.assert_clean()
    for pg in students:
        pg.assert_clean()


@pytest.mark.parametrize("name, why", [
    ("", "empty"), ("x" * 25, "too long"), ("ADA", "taken, in another case"), ("<b>Bold</b>", "markup"),
    ("Bell\u0007", "a control character"),
])
def test_a_bad_name_gets_the_named_error(contexts, room_server, name, why):
    presenter, code = open_room(contexts, room_server)
    join(contexts, room_server, code, "Ada")
    pg = Page(contexts(390, 844), room_server)
    pg.goto(f"/room/{code}")
    pg.page.fill('input[name="display_name"]', name)
    with pg.page.expect_response(lambda r: r.url.endswith(f"/room/{code}/join")) as response:
        pg.page.click('form[action$="/join"] button[type="submit"]')
    assert response.value.status == 400, why
    error = pg.page.locator('[data-error-param="display_name"]')
    assert "display_name" in error.inner_text(), why
    assert pg.page.locator('input[name="display_name"][aria-invalid="true"]').count() == 1
    assert pg.page.locator("b").count() == 0
    assert pg.page.locator(STUDENT).count() == 0, f"{why}: joined anyway"
    presenter.page.wait_for_selector(f'{PRESENTER} [data-figure="room_students"][data-value="1"]', timeout=HANG_MS)


def test_an_unknown_code_gets_the_room_not_found_page(contexts, room_server):
    pg = Page(contexts(390, 844), room_server)
    response = pg.goto("/room/ZZZZ2345")
    assert response.status == 404
    assert pg.page.locator('[data-error="room_not_found"]').count() == 1
    assert pg.page.locator('input[name="display_name"]').count() == 0
    assert pg.page_errors == []
