"""A worker process lost mid-job (a signal, the out-of-memory killer) ends its job with the named
error `worker_failed` and its exit status, with no traceback at ERROR level: nothing in our code
failed. The same in tensor parallel, pipeline and expert parallel. Tiny model, two workers."""

import logging
import os
import signal

import pytest

from conftest import wait_for, worker_processes
from core.parallel.workers import WorkerError, WorkerFailed, WorkerGroup

JOBS = {
    "tensor_parallel": {"tp_degree": 2, "text": "The capital of France is"},
    "pipeline": {"stages": 2, "microbatches": 3, "tokens": 8},
    "moe_parallel": {"texts": ["The cat sat on the mat.", "Paris is in France."], "top_k": 2, "layer": 1,
                     "workers": 2},
}


@pytest.mark.parametrize("kind", sorted(JOBS))
def test_a_killed_worker_ends_its_job_with_worker_failed(ws, kind, caplog):
    caplog.set_level(logging.ERROR)
    ws.send({"type": kind, "id": "k", **JOBS[kind], "run": 777})    # a run of its own: not from the cache
    pids = wait_for(lambda: len(worker_processes(os.getpid())) == 2 and worker_processes(os.getpid()),
                    timeout=120, what="two worker processes")
    os.kill(pids[-1], signal.SIGKILL)
    while (reply := ws.recv_for("k", timeout=120))["type"] == "progress":
        pass
    assert reply["type"] == "error" and reply["code"] == "worker_failed", reply
    assert "SIGKILL" in reply["message"] and f"exit status {-signal.SIGKILL}" in reply["message"]
    wait_for(lambda: not worker_processes(os.getpid()), timeout=30, what="the other worker to be stopped")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def sleep_then_raise(rank, world_size):
    import time
    if rank == 0:
        raise ValueError("rank zero fails on purpose")
    time.sleep(60)


def test_a_worker_that_raises_is_still_an_error_with_its_traceback():
    """A reported exception waits briefly for a death that would explain it, then is WorkerError."""
    group = WorkerGroup(sleep_then_raise, 2, timeout_s=60)
    with pytest.raises(WorkerError, match="rank zero fails on purpose") as info:
        group.run()
    assert not isinstance(info.value, WorkerFailed)
    assert group.procs == []
