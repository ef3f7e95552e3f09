"""The rooms over the websocket: students' requests on the room's engine, the presenter's
pushed updates, the teacher's controls (presenter only, each error named), and a restart that
keeps the room and its history."""

import json

import pytest

from conftest import wait_for

from .rooms_server import RoomWS, join, new_room, request, start

PROMPT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def srv(tiny_loaded, tmp_path_factory):
    server = start(tiny_loaded, tmp_path_factory.mktemp("rooms-ws") / "rooms.sqlite3",
                   room_max_requests_per_student=3)
    yield server
    server.stop()


@pytest.fixture
def room(srv):
    for r in list(srv.rooms.rooms.values()):
        srv.rooms.close(r)
    code, presenter = new_room(srv)
    clients = []

    def connect(cookies, **kw):
        ws = RoomWS(srv.ws + (f"?room={kw['room']}" if "room" in kw else ""), cookies)
        clients.append(ws)
        return ws
    yield code, presenter, connect
    for ws in clients:
        ws.close()


def control(ws, code, action, **fields):
    return ws.call("room_control", room=code, action=action, **fields)


def test_students_requests_share_the_rooms_engine_and_the_presenter_sees_them(srv, room):
    code, presenter, connect = room
    boss = connect(presenter)
    watch = boss.next_id()
    boss.send({"type": "room_watch", "id": watch, "room": code})
    first = boss.updates(watch, lambda u: True)[0]
    assert first["full"] is True and first["room"] == code and first["requests"] == []
    assert first["settings"]["scheduling"] == "continuous" and first["totals"]["students"] == 0

    names = ["Ada", "Grace", "Alan", "Edsger"]
    students = [connect(join(srv, code, n)) for n in names]
    mids = [ws.start(messages=PROMPT, max_tokens=50) for ws in students]
    streams = [ws.finish(mid) for ws, mid in zip(students, mids)]
    max_tokens = first["settings"]["max_tokens"]
    for s in streams:
        assert s.error is None and s.done["finish_reason"] in ("stop", "length")
        assert s.accepted["room"] == code and s.accepted["max_tokens"] == max_tokens
        assert len(s.tokens) <= max_tokens

    model = {"requests": {}, "steps": []}

    def fold(u):
        for r in u["requests"]:
            model["requests"][r["id"]] = r
        model["steps"].extend(u["steps"])
        return (len(model["requests"]) == 4 and all(r["state"] == "done" for r in model["requests"].values())
                and u["totals"]["engine_steps"] == len(model["steps"]))
    ups = boss.updates(watch, fold)
    last = ups[-1]
    assert sorted(r["student"] for r in model["requests"].values()) == sorted(names)
    assert [s["name"] for s in last["students"]] == names
    steps = model["steps"]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    # the figures are the trace's own: steps, and requests served per step
    busy = [sum(1 for c in s["slots"] if c and c["kind"] != "idle") for s in steps]
    assert last["totals"]["engine_steps"] == len(steps)
    assert last["totals"]["requests"] == 4 and last["totals"]["students"] == 4
    assert last["totals"]["mean_requests_per_step"] == pytest.approx(sum(busy) / len(steps), rel=1e-12)
    assert max(len({c["student"] for c in s["slots"] if c and c["kind"] != "idle"}) for s in steps) >= 2
    for r in model["requests"].values():
        mine = [c for s in steps for c in s["slots"] if c and c["request"] == r["id"]]
        decodes = [c for c in mine if c["kind"] == "decode"]
        assert r["generated_tokens"] == len(decodes) + 1      # the last prefill chunk gives the first token
        assert r["ttft_s"] > 0 and r["waited_s"] is not None and r["prefill_chunk"] >= 1
    # the server's own engine never saw these requests
    assert srv.app.extensions["sendlens"].loop.stats()["steps"] == 0


def test_the_rooms_rules_and_the_teachers_controls(srv, room):
    code, presenter, connect = room
    boss = connect(presenter)
    ada = connect(join(srv, code, "Ada"))
    # a student may not use the controls, nor a stranger watch
    err = control(ada, code, "pause")
    assert err["type"] == "error" and err["code"] == "not_presenter" and err["param"] == "action"
    stranger = connect({})
    err = stranger.call("room_watch", room=code)
    assert err["code"] == "room_not_found" and err["param"] == "room"
    err = stranger.call("room_watch", room="ZZZZZZZZ")
    assert err["code"] == "room_not_found"
    # bad settings are named
    for settings, param in (({"max_num_seqs": 0}, "max_num_seqs"), ({"scheduling": "fifo"}, "scheduling"),
                            ({"max_tokens": 10 ** 6}, "max_tokens"), ({"paused": "yes"}, "paused"),
                            ({"colour": 1}, "colour"), ("x", "settings")):
        err = control(boss, code, "settings", settings=settings)
        assert err["type"] == "error" and err["param"] == param, (settings, err)
    assert control(boss, code, "dance")["param"] == "action"
    # pause: a named error for the student; resume: it goes through
    ok = control(boss, code, "pause")
    assert ok["type"] == "room_control_ok" and ok["settings"]["paused"] is True
    err = ada.generate(messages=PROMPT).error
    assert err["code"] == "room_paused"
    control(boss, code, "resume")
    ok = control(boss, code, "settings", settings={"max_tokens": 3, "scheduling": "static", "max_num_seqs": 2})
    assert ok["settings"]["max_tokens"] == 3 and ok["settings"]["scheduling"] == "static"
    s = ada.generate(messages=PROMPT, max_tokens=40)
    assert s.error is None and len(s.tokens) <= 3
    # one at a time, then the per-student limit (3 here)
    first = ada.start(messages=PROMPT)
    second = ada.generate(messages=PROMPT)
    ada.finish(first)
    if second.error:
        assert second.error["code"] == "room_limit" and second.error["param"] == "one_at_a_time"
    while True:
        s = ada.generate(messages=PROMPT)
        if s.error:
            break
    assert s.error["code"] == "room_limit" and "room_max_requests_per_student" in s.error["message"]
    # send_all: every member's seat sends, as that student
    grace = connect(join(srv, code, "Grace"))
    ok = control(boss, code, "send_all", prompt="Everyone, hello!")
    assert ok["type"] == "room_control_ok" and ok["sent"] == 1
    assert [k["student"] for k in ok["skipped"]] == ["Ada"]
    r = srv.rooms.get(code)
    wait_for(lambda: not r.busy(), timeout=60, what="send_all's request to finish")
    assert any(rec.student == "Grace" for rec in r.records.values())
    assert grace.quiet(0.1)
    assert control(boss, code, "send_all", prompt="")["param"] == "prompt"
    # clear: records and steps go, members stay; a watcher gets a full update
    watch = boss.next_id()
    boss.send({"type": "room_watch", "id": watch, "room": code})
    boss.updates(watch, lambda u: u["full"])
    assert control(boss, code, "clear")["type"] == "room_control_ok"
    u = boss.updates(watch, lambda u: u["full"])[-1]
    assert u["requests"] == [] and u["totals"]["engine_steps"] == 0 and len(u["students"]) == 2
    # the export starts again too: no step, no record, and the settings log from the settings in
    # force at step 0 (the old log's step numbers counted the steps the clear forgot)
    status, _, body = request(srv, "GET", f"/room/{code}/export", cookies=presenter)
    exp = json.loads(body)
    assert status == 200 and exp["steps"] == [] and exp["requests"] == []
    assert [(e["step"], e["settings"]) for e in exp["settings_log"]] == [(0, srv.rooms.get(code).settings.as_dict())]


def test_a_student_watches_their_room_but_not_another(srv, room):
    code, presenter, connect = room
    ada = connect(join(srv, code, "Ada"))
    mid = ada.next_id()
    ada.send({"type": "room_watch", "id": mid, "room": code})
    u = ada.updates(mid, lambda u: True)[0]
    assert u["full"] and u["students"] == [{"name": "Ada", "kv_blocks": 0}]
    assert ada.call("room_unwatch")["type"] == "room_unwatch"


def test_a_restart_keeps_the_room_its_members_records_and_steps(tiny_loaded, tmp_path):
    db = tmp_path / "rooms.sqlite3"
    first = start(tiny_loaded, db)
    try:
        code, presenter = new_room(first)
        students = {n: join(first, code, n) for n in ("Ada", "Grace")}
        for cookies in students.values():
            ws = RoomWS(first.ws, cookies)
            assert ws.generate(messages=PROMPT).error is None
            ws.close()
        RoomWS(first.ws, presenter).call("room_control", room=code, action="settings",
                                         settings={"max_num_seqs": 5})
        room = first.rooms.get(code)
        wait_for(lambda: not room.unsaved_records and not room.unsaved_steps, timeout=30, what="the store")
        before = json.loads(request(first, "GET", f"/room/{code}/export", cookies=presenter)[2])
    finally:
        first.stop()
    assert len(before["requests"]) == 2 and before["steps"]
    second = start(tiny_loaded, db)
    try:
        after = json.loads(request(second, "GET", f"/room/{code}/export", cookies=presenter)[2])
        for key in ("room", "steps", "requests", "settings_log"):
            assert after[key] == before[key], key
        assert after["room"]["settings"]["max_num_seqs"] == 5
        assert request(second, "GET", f"/room/{code}/present", cookies=presenter)[0] == 200
        ws = RoomWS(second.ws, students["Ada"])
        s = ws.generate(messages=PROMPT)
        assert s.error is None and s.accepted["request"] == "r2"
        mid = ws.next_id()
        ws.send({"type": "room_watch", "id": mid, "room": code})
        u = ws.updates(mid, lambda u: True)[0]
        assert u["totals"]["requests"] >= 2 and u["totals"]["engine_steps"] >= len(before["steps"])
        ws.close()
    finally:
        second.stop()


def test_students_count_against_the_rooms_seats_not_their_address(tiny_loaded, tmp_path):
    server = start(tiny_loaded, tmp_path / "rooms.sqlite3", max_connections_per_address=2)
    clients = []
    try:
        code, _ = new_room(server)
        clients = [RoomWS(server.ws, join(server, code, f"s{i}")) for i in range(4)]
        assert all(ws.hello["type"] == "hello" for ws in clients)
        stranger = [RoomWS(server.ws, {}) for _ in range(3)]
        clients.extend(stranger)
        assert [ws.hello["type"] for ws in stranger] == ["hello", "hello", "error"]
        assert stranger[2].hello["code"] == "overloaded"
    finally:
        for ws in clients:
            ws.close()
        server.stop()


def test_an_idle_room_closes_and_then_answers_like_an_unknown_one(tiny_loaded, tmp_path):
    server = start(tiny_loaded, tmp_path / "rooms.sqlite3", room_idle_close_s=60)
    try:
        code, presenter = new_room(server)
        room = server.rooms.get(code)
        server.rooms.housekeep()
        assert server.rooms.get(code) is room
        room.last_active -= 61
        server.rooms.housekeep()
        assert request(server, "GET", f"/room/{code}")[0] == 404
        assert request(server, "POST", f"/room/{code}/join", form={"display_name": "Ada"})[0] == 404
        assert server.rooms.store.room(code)["state"] == "closed"
        status, _, body = request(server, "GET", f"/room/{code}/export", cookies=presenter)
        assert status == 200 and json.loads(body)["room"]["state"] == "closed"
    finally:
        server.stop()


def test_forty_students_behind_one_address_join_and_chat_and_a_stranger_is_still_limited(tiny_loaded, tmp_path):
    """Issue 30: a class behind one NAT. With the default join rate and seat limits, 40 students
    join one room over HTTP from 127.0.0.1, open their sockets with their cookies and all chat;
    anonymous tabs from that address still get max_connections_per_address seats, no more."""
    server = start(tiny_loaded, tmp_path / "rooms.sqlite3")
    config = server.app.config["SENDLENS"]
    clients = []
    try:
        code, _ = new_room(server)
        cookies = [join(server, code, f"Student {i}") for i in range(40)]
        clients = [RoomWS(f"{server.ws}?room={code}", c) for c in cookies]
        assert all(ws.hello["type"] == "hello" for ws in clients)
        mids = [ws.start(messages=PROMPT, max_tokens=8) for ws in clients]
        streams = [ws.finish(mid) for ws, mid in zip(clients, mids)]
        for s in streams:
            assert s.error is None and s.done["finish_reason"] in ("stop", "length")
            assert s.accepted["room"] == code
        strangers = []
        for _ in range(config.max_connections_per_address + 1):
            strangers.append(RoomWS(server.ws, {}))
            clients.append(strangers[-1])
        kinds = [ws.hello["type"] for ws in strangers]
        assert kinds == ["hello"] * config.max_connections_per_address + ["error"]
        assert strangers[-1].hello["code"] == "overloaded"
    finally:
        for ws in clients:
            ws.close()
        server.stop()


def test_a_members_long_prompt_is_tokenized_by_a_job_with_the_same_replies(srv, room, monkeypatch):
    """A chat over work_slice_tokens is tokenized by the job runner (app/prompt_job.py), then runs
    on the room's engine with the same replies as the same chat tokenized inline."""
    code, _, connect = room
    ada = connect(join(srv, code, "Ada"))
    runtime = srv.app.extensions["sendlens"]
    messages = [{"role": "user", "content": "The miller counted the boats on the river, one by one.\n" * 20}]
    jobs = runtime.jobs.stats()["completed"]
    sliced = ada.finish(ada.start(messages=messages, temperature=0.0))
    by_job = runtime.jobs.stats()["completed"] - jobs
    monkeypatch.setattr(runtime.config, "work_slice_tokens", 1 << 20)       # the same chat, inline
    inline = ada.finish(ada.start(messages=messages, temperature=0.0))
    assert by_job == 1 and runtime.jobs.stats()["completed"] - jobs == 1
    assert sliced.error is None and inline.error is None, (sliced.error, inline.error)
    assert sliced.token_ids == inline.token_ids and sliced.accepted["room"] == code
    same = ("finish_reason", "stop_reason", "prompt_tokens", "completion_tokens", "text")
    assert {k: sliced.done[k] for k in same} == {k: inline.done[k] for k in same}
    assert {k: v for k, v in sliced.accepted.items() if k not in ("id", "request")} == \
           {k: v for k, v in inline.accepted.items() if k not in ("id", "request")}
    assert sliced.accepted["prompt_tokens"] == len(runtime.engine.view.tokenizer.apply_chat_template(messages))
    assert runtime.loop.stats()["steps"] == 0                                 # the room's engine ran both
