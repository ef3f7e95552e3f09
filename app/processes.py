"""A job that runs worker processes (core/parallel/workers.py), for the parallelism widgets (app infrastructure, not a widget).

The job starts a WorkerGroup through the slice helpers, so the engine loop is never held while
the processes start or compute: each slice waits at most a poll, and not at all while a chat is
being served. While it waits it reports progress in words (starting the processes and loading
the model take a few seconds before any measurement starts; the first job also starts the
forkserver, which imports torch once for all of them). However the job
ends, the group is closed in a `finally`: a finished job, a failed one, a job whose readers all
left (the runner closes its generator) and a server that stops (JobRunner.close) alike leave no
process behind; each worker also dies with the server (PR_SET_PDEATHSIG).
"""

import time

from core.parallel.workers import WorkerGroup, start_in_slices, wait_in_slices

from .jobs import Progress

STARTUP_S = 4.0       # about how long starting the workers and loading the model may take here


def run_workers(engine, group: WorkerGroup, what: str, expected_s: float):
    """Slices until every rank of `group` has answered; returns their results in rank order."""
    n = group.world_size
    try:
        for _ in start_in_slices(group, engine):
            yield Progress(0, expected_s, f"waiting for room for {n} worker processes (max_worker_processes)")
        started = time.monotonic()
        waiting = wait_in_slices(group, engine)
        while True:
            try:
                next(waiting)
            except StopIteration as stop:
                return stop.value
            elapsed = time.monotonic() - started
            if elapsed < STARTUP_S:
                note = f"starting {n} worker processes and loading the model ({elapsed:.0f} s)"
            else:
                note = f"{what} ({elapsed:.0f} s)"
            yield Progress(min(elapsed, 0.95 * expected_s), expected_s, note)
    finally:
        group.close()


def align(rows: list, start: int = 3) -> list:
    """Spans (..., start_s, end_s) on the shared monotonic clock -> the same with ms since the
    earliest start, rounded to microseconds."""
    t0 = min(r[start] for r in rows)
    return [[*r[:start], round((r[start] - t0) * 1e3, 3), round((r[start + 1] - t0) * 1e3, 3)] for r in rows]
