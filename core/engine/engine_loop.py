"""Run an LLMEngine on a background thread and stream each request's outputs to its listener.

Everything that changes the engine's state happens on the loop's thread: new requests, aborts
and widget jobs arrive as commands in a queue and are taken between steps, so the scheduler and
block manager need no locks. Validation and tokenization happen in the caller's thread (the
tokenizer has its own lock), so bad input is refused at once with the parameter's name; counters
such as the queue length may be read from any thread. Listeners are called on the loop thread
and must not block (the web app's listener only puts the output in the connection's queue).

Work beside serving runs between steps, one piece per step, so it can never stall a stream by
more than one piece: `call(fn)` runs a short function on the loop thread, and a `side_work`
callable (the web app's job runner) is asked for one slice of its work after every step. If a step
fails (a bug), the requests it touched end with `error` set instead of taking the server down;
every other request and every KV block is kept or returned.

Readers on other threads never touch the engine: `info()` is fixed at start, and `stats()` is a
snapshot the loop publishes after every step (one attribute swap, so no lock is needed).
"""

import logging
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from core.engine.beam_search import BeamSearchParams
from core.engine.llm_engine import LLMEngine
from core.engine.outputs import RequestOutput
from core.engine.sequence import Sequence
from core.errors import EngineOverloaded

log = logging.getLogger(__name__)

Listener = Callable[[RequestOutput], None]
ENGINE_FAILED = "the engine failed while running this request; it was stopped (the server logged why)"


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


@dataclass
class Add:
    seq: Sequence
    listener: Listener


@dataclass
class Abort:
    request_id: str


@dataclass
class AbortAll:
    """Every request the loop holds, at once (a server shutting down)."""


@dataclass
class Job:
    fn: Callable[[LLMEngine], object]
    future: Future


SideWork = Callable[[LLMEngine], bool]  # runs one slice on the loop thread; True if it did work


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_queue: int, max_queued_tokens: int | None = None,
                 side_work: SideWork | None = None):
        self.engine = engine
        self.max_queue = max_queue  # requests waiting to start before submit says overloaded
        self.max_queued_tokens = max_queued_tokens  # ... or prompt tokens waiting (None: no limit)
        self._pending_tokens = 0    # prompt tokens submitted, not yet handed to the engine
        self.side_work = side_work
        self._info = engine.view.info()
        self._stats = engine.view.stats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: deque[Job] = deque()
        self._requests: dict[str, tuple[Sequence, Listener]] = {}
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

    def info(self) -> dict:
        """The model's shape and the engine's limits (a copy)."""
        return dict(self._info)

    def stats(self) -> dict:
        """The KV pool, queues and step count as of the last step (a snapshot, never live)."""
        return self._stats

    def wake(self) -> None:
        """Tell the loop there may be side work to do."""
        self._wake.set()

    # -- from any thread ---------------------------------------------------------------------
    def submit(self, prompt, params=None, listener: Listener | None = None) -> RequestStream:
        """Queue a request. Raises InvalidParameter (bad input) or EngineOverloaded at once."""
        return self.enqueue(self.prepare(prompt, params), listener)

    def prepare(self, prompt, params=None) -> Sequence:
        """Validate and tokenize without queueing (so a caller can answer before any output)."""
        if self._stats["waiting"] + self._num_pending >= self.max_queue:
            raise EngineOverloaded(f"{self.max_queue} requests are already waiting (max_queue); "
                                   "try again in a few seconds")
        if isinstance(params, BeamSearchParams):     # a beam search: its root sequence queues alike
            seq = self.engine.make_beam_search(prompt, params)
        else:
            seq = self.engine.make_sequence(prompt, params)
        if self.max_queued_tokens is not None:
            queued = self._stats["waiting_tokens"] + self._pending_tokens
            if queued + seq.num_prompt_tokens > self.max_queued_tokens:
                raise EngineOverloaded(f"{queued} prompt tokens are already waiting and this request adds "
                                       f"{seq.num_prompt_tokens} (max_queued_tokens {self.max_queued_tokens}); "
                                       "try again in a few seconds", param="queue")
        return seq

    def enqueue(self, seq: Sequence, listener: Listener | None = None) -> RequestStream:
        stream = RequestStream(seq.request_id, seq.token_ids[: seq.num_prompt_tokens])
        with self._lock:
            self._num_pending += 1
            self._pending_tokens += seq.num_prompt_tokens
        self._send(Add(seq, listener or stream.put))
        return stream

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def abort_all(self) -> None:
        """End every request now, each with its `abort` output, between two steps."""
        self._send(AbortAll())

    def call(self, fn: Callable[[LLMEngine], object]) -> Future:
        """Run fn(engine) on the loop thread between steps; it must be short (one step's time)."""
        future: Future = Future()
        self._send(Job(fn, future))
        return future

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- on the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._take_commands()
            self._stats = self.engine.view.stats()   # the queue as the engine now holds it
            did_work = self._run_one_job()
            did_work = self._run_side_work() or did_work
            if self.engine.has_unfinished_requests():
                self._step()
            elif not did_work:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
            self._stats = self.engine.view.stats()
        for seq, _ in list(self._requests.values()):
            self._deliver(self.engine.abort(seq.request_id) or seq.output([], ""))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # a bug must not take the server down: end what was in flight
            log.exception("engine step failed; stopping the requests in flight")
            outputs = []
            for seq, _ in list(self._requests.values()):
                output = self.engine.abort(seq.request_id) or seq.output([], "")
                output.error = ENGINE_FAILED
                outputs.append(output)
        for output in outputs:
            self._deliver(output)

    def _run_side_work(self) -> bool:
        if self.side_work is None:
            return False
        try:
            return bool(self.side_work(self.engine))
        except Exception:  # the side worker reports its own failures; this keeps the loop alive
            log.exception("side work failed")
            return False

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Add):
                with self._lock:
                    self._num_pending -= 1
                    self._pending_tokens -= command.seq.num_prompt_tokens
                self._requests[command.seq.request_id] = (command.seq, command.listener)
                try:
                    self.engine.add_sequence(command.seq)
                except Exception as exc:
                    log.exception("could not add request %s", command.seq.request_id)
                    output = command.seq.output([], "")
                    output.finished, output.error = True, str(exc)
                    self._deliver(output)
            elif isinstance(command, Abort | AbortAll):
                ids = list(self._requests) if isinstance(command, AbortAll) else [command.request_id]
                for request_id in ids:
                    output = self.engine.abort(request_id)
                    if output is not None:
                        self._deliver(output)
            elif isinstance(command, Job):
                self._jobs.append(command)

    def _run_one_job(self) -> bool:
        if not self._jobs:
            return False
        job = self._jobs.popleft()
        if job.future.set_running_or_notify_cancel():
            try:
                job.future.set_result(job.fn(self.engine))
            except Exception as exc:
                job.future.set_exception(exc)
        return True

    def _deliver(self, output: RequestOutput) -> None:
        entry = self._requests.get(output.request_id)
        if output.finished:
            self._requests.pop(output.request_id, None)
        if entry is not None:
            try:
                entry[1](output)
            except Exception:
                log.exception("listener of request %s failed", output.request_id)
