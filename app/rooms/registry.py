"""The open rooms: created, found, rate-limited, written to the store, and closed when idle.

One Registry per app (app.extensions["sendlens_rooms"]). It holds at most `room_max_rooms` open
rooms, counts join attempts per client address (`room_join_rate_per_minute`, a sliding window),
and runs one ticker thread that, ten times a second, pushes `room_update`s to watchers
(updates.py), writes finished records and new step rows to the store, stops idle engines, and
closes a room idle for `room_idle_close_s`. On start it reloads every open room from the store,
so a restarted server keeps its rooms, members, records and steps.

Behind a balancer, a replica's rooms have codes that start with its symbol (app/replicas.py),
and each code is claimed in the shared routes (app/shared/routes.py) before it is used, so no
two replicas hand out one code.
"""

import itertools
import logging
import threading
import time
from collections import defaultdict, deque

from ..clients import Seat
from . import codes, settings as room_settings
from .errors import RoomError, not_found
from .records import FINAL, Record, RequestState, busy_slots
from .room import KEEP_STEPS, Room, RoomState
from .store import Store
from .updates import Watcher, build

log = logging.getLogger(__name__)

TICK_S = 0.1               # at most 10 updates a second per watcher
JOIN_WINDOW_S = 60.0


class Registry:
    def __init__(self, config, store: Store, base_engine, routes=None):
        """routes: the deployment's rooms' routes (app/shared/routes.py); None: this registry's own."""
        from ..replicas import code_symbol
        from ..shared.routes import LocalRoutes
        self.config, self.store, self.base_engine = config, store, base_engine
        self.routes = routes if routes is not None else LocalRoutes()
        self.symbol = code_symbol(config.replica_id)     # the first symbol of this replica's codes
        self.rooms: dict[str, Room] = {}
        self.lock = threading.Lock()
        self.joins: dict[str, deque] = defaultdict(deque)   # address -> times of its join attempts
        self._stop = threading.Event()
        self.load()
        self._thread = threading.Thread(target=self._run, name="sendlens-rooms", daemon=True)
        self._thread.start()

    # -- rooms -------------------------------------------------------------------------------
    def create(self) -> Room:
        with self.lock:
            if len(self.rooms) >= self.config.room_max_rooms:
                raise RoomError("room_limit", "room", f"{self.config.room_max_rooms} rooms are already open "
                                                      "(room_max_rooms); close one or try later")
            code = codes.new_code(self.symbol)
            while code in self.rooms or self.store.room(code) is not None or \
                    not self.routes.claim(code, self.config.replica_id):
                code = codes.new_code(self.symbol)
            room = Room(code, codes.new_secret(), room_settings.defaults(self.config.max_tokens_limit),
                        self.config, time.time())
            self.store.add_room(code, room.presenter_key, room.settings.as_dict(), room.state.value)
            self.rooms[code] = room
        return room

    def get(self, text) -> Room:
        """An open room by its code as typed; room_not_found otherwise (never saying why)."""
        code = codes.normalize_code(text)
        room = self.rooms.get(code) if code else None
        if room is None or room.state != RoomState.OPEN:
            raise not_found()
        return room

    def recorded(self, text) -> dict | None:
        """A room open or closed, as stored (for the export of a finished session)."""
        code = codes.normalize_code(text)
        return self.store.room(code) if code else None

    def join(self, room: Room, text, address: str) -> tuple[str, str]:
        """Add a student: -> (token, name). Raises with the parameter named."""
        name = room.check_join(text)
        token = codes.new_secret()
        with room.lock:
            room.check_join(name)             # again under the lock: two joins at once with one name
            self.store.add_member(room.code, name, token)
            room.add_member(token, name)
        return token, name

    def member_of(self, cookies: dict, wanted=None):
        """The (room, display name) a websocket handshake's student cookies make it a member of;
        wanted: a code (the page's ?room=) when a browser has joined several rooms. None if none."""
        found = None
        for key, token in cookies.items():
            if not key.startswith("sendlens_student_"):
                continue
            code = codes.normalize_code(key[len("sendlens_student_"):])
            room = self.rooms.get(code) if code else None
            name = room.member(token) if room else None
            if name is not None and (wanted is None or codes.normalize_code(wanted) == code):
                found = (room, name)
        return found

    def seat(self, room) -> Seat:
        """The seat a room student's websocket counts against (app/clients.py): the room, not the
        address, since a classroom shares one. Two per student: a reload's new socket may open
        before the old one has closed."""
        return Seat(f"room:{room.code}", 2 * self.config.room_max_students, "room_max_students")

    def allow_join(self, address: str) -> bool:
        """Count a join attempt from `address`; False once it passes the rate per minute."""
        now = time.monotonic()
        with self.lock:
            times = self.joins[address]
            while times and now - times[0] > JOIN_WINDOW_S:
                times.popleft()
            if len(times) >= self.config.room_join_rate_per_minute:
                return False
            times.append(now)
            return True

    def watch(self, room: Room, conn, mid) -> None:
        with room.lock:
            room.watchers[(conn, mid)] = Watcher(conn, mid)

    def unwatch(self, conn) -> None:
        for room in list(self.rooms.values()):
            with room.lock:
                for key in [k for k in room.watchers if k[0] is conn]:
                    del room.watchers[key]

    # -- restart survival --------------------------------------------------------------------
    def load(self) -> None:
        for stored in self.store.rooms(RoomState.OPEN.value):
            s = room_settings.from_stored(stored["settings"], self.config.max_tokens_limit)
            room = Room(stored["code"], stored["presenter_key"], s, self.config, stored["created_at"])
            room.last_active = stored["last_active"]
            for m in self.store.members(room.code):
                room.members[m["token"]] = m["name"]
            for d in self.store.records(room.code):
                record = Record.from_dict(d)
                if record.state not in FINAL:     # in flight when the server stopped
                    record.state = RequestState.ABORTED
                room.records[record.id] = record
            room.ids = itertools.count(1 + max((int(r[1:]) for r in room.records), default=-1))
            if not self.routes.claim(room.code, self.config.replica_id):
                log.error("room %s is claimed by replica %s, not this one (%r): two replicas share an id "
                          "or a rooms_db_path", room.code, self.routes.owner(room.code), self.config.replica_id)
            steps = self.store.steps(room.code)
            room.num_steps = steps[-1]["step"] + 1 if steps else 0
            room.busy_sum = sum(busy_slots(s) for s in steps)
            room.steps.extend(steps[-KEEP_STEPS:])
            self.rooms[room.code] = room

    # -- the ticker --------------------------------------------------------------------------
    def _run(self) -> None:
        last_housekeeping = 0.0
        while not self._stop.wait(TICK_S):
            try:
                self.push()
                now = time.monotonic()
                if now - last_housekeeping >= 1.0:
                    last_housekeeping = now
                    self.save()
                    self.housekeep()
            except Exception:
                log.exception("rooms ticker failed")

    def push(self) -> None:
        for room in list(self.rooms.values()):
            with room.lock:
                watchers = list(room.watchers.items())
            for key, watcher in watchers:
                if watcher.gone:
                    with room.lock:
                        room.watchers.pop(key, None)
                    continue
                update = build(room, watcher)
                if update is not None:
                    watcher.sent += 1
                    watcher.conn.send({"type": "room_update", "id": watcher.id, **update})

    def save(self) -> None:
        """Write finished records, new steps and changed settings (off the engine's thread)."""
        for room in list(self.rooms.values()):
            with room.lock:
                records = [r.as_dict() for r in room.unsaved_records.values()]
                steps, dirty, log_entries = room.unsaved_steps, room.dirty, room.settings_log
                room.unsaved_records, room.unsaved_steps, room.dirty, room.settings_log = {}, [], False, []
                cleared = getattr(room, "cleared_unsaved", False)
                room.cleared_unsaved = False
                settings, state, active = room.settings.as_dict(), room.state.value, room.last_active
            if cleared:
                self.store.clear(room.code)
            if records:
                self.store.add_records(room.code, records)
            if steps:
                self.store.add_steps(room.code, steps)
            if log_entries:
                self.store.log_settings(room.code, log_entries)
            if dirty or records:
                self.store.save_room(room.code, settings, state, active)

    def housekeep(self) -> None:
        now = time.time()
        for room in list(self.rooms.values()):
            room.tick(time.monotonic())
            if room.watchers or room.busy():
                room.last_active = now
            elif now - room.last_active > self.config.room_idle_close_s:
                self.close(room)

    def close(self, room: Room) -> None:
        room.close()
        self.save()
        with self.lock:
            self.rooms.pop(room.code, None)

    def abort_all(self) -> None:
        """Every room engine's requests end now, each with its `abort` (a server shutting down)."""
        # no self.lock: this runs in the SIGTERM handler (app/__main__.py), between two bytecodes of
        # whatever the main thread was doing, which may hold it; list() copies the dict under the GIL
        for room in list(self.rooms.values()):
            with room.lock:
                engines = [e for e in [room.engine, *room.draining] if e is not None]
            for engine in engines:
                engine.loop.abort_all()

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for room in list(self.rooms.values()):
            with room.lock:
                engines = [e for e in [room.engine, *room.draining] if e is not None]
            for engine in engines:
                engine.shutdown()
        self.save()
        self.store.close()
