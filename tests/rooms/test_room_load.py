"""bench.load --room: students join a room over HTTP and chat on its engine, briefly (tiny model)."""

import pytest

from bench import load

from .rooms_server import new_room, start


@pytest.fixture
def srv(tiny_loaded, tmp_path):
    server = start(tiny_loaded, tmp_path / "rooms.sqlite3")
    yield server
    server.stop()


def test_a_short_room_loses_nothing_and_its_watcher_is_updated(srv):
    code, _ = new_room(srv)
    report = load.run(srv.ws, clients=4, seconds=2, max_tokens=8, drop=False, room=code)
    assert report["sent"] >= 4 and report["lost"] == 0 and report["errors"] == {}
    assert report["completed"] == report["sent"]
    assert 0 < report["room_updates_per_s"] <= 10 * 1.5      # pushed at most ten a second (a tick may run late)
    room = srv.rooms.get(code)
    assert len(room.members) == 4 and len(room.records) == report["sent"]
    assert {r.student for r in room.records.values()} == {f"student-{i}" for i in range(1, 5)}
    # the server's own engine did none of it
    assert report["server_after"]["kv"]["free_blocks"] == report["server_before"]["kv"]["free_blocks"]
    assert srv.app.extensions["sendlens"].loop.stats()["steps"] == 0
