"""The rooms' SQLite file: rooms, their members, finished requests' records and step traces.

Python's sqlite3 on one file (setting `rooms_db_path`, by default <cache dir>/rooms.sqlite3) in
WAL mode, so a reader (an export) never waits on the writer. One connection, shared by the
server's threads behind a lock; every write is its own short transaction. Records and step rows
are stored as JSON text, exactly the dicts the export and the room's updates carry, so a
restarted server (Store.load) gives back the same room: settings, members, records and steps.
"""

import json
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS rooms (
    code TEXT PRIMARY KEY, presenter_key TEXT NOT NULL, created_at REAL NOT NULL,
    settings TEXT NOT NULL, state TEXT NOT NULL, last_active REAL NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    token TEXT PRIMARY KEY, code TEXT NOT NULL, name TEXT NOT NULL, joined_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS members_by_room ON members (code);
CREATE TABLE IF NOT EXISTS requests (
    code TEXT NOT NULL, id TEXT NOT NULL, student TEXT NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (code, id));
CREATE TABLE IF NOT EXISTS settings_log (
    code TEXT NOT NULL, at REAL NOT NULL, settings TEXT NOT NULL, step INTEGER);
CREATE TABLE IF NOT EXISTS steps (
    code TEXT NOT NULL, step INTEGER NOT NULL, row TEXT NOT NULL, PRIMARY KEY (code, step));
"""


def default_path(cache_dir: str | None, replica_id: str = "") -> Path:
    """<cache dir>/rooms.sqlite3; a replica's own file, rooms-<id>.sqlite3, when `replica_id` is set
    (replicas on one machine must not load each other's rooms)."""
    from toy_models.registry import default_cache_dir
    name = f"rooms-{replica_id}.sqlite3" if replica_id else "rooms.sqlite3"
    return (Path(cache_dir) if cache_dir else default_cache_dir()) / name


class Store:
    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Bring a file written by an older version up to SCHEMA, keeping its rooms: settings_log
        gained `step` (the room's steps done when a change applied; NULL in old rows)."""
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(settings_log)")]
        if "step" not in columns:
            self._db.execute("ALTER TABLE settings_log ADD COLUMN step INTEGER")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, rows) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(sql, rows)
                self._db.execute("COMMIT")
            except Exception:
                self._db.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args=()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- rooms -------------------------------------------------------------------------------
    def add_room(self, code: str, presenter_key: str, settings: dict, state: str) -> None:
        now = time.time()
        self._write("INSERT INTO rooms VALUES (?, ?, ?, ?, ?, ?)",
                    [(code, presenter_key, now, json.dumps(settings), state, now)])
        self.log_settings(code, [{"at": now, "step": 0, "settings": settings}])

    def save_room(self, code: str, settings: dict, state: str, last_active: float) -> None:
        self._write("UPDATE rooms SET settings = ?, state = ?, last_active = ? WHERE code = ?",
                    [(json.dumps(settings), state, last_active, code)])

    def log_settings(self, code: str, entries: list[dict]) -> None:
        """entries: {"at": wall clock, "step": the room's steps done when it applied, "settings"}."""
        self._write("INSERT INTO settings_log (code, at, settings, step) VALUES (?, ?, ?, ?)",
                    [(code, e["at"], json.dumps(e["settings"]), e.get("step")) for e in entries])

    def settings_log(self, code: str) -> list[dict]:
        """The room's settings changes in order, each with its step (an entry written before the
        step was kept has none, except the first: the room's start, step 0)."""
        rows = self._read("SELECT at, settings, step FROM settings_log WHERE code = ? ORDER BY rowid", (code,))
        log = []
        for i, (at, settings, step) in enumerate(rows):
            entry = {"at": at, "settings": json.loads(settings)}
            if step is not None or i == 0:
                entry["step"] = step or 0
            log.append(entry)
        return log

    def room(self, code: str) -> dict | None:
        rows = self._read("SELECT code, presenter_key, created_at, settings, state, last_active "
                          "FROM rooms WHERE code = ?", (code,))
        return _room(rows[0]) if rows else None

    def rooms(self, state: str | None = None) -> list[dict]:
        sql = "SELECT code, presenter_key, created_at, settings, state, last_active FROM rooms"
        rows = self._read(sql + " WHERE state = ?", (state,)) if state else self._read(sql)
        return [_room(r) for r in rows]

    # -- members -----------------------------------------------------------------------------
    def add_member(self, code: str, name: str, token: str) -> None:
        self._write("INSERT INTO members VALUES (?, ?, ?, ?)", [(token, code, name, time.time())])

    def members(self, code: str) -> list[dict]:
        rows = self._read("SELECT token, name, joined_at FROM members WHERE code = ? ORDER BY joined_at, rowid",
                          (code,))
        return [{"token": t, "name": n, "joined_at": j} for t, n, j in rows]

    # -- records and steps -------------------------------------------------------------------
    def add_records(self, code: str, records: list[dict]) -> None:
        self._write("INSERT OR REPLACE INTO requests VALUES (?, ?, ?, ?)",
                    [(code, r["id"], r["student"], json.dumps(r)) for r in records])

    def records(self, code: str) -> list[dict]:
        return [json.loads(r) for (r,) in self._read("SELECT record FROM requests WHERE code = ? ORDER BY rowid",
                                                     (code,))]

    def add_steps(self, code: str, steps: list[dict]) -> None:
        self._write("INSERT OR REPLACE INTO steps VALUES (?, ?, ?)",
                    [(code, s["step"], json.dumps(s)) for s in steps])

    def steps(self, code: str, last: int | None = None) -> list[dict]:
        """The room's steps in order; last: only that many of the newest."""
        if last is None:
            rows = self._read("SELECT row FROM steps WHERE code = ? ORDER BY step", (code,))
        else:
            rows = self._read("SELECT row FROM (SELECT step, row FROM steps WHERE code = ? ORDER BY step DESC "
                              "LIMIT ?) ORDER BY step", (code, last))
        return [json.loads(r) for (r,) in rows]

    def num_steps(self, code: str) -> int:
        return self._read("SELECT COALESCE(MAX(step) + 1, 0) FROM steps WHERE code = ?", (code,))[0][0]

    def clear(self, code: str) -> None:
        """Forget a room's records, steps and settings log (its members stay; the room logs its
        settings again, at step 0 of the new session)."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM requests WHERE code = ?", (code,))
            self._db.execute("DELETE FROM steps WHERE code = ?", (code,))
            self._db.execute("DELETE FROM settings_log WHERE code = ?", (code,))
            self._db.execute("COMMIT")


def _room(row: tuple) -> dict:
    code, key, created, settings, state, last_active = row
    return {"code": code, "presenter_key": key, "created_at": created, "settings": json.loads(settings),
            "state": state, "last_active": last_active}
