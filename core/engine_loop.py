"""Run an LLMEngine on a background thread and stream each request's outputs to its listener.

Everything that touches the engine happens on the loop's thread: new requests, aborts and
widget jobs arrive as commands in a queue and are taken between steps, so the engine needs no
locks. Listeners are called on the loop thread and must not block (the web app's listener only
puts the output in the connection's queue). Validation and tokenization happen in the caller's
thread, so bad input is refused at once with the parameter's name.
"""

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from .engine import LLMEngine
from .errors import EngineOverloaded
from .outputs import RequestOutput
from .sequence import Sequence

log = logging.getLogger(__name__)

Listener = Callable[[RequestOutput], None]


class RequestStream:
    """Outputs of one request, as an iterator (for callers that do not pass a listener)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def __iter__(self):
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        while True:
            output = self._queue.get(timeout=timeout)
            if output.finished:
                return output


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_queue: int = 1024):
        self.engine = engine
        self.max_queue = max_queue  # requests waiting to start before submit says overloaded
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: dict[str, Listener] = {}
        self._num_pending = 0  # submitted, not yet handed to the engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sendlens-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- from any thread ---------------------------------------------------------------------
    def submit(self, prompt, params=None, listener: Listener | None = None) -> RequestStream:
        """Queue a request. Raises InvalidParameter (bad input) or EngineOverloaded at once."""
        return self.enqueue(self.prepare(prompt, params), listener)

    def prepare(self, prompt, params=None) -> Sequence:
        """Validate and tokenize without queueing (so a caller can answer before any output)."""
        if len(self.engine.scheduler.waiting) + self._num_pending >= self.max_queue:
            raise EngineOverloaded(f"{self.max_queue} requests are already waiting; try again shortly")
        return self.engine.make_sequence(prompt, params)

    def enqueue(self, seq: Sequence, listener: Listener | None = None) -> RequestStream:
        stream = RequestStream(seq.request_id, seq.token_ids[: seq.num_prompt_tokens])
        with self._lock:
            self._num_pending += 1
        self._send(("add", seq, listener or stream.put))
        return stream

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], object]) -> Future:
        """Run fn(engine) on the loop thread between steps (for widgets that look inside)."""
        future: Future = Future()
        self._send(("call", fn, future))
        return future

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- on the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._take_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a bug must not take the server down: end what was running
                log.exception("engine step failed; aborting running requests")
                outputs = [o for s in list(self.engine.scheduler.running)
                           if (o := self.engine.abort(s.request_id)) is not None]
            for output in outputs:
                self._deliver(output)
        for seq in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            output = self.engine.abort(seq.request_id)
            if output is not None:
                self._deliver(output)

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, seq, listener = command
                with self._lock:
                    self._num_pending -= 1
                self._listeners[seq.request_id] = listener
                self.engine.add_sequence(seq)
            elif kind == "abort":
                output = self.engine.abort(command[1])
                if output is not None:
                    self._deliver(output)
            elif kind == "call":
                _, fn, future = command
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as exc:
                        future.set_exception(exc)

    def _deliver(self, output: RequestOutput) -> None:
        listener = self._listeners.get(output.request_id)
        if output.finished:
            self._listeners.pop(output.request_id, None)
        if listener is not None:
            try:
                listener(output)
            except Exception:
                log.exception("listener of request %s failed", output.request_id)
