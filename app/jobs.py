"""The job runner: everything a widget computes beyond a chat, run fairly beside serving.

A job is a generator function of the engine: each `next()` does one small slice of work (a block
of a probe pass, one timing, one step of an experiment's own engine) and may yield a Progress;
its return value is the result. The runner is the engine loop's side work (EngineLoop.side_work):
after every serving step the loop asks it for one slice, so a job can delay a chat's next token
by at most one slice, whatever the job's size (the stride scheduling of CPU time between serving
and jobs in one thread, as a time-sharing OS would do it with a quantum).

- Fair: jobs queue per connection, and slices go round-robin across connections, so one reader's
  ten jobs do not starve another's one (fair queueing, Demers, Keshav & Shenker, 1989).
- Bounded: a cap on jobs in the runner (`max_queued_jobs`) and per connection (set by the caller).
- Priced: each slice run while the serving engine has requests in flight is charged to the job's
  owner (its `charge_slice()`, when it has one: a connection's work budget, app/budget.py); a
  slice beside nobody's chat delays nobody and costs nothing.
- Cached: results are kept by their inputs (an LRU of `cache_entries`), and an identical job
  already running gets a second subscriber instead of a second run: a classroom asking the same
  thing computes it once. Under the LRU, a second level (`shared`, app/shared/cache.py) is asked
  on a miss, outside the lock, and given every result: replicas behind a balancer share results
  through it (a server alone has none).
- Progress: a job that runs for over a second reports its yielded Progress every half second.
- Abort: a subscriber can leave; a job with no subscribers left is stopped at its next slice.
- One thread count a job: the serving engine may change torch's thread count before any step
  (core/cpu_share.py), so each job keeps the count it started with for all its slices (set
  before a slice, the engine's put back after), and a timing reports the threads it ran on.
- Exclusive slices: a job whose next slice cannot be short (the one-piece prefill an experiment
  exists to show) yields EXCLUSIVE first; that slice then runs only while the serving engine has
  no request in flight, so it stalls nobody's chat. Other jobs go on meanwhile.
"""

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from core.errors import EngineOverloaded

log = logging.getLogger(__name__)

PROGRESS_AFTER_S = 1.0     # a job this old starts reporting progress
PROGRESS_EVERY_S = 0.5     # ... at most this often


class _Exclusive:
    """Yielded by a job: its next slice is long, so run it only while nothing is being served."""

    def __repr__(self) -> str:
        return "EXCLUSIVE"


EXCLUSIVE = _Exclusive()


@dataclass
class Progress:
    done: float               # units of work done (layers, runs ...)
    total: float              # units in all
    note: str = ""            # what is being done, in words


class Event:
    """What a subscriber hears: exactly one of result or error (code, message, param), or progress."""

    def __init__(self, kind: str, result=None, progress: Progress | None = None, error: Exception | None = None):
        self.kind = kind          # "result", "progress" or "error"
        self.result = result
        self.progress = progress
        self.error = error


Subscriber = Callable[[Event], None]   # called on the engine loop's thread: must not block
Work = Callable[[object], Iterator]    # engine -> generator of Progress | None, returning the result


@dataclass
class _Job:
    key: str
    owner: object
    work: Work
    created: float
    subscribers: dict = field(default_factory=dict)  # (owner, token) -> Subscriber
    gen: Iterator | None = None
    last_progress: float = 0.0
    progress: Progress | None = None
    exclusive: bool = False                           # its next slice waits for an idle engine
    threads: int = 0                                  # torch threads for its slices: the count when it began
    cache: bool = True                                # keep its result by its key


class JobRunner:
    def __init__(self, max_queued_jobs: int = 64, cache_entries: int = 128, shared=None):
        """shared: the second cache level (get(key), put(key, result)); None: none."""
        self.max_queued_jobs = max_queued_jobs
        self.cache_entries = cache_entries
        self.shared = shared
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._jobs: dict[str, _Job] = {}                  # key -> job, queued or running
        self._queues: OrderedDict[object, deque[_Job]] = OrderedDict()  # owner -> its jobs, in order
        self._wake: Callable[[], None] = lambda: None
        self.slices = 0
        self.max_slice_s = 0.0
        self.cache_hits = 0
        self.shared_hits = 0      # answers from the second level (another replica computed them)
        self.completed = 0

    def attach(self, wake: Callable[[], None]) -> None:
        """wake(): tells the engine loop there is work (called when a job is queued)."""
        self._wake = wake

    @staticmethod
    def key(kind: str, inputs: dict) -> str:
        """The cache key of a job: its kind and its inputs, canonical."""
        return kind + ":" + json.dumps(inputs, sort_keys=True, separators=(",", ":"))

    # -- from the connections' threads --------------------------------------------------------
    def submit(self, owner, token, key: str, work: Work, subscriber: Subscriber, cache: bool = True) -> bool:
        """Queue work under `key` for `owner` (a connection), answered to subscriber (and its
        result kept by `key` if `cache`). Returns True when the answer came at once from the cache.
        Raises EngineOverloaded."""
        result = self._from_shared(key) if cache else None
        with self._lock:
            if result is not None:
                self._remember(key, result)
            elif key in self._cache:
                self._cache.move_to_end(key)
                result = self._cache[key]
                self.cache_hits += 1
            else:
                job = self._jobs.get(key)
                if job is None:
                    if len(self._jobs) >= self.max_queued_jobs:
                        raise EngineOverloaded(f"{self.max_queued_jobs} jobs are already queued on this server "
                                               "(max_queued_jobs); try again shortly")
                    job = _Job(key, owner, work, time.monotonic(), cache=cache)
                    self._jobs[key] = job
                    self._queues.setdefault(owner, deque()).append(job)
                job.subscribers[(owner, token)] = subscriber
        if result is not None:
            subscriber(Event("result", result=result))
            return True
        self._wake()
        return False

    def _from_shared(self, key: str):
        """The second level's result for a key that is neither in the LRU nor running here, else
        None (asked outside the lock: it may be a network round trip)."""
        if self.shared is None:
            return None
        with self._lock:
            if key in self._cache or key in self._jobs:
                return None
        result = self.shared.get(key)
        if result is not None:
            with self._lock:
                self.shared_hits += 1
        return result

    def _remember(self, key: str, result) -> None:
        """Keep a result in the LRU (under the lock)."""
        self._cache[key] = result
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)

    def cancel(self, owner, token) -> bool:
        """The subscriber leaves; a job nobody waits for stops at its next slice."""
        with self._lock:
            for job in self._jobs.values():
                if job.subscribers.pop((owner, token), None) is not None:
                    return True
        return False

    def cancel_owner(self, owner) -> None:
        """A connection went away: drop all its subscriptions."""
        with self._lock:
            for job in self._jobs.values():
                for sub in [s for s in job.subscribers if s[0] == owner]:
                    del job.subscribers[sub]

    def close(self) -> None:
        """The server stops: every job ends now (its `finally` runs: worker processes are closed).
        Called once the engine loop has stopped, so no slice is running."""
        with self._lock:
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._queues.clear()
        for job in jobs:
            if job.gen is not None:
                try:
                    job.gen.close()
                except Exception:
                    log.exception("closing job %s failed", job.key[:80])

    def stats(self) -> dict:
        with self._lock:
            return {"jobs": len(self._jobs), "cached": len(self._cache), "cache_hits": self.cache_hits,
                    "shared_hits": self.shared_hits, "completed": self.completed, "slices": self.slices,
                    "max_slice_ms": round(self.max_slice_s * 1000, 3)}

    # -- on the engine loop's thread ----------------------------------------------------------
    def __call__(self, engine) -> bool:
        """One slice of the next job, round-robin across owners. True if it did any work."""
        busy = engine is not None and engine.has_unfinished_requests()
        job = self._next_job(busy)
        if job is None:
            return False
        t0 = time.perf_counter()
        serving_threads = torch.get_num_threads()
        try:
            if job.gen is None:
                job.gen = _as_generator(job.work, engine)
                job.threads = serving_threads
            elif job.threads != serving_threads:
                torch.set_num_threads(job.threads)
            job.exclusive = False
            item = next(job.gen)
        except StopIteration as stop:
            self._finish(job, Event("result", result=stop.value), cache=job.cache)
        except Exception as exc:
            if not hasattr(exc, "code"):
                log.error("job %s failed", job.key[:80], exc_info=exc)
            self._finish(job, Event("error", error=exc), cache=False)
        else:
            if item is EXCLUSIVE:
                job.exclusive = True
            elif isinstance(item, Progress):
                job.progress = item
            self._maybe_report(job)
        finally:
            if torch.get_num_threads() != serving_threads:
                torch.set_num_threads(serving_threads)
            elapsed = time.perf_counter() - t0
            self.slices += 1
            self.max_slice_s = max(self.max_slice_s, elapsed)
            charge = getattr(job.owner, "charge_slice", None)
            if busy and charge is not None:     # a slice beside nobody's chat harms nobody
                charge()
        return True

    def _next_job(self, busy: bool = False) -> _Job | None:
        """The head job of the owner whose turn it is; jobs nobody waits for are dropped, and a
        job whose next slice is exclusive is passed over while the engine is busy."""
        with self._lock:
            for _ in range(len(self._queues)):
                owner, queue = next(iter(self._queues.items()))
                self._queues.move_to_end(owner)          # the next slice goes to the next owner
                while queue and not queue[0].subscribers:
                    dropped = queue.popleft()
                    self._jobs.pop(dropped.key, None)
                    if dropped.gen is not None:
                        dropped.gen.close()
                if not queue:
                    del self._queues[owner]
                    continue
                if busy and queue[0].exclusive:
                    continue
                return queue[0]
        return None

    def _finish(self, job: _Job, event: Event, cache: bool) -> None:
        with self._lock:
            self._jobs.pop(job.key, None)
            queue = self._queues.get(job.owner)
            if queue and queue[0] is job:
                queue.popleft()
                if not queue:
                    del self._queues[job.owner]
            if event.kind == "result":
                self.completed += 1
            if cache:
                self._remember(job.key, event.result)
            subscribers = list(job.subscribers.values())
        if cache and self.shared is not None:
            self.shared.put(job.key, event.result)     # never blocks this (the engine loop's) thread
        for subscriber in subscribers:
            _tell(subscriber, event)

    def _maybe_report(self, job: _Job) -> None:
        now = time.monotonic()
        if job.progress is None or now - job.created < PROGRESS_AFTER_S or now - job.last_progress < PROGRESS_EVERY_S:
            return
        job.last_progress = now
        with self._lock:
            subscribers = list(job.subscribers.values())
        for subscriber in subscribers:
            _tell(subscriber, Event("progress", progress=job.progress))


def _as_generator(work: Work, engine) -> Iterator:
    """A job's work: a generator function, or a plain function (one slice)."""
    out = work(engine)
    if hasattr(out, "__next__"):
        return out

    def once():
        return out
        yield  # pragma: no cover - makes this a generator
    return once()


def _tell(subscriber: Subscriber, event: Event) -> None:
    try:
        subscriber(event)
    except Exception:
        log.exception("a job subscriber failed")
