"""A live room: its members, settings, request records and step trace, and its engine.

A Room is what one teacher opened: students join it by name (names.py) and get a token; their
`generate` requests run on the room's own engine (room_engine.py) under the room's rules
(paused, one request at a time, max_tokens, requests per student); every change bumps the room's
`seq`, and watchers (messages.py) are sent what changed since the seq they last saw. Finished
records and step rows are written to the store by the registry's ticker (never on the engine's
thread). All state is guarded by one lock; the engine's thread holds it only to copy a snapshot in.
"""

import itertools
import threading
import time
from collections import deque
from enum import Enum

from . import names
from .errors import RoomError
from .records import FINAL, Record, RequestState, busy_slots, step_row
from .room_engine import RoomEngine
from .settings import RoomSettings

KEEP_STEPS = 1000          # step rows kept in memory (all of them are in the store)
FULL_STEPS = 200           # steps in a watcher's first (full) update
ENGINE_IDLE_S = 30.0       # an engine with nothing to do this long is stopped (its KV pool freed)


class RoomState(str, Enum):
    OPEN = "open"
    CLOSED = "closed"


class Room:
    def __init__(self, code: str, presenter_key: str, settings: RoomSettings, config, created_at: float,
                 state: RoomState = RoomState.OPEN):
        self.code, self.presenter_key, self.settings, self.config = code, presenter_key, settings, config
        self.created_at = created_at
        self.state = state
        self.lock = threading.RLock()
        self.members: dict[str, str] = {}            # student token -> display name, in joining order
        self.records: dict[str, Record] = {}         # record id -> Record, in sending order
        self.steps: deque[dict] = deque(maxlen=KEEP_STEPS)
        self.num_steps = 0                           # the room's steps so far (its own count)
        self.busy_sum = 0                            # requests served per step, summed over the steps
        self.kv_by_student: dict[str, int] = {}
        self.seq = 0
        self.engine: RoomEngine | None = None
        self.draining: list[RoomEngine] = []         # old engines finishing their requests
        self.generations = itertools.count()
        self.ids = itertools.count()
        self.unsaved_records: dict[str, Record] = {}
        self.unsaved_steps: list[dict] = []
        self.watchers: dict = {}                     # (connection, message id) -> seq last sent (-1: none)
        self.last_active = time.time()
        self.dirty = False                           # settings or state to write
        self.settings_log: list[dict] = []           # settings changes not yet written

    # -- members -----------------------------------------------------------------------------
    def check_join(self, text) -> str:
        with self.lock:
            if len(self.members) >= self.config.room_max_students:
                raise RoomError("room_full", "room", f"the room already has {self.config.room_max_students} "
                                                     "students (room_max_students)")
            return names.validate_name(text, self.members.values())

    def add_member(self, token: str, name: str) -> None:
        with self.lock:
            self.members[token] = name
            self._changed()

    def member(self, token) -> str | None:
        return self.members.get(token) if isinstance(token, str) else None

    # -- requests ----------------------------------------------------------------------------
    def admit(self, student: str) -> None:
        """The room's rules for one more request from `student` (named errors)."""
        s, c = self.settings, self.config
        if self.state != RoomState.OPEN:
            raise RoomError("room_not_found", "room", "no open room has this code")
        if s.paused:
            raise RoomError("room_paused", "room", "the teacher has paused sending; wait for them to resume")
        mine = [r for r in self.records.values() if r.student == student]
        if s.one_at_a_time and any(r.state not in FINAL for r in mine):
            raise RoomError("room_limit", "one_at_a_time", "one request at a time in this room: wait for your "
                                                          "answer to finish")
        if len(mine) >= c.room_max_requests_per_student:
            raise RoomError("room_limit", "room", f"you have sent {c.room_max_requests_per_student} requests "
                                                  "in this room (room_max_requests_per_student)")

    def ready(self, base_engine, student: str) -> None:
        """The room's rules for one more request from `student` (named errors), and its engine
        started: for a request whose prompt is tokenized before prepare() (which checks again)."""
        with self.lock:
            self.admit(student)
            self._engine(base_engine)

    def prepare(self, base_engine, student: str, prompt, params) -> tuple[RoomEngine, object, Record]:
        """Admit one request under the room's rules and validate it on the room's engine.
        -> (engine, the engine's Sequence, its record); enqueue() then starts it."""
        with self.lock:
            self.admit(student)
            params.max_tokens = self.settings.max_tokens       # the teacher's max_tokens, for everyone
            engine = self._engine(base_engine)
            seq = engine.loop.prepare(prompt, params)
            record = Record(f"r{next(self.ids)}", student, seq.num_prompt_tokens, engine.generation, seq.request_id)
            engine.records[seq.request_id] = engine.known[seq.request_id] = record
            self.records[record.id] = record
            self.last_active = time.time()
            self._changed(record)
        return engine, seq, record

    def forget(self, record: Record, engine: RoomEngine) -> None:
        """A prepared request that was not enqueued after all (the connection refused it)."""
        with self.lock:
            engine.records.pop(record.engine_request_id, None)
            engine.known.pop(record.engine_request_id, None)
            self.records.pop(record.id, None)
            self._changed()

    def enqueue(self, engine: RoomEngine, seq, record: Record, listener=None) -> None:
        """Start a prepared request; listener(out), if given, sees each output after the record."""
        def on_output(out) -> None:                            # on the engine's thread
            engine.observe()                                   # the step that made this output first
            with self.lock:
                record.saw_output(out)
                if out.finished:
                    engine.records.pop(out.request_id, None)
                    engine.last_busy = time.monotonic()
                    if record.id in self.records:
                        self.unsaved_records[record.id] = record
                self._changed(record)
            if listener is not None:
                listener(out)
        engine.loop.enqueue(seq, on_output)

    def _engine(self, base_engine) -> RoomEngine:
        if self.engine is None:
            self.engine = RoomEngine(base_engine, self.settings, self.config.room_kv_blocks, next(self.generations),
                                     self.config.max_queue, self._saw_steps)
        return self.engine

    def _saw_steps(self, engine: RoomEngine, traces, block_tables) -> None:
        """New trace rows of one of the room's engines (on its loop's thread)."""
        with self.lock:
            for trace in traces:
                row = step_row(trace, self.num_steps, engine.generation, engine.known)
                for work in trace.slots:
                    record = work and engine.known.get(work.request_id)
                    if record and record.saw_step(work.kind, work.num_tokens, engine.step_budget):
                        self._changed(record)
                self.num_steps += 1
                self.busy_sum += busy_slots(row)
                self.steps.append(row)
                self.unsaved_steps.append(row)
            kv: dict[str, int] = {}
            for table in block_tables:
                record = engine.records.get(table["request_id"])
                if record:
                    kv[record.student] = kv.get(record.student, 0) + len(table["blocks"])
            self.kv_by_student = kv
            self._changed()

    def _changed(self, record: Record | None = None) -> None:
        self.seq += 1
        if record is not None:
            record.version = self.seq

    # -- the teacher's controls --------------------------------------------------------------
    def apply(self, settings: RoomSettings) -> None:
        with self.lock:
            if settings.changes_engine(self.settings) and self.engine is not None:
                self.draining.append(self.engine)       # it finishes what it holds; new requests get a new one
                self.engine = None
            self.settings = settings
            self.settings_log.append({"at": time.time(), "step": self.num_steps, "settings": settings.as_dict()})
            self.dirty = True
            self._changed()

    def clear(self) -> None:
        """Abort what runs, forget every record, step and settings change; the members stay, and
        the settings log starts again from the settings in force, at step 0."""
        with self.lock:
            for engine in [self.engine, *self.draining]:
                if engine is not None:
                    engine.abort_all()
                    engine.records.clear()
                    engine.known.clear()
            self.records.clear()
            self.steps.clear()
            self.unsaved_records.clear()
            self.unsaved_steps.clear()
            self.num_steps = self.busy_sum = 0
            self.kv_by_student = {}
            self.cleared_at = self.seq + 1
            self.cleared_unsaved = True
            # the session starts again at step 0: its settings log too (the store forgets the old one)
            self.settings_log = [{"at": time.time(), "step": 0, "settings": self.settings.as_dict()}]
            self._changed()

    # -- housekeeping (the registry's ticker) ----------------------------------------------------
    def tick(self, now: float) -> None:
        """Stop engines that have been idle a while (their KV pools go back)."""
        with self.lock:
            stop = [e for e in self.draining if not e.busy]
            self.draining = [e for e in self.draining if e.busy]
            if self.engine is not None and not self.engine.busy and now - self.engine.last_busy > ENGINE_IDLE_S:
                stop.append(self.engine)
                self.engine = None
        for engine in stop:
            engine.shutdown()

    def busy(self) -> bool:
        with self.lock:
            return any(e.busy for e in [self.engine, *self.draining] if e is not None)

    def close(self) -> None:
        with self.lock:
            self.state = RoomState.CLOSED
            engines = [e for e in [self.engine, *self.draining] if e is not None]
            self.engine, self.draining = None, []
            self.watchers.clear()
            self.dirty = True
        for engine in engines:
            engine.abort_all()
            engine.shutdown()
