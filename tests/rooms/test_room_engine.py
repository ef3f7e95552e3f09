"""A room's engine: a sibling of the server's with the room's settings; records and step rows
built from its snapshots; static batching leaves the idle slots the `batching` widget predicts;
a change of engine settings gives new requests a new engine while the old one drains."""

import threading
import time

import pytest

from app.config import ServerConfig
from app.rooms.records import RequestState
from app.rooms.room import Room
from app.rooms.settings import RoomSettings, defaults, updated
from app.widgets.batching import PASSAGE
from conftest import wait_for
from core.engine.sampling_params import SamplingParams
from core.errors import InvalidParameter


@pytest.fixture
def base(make_tiny_engine):
    return make_tiny_engine(num_kv_blocks=64)


def make_room(**settings) -> Room:
    config = ServerConfig(model="tiny", room_kv_blocks=64, max_tokens_limit=64, default_max_tokens=8)
    return Room("ABCDEFGH", "key", updated(defaults(64), settings, 64), config, time.time())


def run(room, base, students_tokens, prompt_ids):
    """Each (student, max_tokens) sends one request of the passage's tokens; wait for all."""
    for (student, max_tokens), ids in zip(students_tokens, prompt_ids):
        room.apply(updated(room.settings, {"max_tokens": max_tokens}, 64))
        engine, seq, record = room.prepare(base, student, ids, SamplingParams(temperature=0.0, ignore_eos=True))
        room.enqueue(engine, seq, record)
    wait_for(lambda: not room.busy(), timeout=120, what="the room's requests")
    wait_for(lambda: all(r.state == RequestState.DONE for r in room.records.values()), timeout=30, what="records")


def workload(base):
    ids = base.tokenizer.encode(PASSAGE)
    return [("Ada", 2), ("Grace", 12), ("Alan", 3), ("Edsger", 10)], [ids[5 * i: 5 * i + 8] for i in range(4)]


@pytest.mark.parametrize("scheduling", ["static", "continuous"])
def test_records_and_steps_agree_with_the_engines_trace(base, scheduling):
    room = make_room(scheduling=scheduling, max_num_seqs=2)
    students, prompts = workload(base)
    try:
        run(room, base, students, prompts)
        steps = list(room.steps)
        assert [s["step"] for s in steps] == list(range(room.num_steps))
        # every slot names a record the room holds: a finished request's last and idle slots too
        named = [c for s in steps for c in s["slots"] if c]
        assert all(c["request"] in room.records and c["student"] == room.records[c["request"]].student
                   for c in named)
        for record, (student, max_tokens) in zip(room.records.values(), students):
            assert record.student == student and record.generated_tokens == max_tokens
            mine = [c for s in steps for c in s["slots"] if c and c["request"] == record.id]
            assert sum(c["num_tokens"] for c in mine if c["kind"] == "prefill") == 8
            assert sum(1 for c in mine if c["kind"] == "decode") == max_tokens - 1
            assert record.prefill_chunk == record.prefill_chunks == 1 and record.ttft_s > 0
        assert room.busy_sum == sum(sum(1 for c in s["slots"] if c and c["kind"] != "idle") for s in steps)
        assert base.view.num_steps == 0                     # the server's engine did none of it
    finally:
        room.close()


def test_static_batching_holds_idle_slots_that_continuous_refills(base):
    idle = {}
    for scheduling in ("static", "continuous"):
        room = make_room(scheduling=scheduling, max_num_seqs=2)
        students, prompts = workload(base)
        try:
            run(room, base, students, prompts)
            idle[scheduling] = sum(1 for s in room.steps for c in s["slots"] if c and c["kind"] == "idle")
        finally:
            room.close()
    # static: Ada (2 tokens) waits idle beside Grace (12); continuous gives her slot to Alan at once
    assert idle["static"] > 0 and idle["continuous"] == 0


def test_an_engine_setting_gives_new_requests_a_new_engine_and_the_old_one_drains(base):
    room = make_room(max_num_seqs=2)
    ids = base.tokenizer.encode(PASSAGE)[:8]
    try:
        room.apply(updated(room.settings, {"max_tokens": 30}, 64))
        first, seq, rec = room.prepare(base, "Ada", ids, SamplingParams(temperature=0.0, ignore_eos=True))
        room.enqueue(first, seq, rec)
        room.apply(updated(room.settings, {"scheduling": "static", "max_num_seqs": 3}, 64))
        assert room.draining == [first] and room.engine is None
        second, seq, rec2 = room.prepare(base, "Grace", ids, SamplingParams(temperature=0.0, ignore_eos=True))
        room.enqueue(second, seq, rec2)
        assert second is not first and second.generation == first.generation + 1
        assert second.loop.engine.view.config.scheduling.value == "static"
        assert second.loop.engine.view.config.max_num_seqs == 3
        wait_for(lambda: not room.busy(), timeout=120, what="both requests")
        room.tick(time.monotonic())
        assert room.draining == [] and not first.loop.alive and room.engine is second
        assert {s["engine"] for s in room.steps} == {first.generation, second.generation}
    finally:
        room.close()


def test_the_rooms_rules(base):
    room = make_room(max_num_seqs=2)
    ids = base.tokenizer.encode(PASSAGE)[:8]
    try:
        room.apply(updated(room.settings, {"paused": True}, 64))
        with pytest.raises(InvalidParameter) as err:
            room.prepare(base, "Ada", ids, SamplingParams())
        assert err.value.code == "room_paused"
        room.apply(updated(room.settings, {"paused": False, "max_tokens": 20}, 64))
        engine, seq, rec = room.prepare(base, "Ada", ids, SamplingParams(temperature=0.0, max_tokens=5))
        assert seq.params.max_tokens == 20                  # the teacher's max_tokens, for everyone
        room.enqueue(engine, seq, rec)
        with pytest.raises(InvalidParameter) as err:
            room.prepare(base, "Ada", ids, SamplingParams())
        assert err.value.code == "room_limit" and err.value.param == "one_at_a_time"
        wait_for(lambda: not room.busy(), timeout=60, what="Ada's request")
        room.clear()
        assert not room.records and not room.steps and room.num_steps == 0
        # the settings log starts again with the new session: the settings in force, at step 0
        assert [(e["step"], e["settings"]) for e in room.settings_log] == [(0, room.settings.as_dict())]
    finally:
        room.close()


def test_settings_are_checked_by_name():
    s = defaults(64)
    assert isinstance(s, RoomSettings) and s.max_tokens == 64
    assert defaults(16).max_tokens == 16
    for changes, param in (({"max_num_seqs": 65}, "max_num_seqs"), ({"max_num_seqs": True}, "max_num_seqs"),
                           ({"scheduling": "lifo"}, "scheduling"), ({"max_tokens": 0}, "max_tokens"),
                           ({"chunked_prefill": 1}, "chunked_prefill"), ({"nope": 1}, "nope"), ([], "settings")):
        with pytest.raises(InvalidParameter) as err:
            updated(s, changes, 64)
        assert err.value.param == param
    assert updated(s, {"scheduling": "static"}, 64).changes_engine(s)
    assert not updated(s, {"paused": True, "max_tokens": 3}, 64).changes_engine(s)


def test_an_idle_engine_is_stopped_and_the_next_request_starts_another(base):
    from app.rooms.room import ENGINE_IDLE_S
    room = make_room()
    ids = base.tokenizer.encode(PASSAGE)[:8]
    try:
        run(room, base, [("Ada", 2)], [ids])
        engine = room.engine
        room.tick(time.monotonic())
        assert room.engine is engine and engine.loop.alive
        room.tick(time.monotonic() + ENGINE_IDLE_S + 1)
        assert room.engine is None and not engine.loop.alive
        run(room, base, [("Grace", 2)], [ids])
        assert room.engine.generation == engine.generation + 1
        assert [s["step"] for s in room.steps] == list(range(room.num_steps))
    finally:
        room.close()


def test_each_settings_change_is_logged_with_the_step_it_applied_at(base):
    room = make_room(max_num_seqs=2)
    students, prompts = workload(base)
    try:
        run(room, base, students[:2], prompts[:2])
        before = room.num_steps
        room.apply(updated(room.settings, {"scheduling": "static"}, 64))
        run(room, base, students[2:], prompts[2:])
        changes = [e for e in room.settings_log if e["settings"]["scheduling"] == "static"]
        assert before > 0 and changes[0]["step"] == before
        assert all(s["engine"] > 0 for s in list(room.steps)[before:])   # the new engine drew from there
    finally:
        room.close()


def test_a_server_shutting_down_aborts_the_rooms_requests_at_once(base, tmp_path):
    """SIGTERM (app/__main__.py) ends the room engines' requests too, each with its abort, before
    any connection's reader looks (Registry.abort_all)."""
    from app.rooms.registry import Registry
    from app.rooms.store import Store

    config = ServerConfig(model="tiny", room_kv_blocks=64, max_tokens_limit=64, default_max_tokens=8)
    registry = Registry(config, Store(tmp_path / "rooms.sqlite"), base)
    room = make_room(max_tokens=64)
    registry.rooms[room.code] = room
    try:
        engine, seq, record = room.prepare(base, "Ada", base.tokenizer.encode(PASSAGE)[:8],
                                           SamplingParams(temperature=0.0, ignore_eos=True))
        gate = threading.Event()
        engine.loop.call(lambda e: gate.wait(30))      # hold the room's loop: the request waits
        room.enqueue(engine, seq, record)
        registry.abort_all()
        gate.set()
        wait_for(lambda: record.state == RequestState.ABORTED, timeout=30, what="the aborted request")
        assert record.finish_reason == "abort" and record.generated_tokens < 64
    finally:
        room.close()
        registry.shutdown()
