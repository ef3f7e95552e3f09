"""The live-data websocket (/ws): transport only. One Connection per browser, all feeding one engine.

A Connection reads frames, checks the envelope (app/protocol.py), enforces the per-connection
limits and dispatches each message to the widget that registered its type (app/widgets). A
writer thread owns every send, so engine outputs, job results and errors never interleave on the
wire; the engine loop's thread only puts items in the connection's outbox and never waits on a
browser. When a browser goes away, its requests are aborted (their KV blocks freed) and its jobs
dropped.

Handlers answer through a Call: `reply` at once, `job` through the job runner, or `submit` for
an engine request and the stream of its outputs (the one way a request enters the engine: it is
checked, admitted and enqueued in one place, Connection.start_request). A request whose prompt
is too long to tokenize here is tokenized by the job runner first (app/prompt_job.py), counted
against the connection's requests meanwhile. `abort` {id} is the transport's own message: it
stops any of them.

Every message is priced by its work, in tokens, against the connection's budget (app/budget.py):
an estimate from the message's text before its handler runs, settled to what the handler charged
when it returns (or, for work a handler hands to a job, when the job has counted it). Work of
more than one slice (`work_slice_tokens`: the estimate of what the message's text tokenizes to)
never runs on the reader's thread beside the engine: `Call.inline()` says which side it is on.

The limits a connection keeps (app/config.py): messages per second (a token bucket), requests,
jobs and prompt tokens in flight, and bytes queued for a client that does not read (past that it
is cut off). The writer pings a quiet client and cuts off one that misses a ping (a closed lid);
the reader closes a connection idle for `idle_timeout_s` (code 4000) and notices a socket the
library closed (an oversized frame) or a server shutting down.
"""

import inspect
import json
import logging
import queue
import socket
import threading
import time
from collections import ChainMap

from flask import Blueprint, current_app, request
from flask_sock import Sock
from simple_websocket import ConnectionClosed
from wsproto.events import Ping

from core.errors import EngineOverloaded, InvalidParameter
from core.model.tokenizer import drain

from . import protocol
from .budget import WorkBudget, message_estimate, request_cost, tokenizing_estimate
from .jobs import Event
from .prompt_job import Withdrawn, start_tokenizing
from .protocol import ProtocolError, error_reply
from .rooms import messages as room_messages
from .runtime import Runtime, get_runtime
from .widgets import MESSAGE_TYPES as WIDGET_TYPES

# the widgets' message types, then the rooms' (a live view: a test may add a type to the widgets')
MESSAGE_TYPES = ChainMap(WIDGET_TYPES, {m.type: m for m in room_messages.MESSAGES})

log = logging.getLogger(__name__)

bp = Blueprint("live", __name__)
sock = Sock()


IDLE_CLOSE_CODE = 4000     # closed for being idle: the page reconnects when it next needs to
POLL_S = 1.0               # the reader wakes this often to check for idleness, closing and shutdown
ABORT_WAIT_S = 5.0         # on closing, the most the reader waits for its aborted requests' `done`s (a
                           # busy engine's step, well inside app/__main__.py's GRACEFUL_TIMEOUT_S)


@sock.route("/ws", bp=bp)
def websocket(ws):
    runtime = get_runtime()
    rooms = current_app.extensions.get("sendlens_rooms")
    cookies = dict(request.cookies)
    member = rooms.member_of(cookies, request.args.get("room")) if rooms else None   # (room, name) or None
    # a room's student counts against the room's seats, not the address (a classroom shares one)
    seat = rooms.seat(member[0]) if member is not None else runtime.seat_for(request)
    refused = runtime.open_connection(seat)
    if refused:
        ws.send(json.dumps(ProtocolError("overloaded", refused, "connections").as_message()))
        return
    try:
        Connection(ws, runtime, rooms, cookies, member).serve()
    finally:
        runtime.close_connection(seat)


def aborted_while_tokenizing(mid) -> dict:
    """The answer to a request aborted before `accepted`, while a job tokenized its prompt."""
    return ProtocolError("aborted", "the request was aborted while its prompt was being tokenized (before it was "
                                    "accepted)", None, mid).as_message()


class Call:
    """One client message being answered: what a widget's handler sees."""

    def __init__(self, conn: "Connection", msg: dict):
        self.conn = conn
        self.msg = msg
        self.id = msg["id"]
        self.type = msg["type"]
        self.runtime = conn.runtime
        self.config = conn.runtime.config
        self.info = conn.runtime.info
        self.tokenizer = conn.runtime.engine.view.tokenizer
        self.estimate = 0          # tokens of work taken from the budget before the handler ran
        self.tokenizing_work = 0   # ... of them, what its text tokenizes to (the rest: stop checks)
        self.cost = 0              # ... and what the handler says it cost (settled when it returns)
        self.deferred = False      # the cost is settled later, by a job
        self.tokenized_by_job = False   # a request whose prompt a job tokenizes (app/prompt_job.py)

    # -- the connection's work budget (app/budget.py) -----------------------------------------
    def charge(self, tokens: int) -> None:
        """Say what this message's work cost, in tokens (settled against the estimate on return)."""
        self.cost += tokens

    def inline(self) -> bool:
        """May this message's tokenizing run here, on the reader thread (at most one slice of it)?"""
        return self.tokenizing_work <= self.config.work_slice_tokens

    def settle_later(self):
        """The work runs as a job: the estimate stays charged until the returned settle(tokens)."""
        self.deferred = True
        budget, estimate = self.conn.budget, self.estimate
        return lambda tokens: budget.settle(estimate, tokens)

    def reply(self, payload: dict, type: str | None = None) -> None:
        """Answer now: {"type": <this type>, "id": <this id>, **payload}."""
        self.conn.send({"type": type or self.type, "id": self.id, **payload})

    def job(self, inputs: dict, work, cache: bool = True) -> None:
        """Answer with work(engine)'s result, computed by the job runner between serving steps
        (cached by this message type and `inputs`, which must determine the result, if `cache`)."""
        self.conn.start_job(self, inputs, work, cache)

    def sliced(self, inputs: dict, work) -> None:
        """Answer at-once work that is too long for the reader's thread (a long tokenization) as a
        job, uncached: counted apart from the widget jobs, so a page's jobs never crowd it out."""
        self.conn.start_job(self, inputs, work, cache=False, sliced=True)

    def own_requests(self) -> frozenset:
        """The engine request ids this connection has in flight (to mark a reader's own)."""
        with self.conn.lock:
            return frozenset(self.conn.requests.values())

    def error(self, code: str, message: str, param: str | None = None) -> None:
        """Answer with an error from a callback (a handler itself raises InvalidParameter instead)."""
        self.conn.send(ProtocolError(code, message, param, self.id).as_message())

    def submit(self, prompt, params, format_output, accepted=None) -> None:
        """Run an engine request, the one way in: the prompt (text or token ids) and SamplingParams
        are validated, the request is admitted (the engine queue's limits, then this connection's)
        and enqueued. First `accepted(seq)` is sent (an `accepted` reply) if given, then
        format_output(id, out) -> the messages for each engine output (none, to answer only at the end).

        `prompt` may also be a generator of steps that returns the token ids (seam.chat_prompt_steps):
        run here if its text fits a slice (inline()), else by the job runner, which submits the
        request from its last slice (app/prompt_job.py)."""
        if inspect.isgenerator(prompt):
            if not self.inline():
                return start_tokenizing(self, prompt, params, format_output, accepted)
            prompt = drain(prompt)
        self.conn.start_request(self, prompt, params, format_output, accepted)


class Connection:
    def __init__(self, ws, runtime: Runtime, rooms=None, cookies=None, member=None):
        """rooms: the rooms' registry; cookies: the handshake's; member: (room, display name) when
        the handshake carried a room's student cookie (its generate requests run in that room)."""
        self.ws = ws
        self.runtime = runtime
        self.rooms = rooms
        self.cookies = cookies or {}
        self.member = member
        self.config = runtime.config
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # JSON texts for the writer, or None to stop
        self.outbox_bytes = 0                  # bytes queued and not yet sent
        self.requests: dict[object, str] = {}  # client id -> engine request id
        self.loops: dict[object, object] = {}  # client id -> the EngineLoop of a room request (else the server's)
        self.request_tokens: dict[object, int] = {}  # client id -> its prompt tokens
        self.jobs: set[object] = set()         # client ids of jobs in flight
        self.sliced: set[object] = set()       # ... of them, at-once work run as a job (Call.sliced)
        self.tokenizing: set[object] = set()   # client ids of requests whose prompt a job tokenizes
        self.lock = threading.Lock()
        self.closed = False                    # the reader stops
        self.dropped = False                   # nothing more is queued: the socket is gone
        self.last_heard = time.monotonic()
        self.allowance = 2.0 * self.config.max_messages_per_second  # token bucket: a full burst to start
        self.budget = WorkBudget(self.config.work_tokens_per_second, self.config.work_burst_tokens)
        self.writer = threading.Thread(target=self._write, name="sendlens-ws-writer", daemon=True)

    # -- reading (the request thread) --------------------------------------------------------
    def serve(self) -> None:
        self.writer.start()
        self.send({"type": "hello", "protocol": protocol.PROTOCOL_VERSION, **self.runtime.hello()})
        try:
            while not self.closed:
                raw = self.ws.receive(timeout=POLL_S)
                if raw is None:
                    if not self.ws.connected:
                        break          # the library closed it (a frame over its size limit, a dead peer)
                    self._check_idle_and_shutdown()
                    continue
                self.last_heard = time.monotonic()
                msg = None
                try:
                    msg = protocol.parse(raw, self.config, MESSAGE_TYPES)  # bounded work: the frame's size
                    self._take_allowance(msg["id"])
                    self.handle(msg)
                except ProtocolError as exc:
                    self.send(exc.as_message())
                except Exception:  # a bug answers this message, not the whole connection
                    log.exception("handling a websocket message failed")
                    self.send(ProtocolError("internal_error", "the server failed to handle this message",
                                            None, msg.get("id") if msg else None).as_message())
                self.last_heard = time.monotonic()
        except ConnectionClosed:
            pass
        finally:
            self.close()

    def _take_allowance(self, mid) -> None:
        """At most max_messages_per_second on average, in bursts of up to twice that."""
        rate = self.config.max_messages_per_second
        now = time.monotonic()
        self.allowance = min(2.0 * rate, self.allowance + (now - getattr(self, "_last_take", now)) * rate)
        self._last_take = now
        if self.allowance < 1.0:
            raise ProtocolError("overloaded", f"more than {rate} messages a second on this connection "
                                              f"(max_messages_per_second); retry after {1.0 / rate:.2f} s", "rate", mid,
                                retry_after_s=round(1.0 / rate, 2))
        self.allowance -= 1.0

    def _check_idle_and_shutdown(self) -> None:
        if self.runtime.stopping.is_set():
            self._end(1001, "the server is shutting down")
            return
        with self.lock:
            busy = bool(self.requests or self.tokenizing or self.jobs or self.outbox_bytes)
        if not busy and time.monotonic() - self.last_heard > self.config.idle_timeout_s:
            self._end(IDLE_CLOSE_CODE, "idle")

    def _end(self, code: int, reason: str) -> None:
        """Close from the reader thread: abort what is in flight (each request's `done` with
        finish_reason abort, or `aborted` for one whose prompt was being tokenized, still reaches
        the client), then say goodbye."""
        for mid in self._abort_all():
            self.send(aborted_while_tokenizing(mid))
        deadline = time.monotonic() + ABORT_WAIT_S
        while time.monotonic() < deadline:
            with self.lock:
                if not self.requests:
                    break
            time.sleep(0.02)
        self.outbox.put(("close", code, reason))
        self.closed = True

    def _abort_all(self) -> list:
        """Abort every request and drop every job; -> the ids of requests whose prompt was still
        being tokenized (they had no engine request yet)."""
        with self.lock:
            leftover = [(self.loops.get(mid, self.runtime.loop), rid) for mid, rid in self.requests.items()]
            self.jobs.clear()               # each request is popped when its done arrives
            self.sliced.clear()
            tokenizing = list(self.tokenizing)
            self.tokenizing.clear()         # its job is dropped below; its last slice then enqueues nothing
        for loop, request_id in leftover:
            loop.abort(request_id)
        self.runtime.jobs.cancel_owner(self)
        return tokenizing

    def close(self) -> None:
        self.closed = True
        if self.rooms is not None:
            self.rooms.unwatch(self)
        self._abort_all()
        self.outbox.put(None)
        self.writer.join(timeout=5)

    def send(self, message: dict) -> None:
        """Queue a message for the writer (any thread, never blocks). A client whose unsent
        replies pass max_outbox_bytes has stopped reading: it is cut off."""
        text = json.dumps(message)
        with self.lock:
            over = self._queue(text)
        if over:
            self._cut_off()

    def _queue(self, text: str) -> bool:
        """Queue a text for the writer, under self.lock; True if it took the client over
        max_outbox_bytes (then call _cut_off, outside the lock)."""
        if self.dropped:
            return False
        self.outbox_bytes += len(text)
        over = self.outbox_bytes > self.config.max_outbox_bytes
        self.dropped = over                    # the first send over the limit cuts; later ones return above
        if not over:
            self.outbox.put(text)
        return over

    def _cut_off(self) -> None:
        log.warning("a client stopped reading (%d bytes queued, max_outbox_bytes); cutting it off",
                    self.outbox_bytes)
        self.runtime.count_cut_off("max_outbox_bytes")
        self.cut()

    def cut(self) -> None:
        """Drop the connection at once, from any thread (a shutdown of the socket unblocks the
        reader and a writer stuck on a peer that does not read)."""
        self.closed = self.dropped = True
        try:
            self.ws.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def charge_slice(self) -> None:
        """One slice of this connection's job ran (the job runner, on the engine loop's thread)."""
        self.budget.charge(self.config.job_slice_tokens, floor=0)   # it empties the budget, never indebts it

    def handle(self, msg: dict) -> None:
        mid = msg["id"]
        try:
            if msg["type"] == "abort":
                return self.abort(mid)
            with self.lock:
                if mid in self.requests or mid in self.jobs or mid in self.tokenizing:
                    raise ProtocolError("invalid_request", f"a request with id {mid!r} is still running", "id")
            call = Call(self, msg)
            call.tokenizing_work = tokenizing_estimate(msg, self.runtime.template_bytes)
            estimate = message_estimate(msg, self.config, self.runtime.template_bytes)
            call.estimate = self.budget.take(estimate, mid, f"this {msg['type']} message")
            try:
                MESSAGE_TYPES[msg["type"]].handle(call)
            except BaseException:
                call.deferred = False          # no job took the work over: settle what was done
                raise
            finally:
                if not call.deferred:
                    self.budget.settle(call.estimate, call.cost)
        except ProtocolError as exc:
            exc.id = mid
            raise
        except (InvalidParameter, EngineOverloaded) as exc:
            raise ProtocolError.from_exception(exc, mid) from None

    def abort(self, mid) -> None:
        with self.lock:
            request_id = self.requests.get(mid)
            loop = self.loops.get(mid, self.runtime.loop)
            is_job = mid in self.jobs
            tokenizing = self.withdraw(mid, locked=True)
            self.jobs.discard(mid)
            self.sliced.discard(mid)
        if request_id is not None:
            loop.abort(request_id)                   # the stream ends with done, finish_reason abort
        elif tokenizing:                             # no request yet: its job is dropped (no engine state)
            self.runtime.jobs.cancel(self, mid)
            self.runtime.loop.wake()                 # ... at the runner's next turn, now
            self.send(aborted_while_tokenizing(mid))
        elif is_job:
            self.runtime.jobs.cancel(self, mid)
            self.send(ProtocolError("aborted", "the job was aborted", None, mid).as_message())
        else:
            raise ProtocolError("invalid_request", f"no running request has id {mid!r}", "id")

    def start_job(self, call: Call, inputs: dict, work, cache: bool = True, sliced: bool = False) -> None:
        mid, kind = call.id, call.type
        with self.lock:
            held = len(self.sliced) if sliced else len(self.jobs) - len(self.sliced)
            if held >= self.config.max_jobs_per_connection:
                raise ProtocolError("overloaded", f"{self.config.max_jobs_per_connection} jobs are already "
                                                  "running on this connection (max_jobs_per_connection)",
                                    "connection")
            self.jobs.add(mid)
            if sliced:
                self.sliced.add(mid)

        def subscriber(event: Event) -> None:  # on the engine loop's thread: only queue it
            for message in self._job_messages(mid, kind, event):
                self.send(message)

        runner = self.runtime.jobs
        canonical = MESSAGE_TYPES[kind].canonical if kind in MESSAGE_TYPES else kind   # an old name shares the cache
        try:
            runner.submit(self, mid, runner.key(canonical, inputs), work, subscriber, cache)
        except Exception:
            with self.lock:
                self.jobs.discard(mid)
                self.sliced.discard(mid)
            raise

    def start_request(self, call: Call, prompt, params, format_output, accepted) -> None:
        """Admit and enqueue one engine request: the engine's queue limits and the prompt's checks
        (EngineLoop.prepare), then this connection's limits, in that order, once."""
        if self.member is not None:             # a room's student: the room's rules and engine
            room, student = self.member
            return room_messages.start_request(self, room, student, call, prompt, params, format_output, accepted)
        loop = self.runtime.loop
        seq = loop.prepare(prompt, params)
        call.charge(request_cost(seq, params))
        self.hold_request(call, seq, accepted, format_output, lambda listener: loop.enqueue(seq, listener))

    def hold_request(self, call: Call, seq, accepted, format_output, enqueue, loop=None) -> None:
        """Count a request in against this connection's limits (overloaded past them), queue its
        `accepted` reply (accepted(seq), if given: before any output) and enqueue(listener) it, as
        one step under the connection's lock: an abort finds either a prompt still tokenizing or
        a request already in its engine's queue, never one between (whose Abort would overtake
        it). loop: the room engine's EngineLoop that runs it, if not the server's. Raises
        Withdrawn for a prompt tokenized by a job and aborted meanwhile."""
        mid = call.id
        reply = None if accepted is None else json.dumps({"type": "accepted", "id": mid, **accepted(seq)})

        def listener(out) -> None:  # on the engine loop's thread: only queue it
            self.deliver(mid, out, format_output(mid, out))
        with self.lock:
            if call.tokenized_by_job and mid not in self.tokenizing:
                raise Withdrawn(mid)
            self._check_request_limits(seq.num_prompt_tokens, others=len(self.tokenizing - {mid}))
            self.tokenizing.discard(mid)
            self.requests[mid] = seq.request_id
            self.request_tokens[mid] = seq.num_prompt_tokens
            if loop is not None:
                self.loops[mid] = loop
            over = reply is not None and self._queue(reply)
            enqueue(listener)
        if over:
            self._cut_off()

    def hold_tokenizing(self, mid) -> None:
        """Count in a request whose prompt a job is about to tokenize (overloaded past the limit):
        it holds one of max_requests_per_connection from now on."""
        with self.lock:
            self._check_request_limits(0, others=len(self.tokenizing))
            self.tokenizing.add(mid)

    def withdraw(self, mid, locked: bool = False) -> bool:
        """A prompt being tokenized no longer counts (aborted, or refused): True if it did."""
        if locked:
            found = mid in self.tokenizing
            self.tokenizing.discard(mid)
            return found
        with self.lock:
            return self.withdraw(mid, locked=True)

    def _check_request_limits(self, prompt_tokens: int, others: int) -> None:
        """Under self.lock: room for one more request of prompt_tokens beside those in flight and
        `others` (prompts being tokenized)?"""
        if len(self.requests) + others >= self.config.max_requests_per_connection:
            raise ProtocolError("overloaded", f"{self.config.max_requests_per_connection} requests are already "
                                              "running on this connection (max_requests_per_connection)",
                                "connection")
        held = sum(self.request_tokens.values())
        if held and held + prompt_tokens > self.config.max_tokens_per_connection:
            raise ProtocolError("overloaded", f"this connection's requests in flight already hold {held} prompt "
                                              f"tokens (max_tokens_per_connection "
                                              f"{self.config.max_tokens_per_connection}); wait for them to finish",
                                "connection")

    def deliver(self, mid, out, messages) -> None:
        """Queue a request's output (on the engine loop's thread). Once finished, the request no
        longer counts, and it stops counting in the same hold of the lock that queues its last
        messages: a shutdown that waits for no requests then always queues its close after them,
        and a client that reads the `done` and starts again is never refused for the old one."""
        texts = [json.dumps(message) for message in messages]
        over = False
        with self.lock:
            if out.finished:
                self.requests.pop(mid, None)
                self.request_tokens.pop(mid, None)
                self.loops.pop(mid, None)
            for text in texts:
                over = self._queue(text) or over
        if over:
            self._cut_off()

    # -- writing (the writer thread) ---------------------------------------------------------
    def _write(self) -> None:
        """Send queued texts in order, and ping the client when there is nothing to send: a peer
        that has not answered the previous ping is gone (a closed laptop lid) and is cut off."""
        interval = self.config.ping_interval_s
        while True:
            try:
                item = self.outbox.get(timeout=interval)
            except queue.Empty:
                if not self._ping():
                    self.runtime.count_cut_off("ping_interval_s")
                    self.cut()
                    return
                continue
            if item is None:
                return
            try:
                if isinstance(item, tuple):               # ("close", code, reason)
                    self.ws.close(item[1], item[2])
                    return
                self.ws.send(item)
                with self.lock:
                    self.outbox_bytes -= len(item)
            except (ConnectionClosed, OSError):
                self.cut()
                return
            except Exception:  # never leave a silent connection: drop it, the reader then ends
                log.exception("websocket send failed; closing the connection")
                self.cut()
                return

    def _ping(self) -> bool:
        """A websocket ping from this thread, the only one that writes. False if the last went unanswered."""
        ws = self.ws
        if not ws.connected:
            return False
        if not getattr(ws, "pong_received", True):
            return False
        ws.pong_received = False                    # simple_websocket's reader sets it on a pong
        try:
            ws.sock.send(ws.ws.send(Ping()))
        except OSError:
            return False
        return True

    def _job_messages(self, mid, kind, event: Event) -> list[dict]:
        with self.lock:
            if mid not in self.jobs:     # aborted, or the connection is closing
                return []
            if event.kind != "progress":
                self.jobs.discard(mid)
                self.sliced.discard(mid)
        if event.kind == "progress":
            p = event.progress
            return [{"type": "progress", "id": mid, "done": p.done, "total": p.total, "note": p.note}]
        if event.kind == "result":
            return [{"type": kind, "id": mid, **event.result}]
        return [error_reply(mid, event.error)]
