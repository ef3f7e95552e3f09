"""cpu_share.py: the engine computes on the cores other processes leave free."""

import multiprocessing
import os
import time

import pytest
import torch

from bounds import U64
from conftest import wait_for
from core import cpu_share
from core.cpu_share import CpuShare, read_busy_seconds


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class FakeMachine:
    """/proc/stat, this process's CPU time and the clock, as the test says."""

    def __init__(self, monkeypatch, cpus: int):
        self.now, self.busy, self.own = 100.0, 0.0, 0.0
        monkeypatch.setattr(cpu_share, "cpus_we_may_use", lambda: set(range(cpus)))
        monkeypatch.setattr(cpu_share, "read_busy_seconds", lambda cpus, path: self.busy)
        monkeypatch.setattr(cpu_share, "own_cpu_seconds", lambda: self.own)
        monkeypatch.setattr(cpu_share.time, "monotonic", lambda: self.now)

    def run(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass with `ours` and `others` cores busy."""
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


def test_threads_follow_the_cores_others_leave_free(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch, cpus=4)
    share = CpuShare()
    assert share.threads == 4 and torch.get_num_threads() == 4
    machine.run(0.5, ours=4, others=0)
    assert share.update() == 4
    machine.run(0.5, ours=3, others=1)                  # one busy process
    assert share.update() == 3 and torch.get_num_threads() == 3
    machine.run(0.5, ours=1, others=3.9)                # the machine is full: still one thread
    # the fake machine's float64 sums: at most 5 roundings of numbers below 8 (busy 6.45, its
    # increments, the difference), each within u of 8, divided by the 0.5 s window; 3.9 itself rounded
    assert share.update() == 1 and share.others == pytest.approx(3.9, rel=0, abs=5 * 8 * U64 / 0.5 + 4 * U64)
    machine.run(0.5, ours=2, others=0.1)                # noise does not cost a core
    assert share.update() == 4 and torch.get_num_threads() == 4


def test_it_measures_once_per_interval_and_never_above_max_threads(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch, cpus=4)
    share = CpuShare(max_threads=2, interval_s=0.25)
    assert share.threads == 2
    machine.run(0.1, ours=2, others=0)
    assert share.update() == 2                          # the first window may be short
    machine.run(0.1, ours=1, others=4)
    assert share.update() == 2                          # too soon to measure again
    machine.run(0.2, ours=1, others=4)
    assert share.update() == 1
    machine.run(1.0, ours=2, others=0)
    assert share.update() == 2                          # max_threads, not the 4 cores


def test_after_idling_it_decides_again_on_a_short_window(monkeypatch, restore_threads):
    """A window the engine spent idle averages a process that just started over all of it; the
    next decision comes after MIN_WINDOW_S of the engine's work, not a whole interval."""
    machine = FakeMachine(monkeypatch, cpus=2)
    share = CpuShare(max_threads=2, interval_s=0.1)
    machine.run(0.06, ours=2, others=0)
    assert share.update() == 2
    machine.run(5.0, ours=0, others=0)                  # idle ...
    machine.run(0.05, ours=0, others=1)                 # ... until a busy process starts
    assert share.update() == 2 and share.others < 0.1   # diluted: one core for 1% of the window
    machine.run(0.02, ours=1.5, others=1)
    assert share.update() == 2                          # under MIN_WINDOW_S
    machine.run(0.04, ours=1.3, others=1)
    assert share.update() == 1 and torch.get_num_threads() == 1
    machine.run(0.06, ours=1, others=1)
    assert share.update() == 1                          # now once per interval_s again: too soon
    machine.run(0.3, ours=2, others=0)                  # the busy process has stopped
    assert share.update() == 2


def test_without_proc_stat_the_count_stays(tmp_path, restore_threads):
    share = CpuShare(max_threads=1, interval_s=0, stat_path=str(tmp_path / "missing"))
    assert share.update() == 1 and share.others == 0.0


def test_read_busy_seconds_sums_the_cpus_asked_for(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text("cpu  300 0 30 900 0 0 0 0 0 0\n"
                    "cpu0 100 0 10 300 5 1 2 7 0 0\n"
                    "cpu1 200 0 20 600 0 0 0 0 0 0\n"
                    "intr 12345\n")
    monkeypatch.setattr(cpu_share.os, "sysconf", lambda name: 100)
    # whole ticks summed as integers, then one division by the clock rate, here and there: bit for bit
    assert read_busy_seconds({0}, str(stat)) == (100 + 10 + 1 + 2) / 100
    assert read_busy_seconds({0, 1}, str(stat)) == (113 + 220) / 100
    assert read_busy_seconds({0}, str(tmp_path / "missing")) is None


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def cpu_seconds_of(pid: int) -> float:
    """utime + stime of a process (/proc/<pid>/stat fields 14 and 15, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(read_busy_seconds({0}) is None, reason="needs /proc/stat")
def test_a_busy_process_is_seen_on_the_real_machine(restore_threads):
    """Whatever else runs on the machine, the CPU time a spinning child is seen to use inside the
    share's window is counted in `others`. Slack, derived: every counter read is whole clock ticks,
    so a difference of two reads is off by under one tick per counter: 5 busy counters per CPU in
    /proc/stat, 2 in the child's stat, 2 in os.times (user and system)."""
    share = CpuShare(interval_s=0.5)
    busy = multiprocessing.get_context("spawn").Process(target=spin, args=(30.0,), daemon=True)
    busy.start()
    try:
        wait_for(lambda: cpu_seconds_of(busy.pid) > 0.05, timeout=30, what="the child to spin")
        share.update()                                  # starts a window of its own
        start = share._last[0]
        child0 = cpu_seconds_of(busy.pid)               # read inside the share's window
        while share._last[0] == start:                  # until update() has measured a window
            time.sleep(0.1)
            child1 = cpu_seconds_of(busy.pid)           # ... also inside it (read before update)
            share.update()
        tick = 1 / os.sysconf("SC_CLK_TCK")
        slack = (5 * len(share.cpus) + 2 + 2) * tick
        window = share._last[0] - start
        assert child1 - child0 > 0, "the child never ran"
        assert share.others * window >= (child1 - child0) - slack, (share.others, window, child1 - child0)
        seen = max(0.0, (child1 - child0) - slack) / window   # cores the child surely used
        assert share.threads <= max(1, int(len(share.cpus) - seen + cpu_share.FREE_CORE_SLACK))
    finally:
        busy.kill()
        busy.join()


def test_the_engine_sets_its_threads_and_a_sibling_leaves_them(make_tiny_engine, restore_threads):
    engine = make_tiny_engine(num_threads=1)
    assert engine.runner.cpu_share.max_threads == 1 and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    sibling = engine.sibling(num_kv_blocks=8)
    assert sibling.runner.cpu_share is None and torch.get_num_threads() == 2
    fixed = make_tiny_engine(share_cpu=False, num_threads=1)
    assert fixed.runner.cpu_share is None and torch.get_num_threads() == 1
