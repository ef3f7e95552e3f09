"""The live-data websocket (/ws): transport only. One Connection per browser, all feeding one engine.

A Connection reads frames, checks the envelope (app/protocol.py), enforces the per-connection
limits and dispatches each message to the widget that registered its type (app/widgets). A
writer thread owns every send, so engine outputs, job results and errors never interleave on the
wire; the engine loop's thread only puts items in the connection's outbox and never waits on a
browser. When a browser goes away, its requests are aborted (their KV blocks freed) and its jobs
dropped.

Handlers answer through a Call: `reply` at once, `job` through the job runner, or `generate` for
a stream of engine outputs. `abort` {id} is the transport's own message: it stops either kind.
"""

import json
import logging
import queue
import threading

from flask import Blueprint
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from core.errors import EngineOverloaded, InvalidParameter

from . import protocol
from .jobs import Event
from .protocol import ProtocolError
from .runtime import Runtime, get_runtime
from .widgets import MESSAGE_TYPES

log = logging.getLogger(__name__)

bp = Blueprint("live", __name__)
sock = Sock()


@sock.route("/ws", bp=bp)
def websocket(ws):
    runtime = get_runtime()
    if not runtime.open_connection():
        ws.send(json.dumps(ProtocolError(
            "overloaded", f"the server already has {runtime.config.max_connections} connections "
                          "(max_connections); try again shortly", "connections").as_message()))
        return
    try:
        Connection(ws, runtime).serve()
    finally:
        runtime.close_connection()


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
        self.tokenizer = conn.runtime.engine.tokenizer

    def reply(self, payload: dict, type: str | None = None) -> None:
        """Answer now: {"type": <this type>, "id": <this id>, **payload}."""
        self.conn.outbox.put({"type": type or self.type, "id": self.id, **payload})

    def job(self, inputs: dict, work) -> None:
        """Answer with work(engine)'s result, computed by the job runner between serving steps
        (cached by this message type and `inputs`, which must determine the result)."""
        self.conn.start_job(self, inputs, work)

    def generate(self, seq, format_output, accepted: dict | None = None) -> None:
        """Run a prepared engine sequence: first `accepted` (a reply of that type) if given, then
        format_output(id, out) -> the messages for each engine output (none, to answer only at the end)."""
        first = None if accepted is None else {"type": "accepted", "id": self.id, **accepted}
        self.conn.start_request(self, seq, format_output, first)


class Connection:
    def __init__(self, ws, runtime: Runtime):
        self.ws = ws
        self.runtime = runtime
        self.config = runtime.config
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[object, str] = {}  # client id -> engine request id
        self.jobs: set[object] = set()         # client ids of jobs in flight
        self.lock = threading.Lock()
        self.writer = threading.Thread(target=self._write, name="sendlens-ws-writer", daemon=True)

    # -- reading (the request thread) --------------------------------------------------------
    def serve(self) -> None:
        self.writer.start()
        self.outbox.put({"type": "hello", "protocol": protocol.PROTOCOL_VERSION, **self.runtime.hello()})
        try:
            while True:
                raw = self.ws.receive()
                if raw is None:
                    continue
                msg = None
                try:
                    msg = protocol.parse(raw, self.config, MESSAGE_TYPES)
                    self.handle(msg)
                except ProtocolError as exc:
                    self.outbox.put(exc.as_message())
                except Exception:  # a bug answers this message, not the whole connection
                    log.exception("handling a websocket message failed")
                    self.outbox.put(ProtocolError("internal_error", "the server failed to handle this message",
                                                  None, msg.get("id") if msg else None).as_message())
        except ConnectionClosed:
            pass
        finally:
            self.close()

    def close(self) -> None:
        with self.lock:
            leftover = list(self.requests.values())
            self.requests.clear()
            self.jobs.clear()
        for request_id in leftover:
            self.runtime.loop.abort(request_id)
        self.runtime.jobs.cancel_owner(self)
        self.outbox.put(None)
        self.writer.join(timeout=5)

    def handle(self, msg: dict) -> None:
        mid = msg["id"]
        try:
            if msg["type"] == "abort":
                return self.abort(mid)
            with self.lock:
                if mid in self.requests or mid in self.jobs:
                    raise ProtocolError("invalid_request", f"a request with id {mid!r} is still running", "id")
            MESSAGE_TYPES[msg["type"]].handle(Call(self, msg))
        except ProtocolError as exc:
            exc.id = mid
            raise
        except (InvalidParameter, EngineOverloaded) as exc:
            raise ProtocolError.from_exception(exc, mid) from None

    def abort(self, mid) -> None:
        with self.lock:
            request_id = self.requests.get(mid)
            is_job = mid in self.jobs
            self.jobs.discard(mid)
        if request_id is not None:
            self.runtime.loop.abort(request_id)      # the stream ends with done, finish_reason abort
        elif is_job:
            self.runtime.jobs.cancel(self, mid)
            self.outbox.put(ProtocolError("aborted", "the job was aborted", None, mid).as_message())
        else:
            raise ProtocolError("invalid_request", f"no running request has id {mid!r}", "id")

    def start_job(self, call: Call, inputs: dict, work) -> None:
        mid, kind = call.id, call.type
        with self.lock:
            if len(self.jobs) >= self.config.max_jobs_per_connection:
                raise ProtocolError("overloaded", f"{self.config.max_jobs_per_connection} jobs are already "
                                                  "running on this connection (max_jobs_per_connection)",
                                    "connection")
            self.jobs.add(mid)

        def subscriber(event: Event) -> None:  # on the engine loop's thread: only queue it
            self.outbox.put(("job", mid, kind, event))

        runner = self.runtime.jobs
        try:
            runner.submit(self, mid, runner.key(kind, inputs), work, subscriber)
        except Exception:
            with self.lock:
                self.jobs.discard(mid)
            raise

    def start_request(self, call: Call, seq, format_output, accepted: dict | None) -> None:
        mid = call.id
        with self.lock:
            if len(self.requests) >= self.config.max_requests_per_connection:
                raise ProtocolError("overloaded", f"{self.config.max_requests_per_connection} requests are already "
                                                  "running on this connection (max_requests_per_connection)",
                                    "connection")
            self.requests[mid] = seq.request_id
        if accepted is not None:
            self.outbox.put(accepted)  # before any output can be queued
        self.runtime.loop.enqueue(seq, lambda out: self.outbox.put(("output", mid, format_output, out)))

    # -- writing (the writer thread) ---------------------------------------------------------
    def _write(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            try:
                for message in self._messages(item):
                    self.ws.send(json.dumps(message))
            except ConnectionClosed:
                return
            except Exception:  # never leave a silent connection: close it, the reader then ends
                log.exception("websocket send failed; closing the connection")
                try:
                    self.ws.close()
                except Exception:
                    pass
                return

    def _messages(self, item) -> list[dict]:
        if isinstance(item, dict):
            return [item]
        if item[0] == "job":
            return self._job_messages(*item[1:])
        _, mid, format_output, out = item
        if out.finished:
            with self.lock:
                self.requests.pop(mid, None)
        return format_output(mid, out)

    def _job_messages(self, mid, kind, event: Event) -> list[dict]:
        with self.lock:
            if mid not in self.jobs:     # aborted, or the connection is closing
                return []
            if event.kind != "progress":
                self.jobs.discard(mid)
        if event.kind == "progress":
            p = event.progress
            return [{"type": "progress", "id": mid, "done": p.done, "total": p.total, "note": p.note}]
        if event.kind == "result":
            return [{"type": kind, "id": mid, **event.result}]
        exc = event.error
        if hasattr(exc, "code"):
            return [ProtocolError.from_exception(exc, mid).as_message()]
        return [ProtocolError("internal_error", "the server failed to compute this", None, mid).as_message()]
