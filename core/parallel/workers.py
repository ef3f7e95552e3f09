"""Worker processes in one torch.distributed group: the machinery under tensor, pipeline and
expert parallelism (core/parallel/tensor_parallel.py, core/parallel/pipeline.py, core/parallel/expert_parallel.py).

A WorkerGroup starts `world_size` Python processes from multiprocessing's forkserver: a clean,
single-threaded process started once (a fresh interpreter, as "spawn" starts one per worker), which
imports torch and the engine once (PRELOAD) and forks each worker from there. A worker so starts
in milliseconds instead of importing torch again, and never inherits the threaded server's held
locks, as a plain fork of the server could. The group joins them in one gloo process group
(torch.distributed's CPU backend) and runs one function in each, `target(rank, world_size, *args)`.
Each rank's return value comes back to the parent. It is the same code torchrun runs across
machines: the target only sees its rank and the group, so `python -m core.parallel.workers` style launchers
or torchrun (env:// rendezvous) can run it unchanged.

Bounded and always cleaned up, because a web page starts these:
- `ProcessBudget` caps worker processes across all groups (the server owns one);
- every group has a deadline, after which it is killed and `wait` raises WorkerTimeout;
- `close()` terminates, then kills, every process still alive, and is called however the group
  ends (a context manager, or the job runner closing an aborted job's generator);
- a worker that dies from outside (a signal, the out-of-memory killer) is told apart from one that
  raised: `wait` raises WorkerFailed (code `worker_failed`, with the exit status), even when a peer
  reports its broken connection to the dead one first (the peer's report waits REPORT_GRACE_S
  for a death to explain it);
- each worker asks the kernel to kill it if its parent dies (Linux PR_SET_PDEATHSIG), so even a
  SIGKILLed server leaves no orphans; workers run at a lower priority (nice) than the server, so
  a chat keeps its cores while an experiment runs.
"""

import ctypes
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from datetime import timedelta

from core.errors import InvalidParameter

NICE = 10                 # workers' scheduling priority below the server's (0)
PRELOAD = ["core", "torch.distributed"]   # imported once by the forkserver, not by every worker
JOIN_S = 2.0              # how long close() waits for a terminated worker before SIGKILL
REPORT_GRACE_S = 2.0      # a worker's reported failure waits this long for a peer's death to explain it


class WorkerError(RuntimeError):
    """A worker raised: the message carries its rank and traceback (logged, never sent to a
    client: the job then ends with internal_error)."""


class WorkerTimeout(RuntimeError):
    code = "timeout"


class WorkerFailed(RuntimeError):
    """A worker process died from outside (a signal, the kernel's out-of-memory killer): nothing in
    our code failed, so the job ends with the named error `worker_failed`, not internal_error."""
    code = "worker_failed"

    def __init__(self, name: str, exit_status: int):
        self.exit_status = exit_status        # multiprocessing's exitcode: -N for signal N
        how = (f"was killed by {_signal_name(-exit_status)}" if exit_status < 0
               else f"exited with status {exit_status}")
        super().__init__(f"worker process {name} {how} (exit status {exit_status}); "
                         "the other workers were stopped")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class ProcessBudget:
    """At most `limit` worker processes alive at once, across every group (thread-safe)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout: float = 0.0) -> bool:
        if n > self.limit:
            raise InvalidParameter("world_size", f"needs {n} worker processes, more than this server allows "
                                                 f"at once ({self.limit}, max_worker_processes)")
        with self._cond:
            if not self._cond.wait_for(lambda: self.in_use + n <= self.limit, timeout=timeout):
                return False
            self.in_use += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.in_use -= n
            self._cond.notify_all()


class WorkerGroup:
    """`world_size` processes running target(rank, world_size, *args) in one gloo group."""

    def __init__(self, target, world_size: int, args: tuple = (), timeout_s: float = 120.0,
                 threads_per_worker: int = 1, budget: ProcessBudget | None = None):
        if not 1 <= world_size <= 16:
            raise InvalidParameter("world_size", f"must be 1 to 16, got {world_size}")
        self.target, self.world_size, self.args = target, world_size, args
        self.timeout_s = timeout_s
        self.threads = threads_per_worker
        self.budget = budget
        self.procs: list = []
        self.results: dict[int, object] = {}
        self.started = None
        self._holding = False
        self._dir = None
        self._queue = None
        self._reported = None             # (monotonic time, message) of the first failure a worker reported

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, wait_s: float = 0.0) -> bool:
        """Start the processes; False (nothing started) if the budget has no room within wait_s."""
        if self.budget is not None:
            if not self.budget.acquire(self.world_size, wait_s):
                return False
            self._holding = True
        ctx = context()
        self._queue = ctx.SimpleQueue()
        self._dir = tempfile.mkdtemp(prefix="sendlens-workers-")
        init = "file://" + os.path.join(self._dir, "rendezvous")
        self.started = time.monotonic()
        try:
            for rank in range(self.world_size):
                p = ctx.Process(target=_worker_main, name=f"sendlens-worker-{rank}", daemon=True,
                                args=(rank, self.world_size, init, self.timeout_s, self.threads, os.getpid(),
                                      self.target, self.args, self._queue))
                p.start()
                self.procs.append(p)
        except BaseException:
            self.close()
            raise
        _forkserver["ready"].set()       # a fork went through: the forkserver has its imports
        return True

    def wait(self, timeout: float = 0.0) -> list | None:
        """Every rank's result in rank order once all are in, else None after `timeout` seconds.
        Raises WorkerError if a worker raised, WorkerFailed if one died, WorkerTimeout past the deadline."""
        deadline = time.monotonic() + timeout
        while len(self.results) < self.world_size:
            if self._queue is not None and not self._queue.empty():
                rank, ok, value = self._queue.get()
                if not ok:   # a peer of a killed worker may report first: wait for the death below
                    self._reported = self._reported or (time.monotonic(), f"worker {rank} of {self.world_size} "
                                                                         f"failed:\n{value}")
                else:
                    self.results[rank] = pickle.loads(value)
                continue
            dead = [p for p in self.procs if p.exitcode not in (None, 0)]
            if dead:
                self.close()
                raise WorkerFailed(dead[0].name, dead[0].exitcode)
            if self._reported and time.monotonic() - self._reported[0] > REPORT_GRACE_S:
                self.close()
                raise WorkerError(self._reported[1])
            if time.monotonic() - self.started > self.timeout_s:
                self.close()
                raise WorkerTimeout(f"the worker processes did not finish within {self.timeout_s:g} s")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(left, 0.01))
        return [self.results[r] for r in range(self.world_size)]

    def run(self) -> list:
        """Start, wait for every result, close: for scripts and tests."""
        with self:
            self.start(wait_s=self.timeout_s)
            return self.wait(self.timeout_s + 1.0)

    def close(self) -> None:
        """Terminate, then kill, whatever is still running; free the budget and the rendezvous."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
                p.join(JOIN_S)
        self.procs = [p for p in self.procs if p.is_alive()]
        if self._holding:
            self.budget.release(self.world_size)
            self._holding = False
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def context():
    """multiprocessing's forkserver context, its server importing PRELOAD."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


_forkserver = {"ready": threading.Event(), "thread": None}
_forkserver_lock = threading.Lock()


def forkserver_ready(wait_s: float = 0.0) -> bool:
    """True once the forkserver runs with PRELOAD imported, waiting at most wait_s for it. The first
    call starts it from a thread of its own: its first fork waits for those imports (seconds),
    which must not hold the engine loop (start_in_slices yields until this is True)."""
    if _forkserver["ready"].is_set():
        return True
    with _forkserver_lock:
        if _forkserver["thread"] is None:
            _forkserver["thread"] = threading.Thread(target=_start_forkserver, name="sendlens-forkserver", daemon=True)
            _forkserver["thread"].start()
    return _forkserver["ready"].wait(wait_s)


def _start_forkserver() -> None:
    try:
        p = context().Process(target=_nothing, name="sendlens-forkserver-check", daemon=True)
        p.start()
        p.join()
    finally:               # a failure shows in the group's own start
        _forkserver["ready"].set()


def _nothing() -> None:
    pass


def _die_with_parent(server_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans, whatever kills it). The
    parent is the forkserver, which exits when the server does (its pipe from the server ends), so
    the kill reaches the workers through it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    try:
        os.kill(server_pid, 0)                 # the server died before prctl took effect
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:
        pass


def _worker_main(rank, world_size, init_method, timeout_s, threads, parent_pid, target, args, results):
    _die_with_parent(parent_pid)
    try:
        os.nice(NICE)
    except OSError:
        pass
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            # Every rank has its connections before any goes on: a rank whose target talks to no
            # one would otherwise finish and close its side while a slower peer (a busy machine)
            # is still connecting to it, and that peer's set-up fails ("connection closed by peer").
            dist.barrier()
            # Plain pickle, by value: multiprocessing's own pickler would share a tensor's memory
            # through this process, which may have exited before the parent reads it.
            results.put((rank, True, pickle.dumps(target(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc(limit=8)))


def launched_by_torchrun() -> bool:
    """torchrun (or any env:// launcher) started this process as one rank of a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_torchrun_rank(target, args: tuple = (), timeout_s: float = 300.0):
    """Run target(rank, world_size, *args) as this process's rank of the group torchrun set up
    (env:// rendezvous, across machines too): -> (rank, world_size, its result)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        return rank, world_size, target(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def wait_in_slices(group: WorkerGroup, engine, poll_s: float = 0.05):
    """A job's slices while `group` runs (the job runner's side of the pool): each slice waits for
    the workers at most `poll_s` when the serving engine is idle and not at all when it is busy,
    so the engine loop neither spins nor delays a chat. Yields None; returns the results.
    The caller closes the group (in a `finally`, so an aborted job closes it too)."""
    while True:
        busy = engine is not None and engine.has_unfinished_requests()
        done = group.wait(0.0 if busy else poll_s)
        if done is not None:
            return done
        yield None


def start_in_slices(group: WorkerGroup, engine, poll_s: float = 0.05):
    """Slices until the forkserver is ready, the budget has room and the group is started (each
    slice waits at most poll_s, and not at all while the engine is serving)."""
    while True:
        busy = engine is not None and engine.has_unfinished_requests()
        if forkserver_ready(wait_s=0.0 if busy else poll_s):
            break
        yield None
    while True:
        busy = engine is not None and engine.has_unfinished_requests()
        if group.start(wait_s=0.0 if busy else poll_s):
            return
        yield None


__all__ = ["WorkerGroup", "ProcessBudget", "WorkerError", "WorkerTimeout", "WorkerFailed", "wait_in_slices", "start_in_slices",
           "launched_by_torchrun", "run_torchrun_rank"]
