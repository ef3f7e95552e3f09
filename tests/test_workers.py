"""core/parallel/workers.py: worker processes in a gloo group, bounded, timed and never left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from conftest import alive
from core.errors import InvalidParameter
from core.parallel.workers import ProcessBudget, WorkerError, WorkerGroup, WorkerTimeout, start_in_slices, wait_in_slices


def add_ranks(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "pid": os.getpid(), "nice": os.nice(0)}


def return_a_tensor(rank, world_size):
    return torch.full((1000,), float(rank))


def fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank


def sleep_long(rank, world_size, seconds):
    time.sleep(seconds)
    return os.getpid()


def test_every_rank_runs_in_one_group_and_returns_its_result():
    results = WorkerGroup(add_ranks, 3, (1,), timeout_s=60).run()
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["sum"] == 6.0 for r in results)            # (0+1) + (1+1) + (2+1)
    assert len({r["pid"] for r in results} | {os.getpid()}) == 4
    assert all(r["nice"] > os.nice(0) for r in results)      # below the server's priority
    assert not any(alive(r["pid"]) for r in results)


def test_tensors_come_back_by_value_after_their_worker_has_exited():
    """multiprocessing would share a tensor's memory through the worker, gone by then."""
    group = WorkerGroup(return_a_tensor, 2, timeout_s=60)
    with group:
        group.start()
        for p in group.procs:
            p.join(30)                    # both workers have exited before anything is read
        results = group.wait(10)
    assert [r.tolist() == [float(i)] * 1000 for i, r in enumerate(results)] == [True, True]


def test_a_failing_worker_raises_with_its_traceback_and_the_rest_are_stopped():
    group = WorkerGroup(fail_on_one, 2, timeout_s=60)
    with pytest.raises(WorkerError, match="rank one fails on purpose"):
        group.run()
    assert group.procs == []


def test_a_group_past_its_deadline_is_killed():
    """The workers sleep 60 s against a 3 s deadline: the group raises its own timeout (not the
    workers' results) and no worker is left alive."""
    group = WorkerGroup(sleep_long, 2, (60,), timeout_s=3)
    assert group.start()
    pids = group.pids
    with pytest.raises(WorkerTimeout, match="within 3 s"):
        group.wait(120)                 # a hang-stopping bound only: the group's deadline ends it first
    assert group.procs == []
    assert not any(alive(p) for p in pids)


def test_close_stops_running_workers_and_frees_the_budget():
    budget = ProcessBudget(2)
    group = WorkerGroup(sleep_long, 2, (60,), timeout_s=60, budget=budget)
    assert group.start()
    pids = group.pids
    assert budget.in_use == 2
    assert not WorkerGroup(sleep_long, 1, (0,), budget=budget).start()   # no room
    group.close()
    assert budget.in_use == 0
    assert not any(alive(p) for p in pids)


def test_the_budget_refuses_a_group_larger_than_it_by_name():
    with pytest.raises(InvalidParameter) as err:
        WorkerGroup(sleep_long, 3, (0,), budget=ProcessBudget(2)).start()
    assert err.value.param == "world_size"


def test_job_slices_wait_for_room_then_for_the_results_and_never_block_long():
    """A slice polls the group at most once to start it and at most once to wait for it (the slice
    that starts it goes on to its first wait), each poll allowed at most `poll_s`, so a slice never
    blocks the engine loop for longer than two polls: counted, not timed."""
    budget = ProcessBudget(2)
    blocker = WorkerGroup(sleep_long, 2, (1,), timeout_s=60, budget=budget)
    blocker.start()
    group = WorkerGroup(add_ranks, 2, (0,), timeout_s=60, budget=budget)
    polls: list[tuple[str, float]] = []       # (what, the longest wait it was allowed)
    start, wait = group.start, group.wait

    def counted_start(wait_s=0.0):
        polls.append(("start", wait_s))
        return start(wait_s)

    def counted_wait(timeout=0.0):
        polls.append(("wait", timeout))
        return wait(timeout)
    group.start, group.wait = counted_start, counted_wait
    slices, marks = 0, []                    # marks: len(polls) at the end of each slice

    def job():
        try:
            yield from start_in_slices(group, None, poll_s=0.02)
            return (yield from wait_in_slices(group, None, poll_s=0.02))
        finally:
            group.close()

    gen = job()
    try:
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                results = stop.value
                break
            finally:
                marks.append(len(polls))
            slices += 1
            if blocker.procs and blocker.wait(0.0) is not None:
                blocker.close()          # the first group is done: its room goes to the second
    finally:
        blocker.close()
    assert [r["sum"] for r in results] == [1.0, 1.0]
    assert slices > 1
    assert any(what == "start" for what, _ in polls[:-1]) and polls[-1][0] == "wait"
    for a, b in zip([0] + marks, marks):
        kinds = [what for what, _ in polls[a:b]]
        assert 1 <= len(kinds) <= 2 and len(set(kinds)) == len(kinds), kinds   # one start, one wait at most
    assert all(allowed <= 0.02 for _, allowed in polls)              # never longer than poll_s
    assert budget.in_use == 0


def test_closing_an_aborted_job_closes_its_workers():
    group = WorkerGroup(sleep_long, 2, (60,), timeout_s=60)

    def job():
        try:
            yield from start_in_slices(group, None)
            return (yield from wait_in_slices(group, None))
        finally:
            group.close()

    gen = job()
    next(gen)
    next(gen)
    pids = group.pids
    assert pids and all(alive(p) for p in pids)
    gen.close()                      # what the job runner does to a job nobody waits for
    assert not any(alive(p) for p in pids)


def test_workers_die_with_a_killed_parent():
    """A SIGKILLed server (no cleanup runs) leaves no worker behind."""
    here = os.path.dirname(__file__)
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {here!r})
        from test_workers import sleep_long
        from core.parallel.workers import WorkerGroup
        g = WorkerGroup(sleep_long, 2, (60,), timeout_s=60)
        g.start()
        print(" ".join(map(str, g.pids)), flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(here))
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 60   # hang-stopping only
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids)
    finally:
        parent.kill()
        parent.stdout.close()


def test_the_first_start_waits_for_the_forkserver_in_slices_not_in_one_call():
    """In a fresh process the forkserver is not running: start_in_slices starts it from a thread of
    its own and yields until it has imported torch and the engine (the first fork waits for that),
    so a job's first group never holds the engine loop through those imports; the group then runs,
    forked from it, and the forkserver stays for the next group while no worker is left."""
    here = os.path.dirname(__file__)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {here!r})
        from conftest import drain
        from test_workers import add_ranks
        from core.parallel import workers
        assert not workers.forkserver_ready()
        g = workers.WorkerGroup(add_ranks, 2, (1,), timeout_s=60)
        slices, _ = drain(workers.start_in_slices(g, None))
        _, results = drain(workers.wait_in_slices(g, None))
        g.close()
        print(len(slices), workers.forkserver_ready(), [r["sum"] for r in results])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(here))
    assert out.returncode == 0, out.stderr
    slices, ready, sums = out.stdout.split(maxsplit=2)
    assert int(slices) >= 1 and ready == "True" and sums.strip() == "[3.0, 3.0]", out.stdout
