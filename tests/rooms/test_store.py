"""The rooms' SQLite store: WAL, and everything written comes back the same after a reopen."""

import sqlite3

from app.rooms.store import Store


def test_the_store_is_wal_and_gives_back_what_it_kept(tmp_path):
    path = tmp_path / "rooms.sqlite3"
    store = Store(path)
    store.add_room("ABCDEFGH", "key", {"paused": False}, "open")
    store.add_member("ABCDEFGH", "Ada", "t1")
    store.add_member("ABCDEFGH", "Grace", "t2")
    store.add_records("ABCDEFGH", [{"id": "r0", "student": "Ada", "state": "done"}])
    store.add_steps("ABCDEFGH", [{"step": 0, "slots": [None]}, {"step": 1, "slots": []}])
    store.log_settings("ABCDEFGH", [{"at": 1.0, "settings": {"paused": True}}])
    store.save_room("ABCDEFGH", {"paused": True}, "open", 5.0)
    store.close()
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    again = Store(path)
    room = again.room("ABCDEFGH")
    assert room["presenter_key"] == "key" and room["settings"] == {"paused": True} and room["last_active"] == 5.0
    assert [r["code"] for r in again.rooms("open")] == ["ABCDEFGH"] and again.rooms("closed") == []
    assert [m["name"] for m in again.members("ABCDEFGH")] == ["Ada", "Grace"]
    assert again.records("ABCDEFGH") == [{"id": "r0", "student": "Ada", "state": "done"}]
    assert [s["step"] for s in again.steps("ABCDEFGH")] == [0, 1]
    assert [s["step"] for s in again.steps("ABCDEFGH", last=1)] == [1]
    assert again.num_steps("ABCDEFGH") == 2
    assert [e["settings"] for e in again.settings_log("ABCDEFGH")] == [{"paused": False}, {"paused": True}]
    again.clear("ABCDEFGH")
    assert again.records("ABCDEFGH") == [] and again.steps("ABCDEFGH") == []
    assert len(again.members("ABCDEFGH")) == 2
    assert again.room("NOSUCHRM") is None
