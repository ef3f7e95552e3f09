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
    store.log_settings("ABCDEFGH", [{"at": 1.0, "step": 7, "settings": {"paused": True}}])
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
    assert [e["step"] for e in again.settings_log("ABCDEFGH")] == [0, 7]
    again.clear("ABCDEFGH")
    assert again.records("ABCDEFGH") == [] and again.steps("ABCDEFGH") == [] and again.settings_log("ABCDEFGH") == []
    assert len(again.members("ABCDEFGH")) == 2
    assert again.room("NOSUCHRM") is None


def test_a_store_from_before_settings_steps_is_migrated_keeping_its_rooms(tmp_path):
    path = tmp_path / "rooms.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE rooms (code TEXT PRIMARY KEY, presenter_key TEXT NOT NULL, created_at REAL NOT NULL,
            settings TEXT NOT NULL, state TEXT NOT NULL, last_active REAL NOT NULL);
        CREATE TABLE settings_log (code TEXT NOT NULL, at REAL NOT NULL, settings TEXT NOT NULL);
        INSERT INTO rooms VALUES ('ABCDEFGH', 'key', 1.0, '{"paused": false}', 'open', 2.0);
        INSERT INTO settings_log VALUES ('ABCDEFGH', 1.0, '{"paused": false}');
        INSERT INTO settings_log VALUES ('ABCDEFGH', 3.0, '{"paused": true}');""")
    old.commit()
    old.close()

    store = Store(path)
    assert store.room("ABCDEFGH")["presenter_key"] == "key"
    store.log_settings("ABCDEFGH", [{"at": 4.0, "step": 12, "settings": {"paused": False}}])
    log = store.settings_log("ABCDEFGH")
    assert [e.get("step") for e in log] == [0, None, 12]
    assert [e["at"] for e in log] == [1.0, 3.0, 4.0]
