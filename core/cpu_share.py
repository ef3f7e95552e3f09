"""How many threads the engine computes with: the cores that other processes leave free.

A decode step is about a hundred parallel regions (every matrix product, softmax and norm), and
OpenMP's threads meet at the end of each. How a thread waits there decides the speed:

- Sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs a wake-up per region, and in a virtual
  machine waking an idle CPU is slow: decode runs far below what the cores can do.
- Spinning a short while first (GOMP_SPINCOUNT, set in config.py before torch loads OpenMP)
  keeps the threads hot between regions: decode runs much faster on the same quiet machine.
- But a spinning thread is a disaster beside another busy process: when one thread of the pair
  is preempted, the other spins away the slice it needs. With one CPU-bound process on 2 cores,
  decode on 2 spinning threads runs several times slower than on one thread.
(`python -m bench` measures decode speed; the README's benchmark section has its numbers.)

So the engine spins, and uses only the cores others leave free. Every `interval_s` it reads how
busy the CPUs it may run on were (/proc/stat), subtracts its own process's CPU time (os.times),
and sets torch's thread count to the free cores, rounded down (at least 1, at most
`max_threads`). One busy process on 2 cores gives 1 thread; when it stops, 2 again. Another
process's load does not depend on our thread count, so the choice does not oscillate. Where
/proc/stat does not exist (not Linux) the count stays at `max_threads`.

A window in which the engine sat idle (its process used under IDLE_CORES) says little about now:
a process that started at its end is averaged over the whole of it. So after such a window the
engine decides again after only MIN_WINDOW_S: a request that arrives beside a process that has
just started busy runs on the right number of threads within a few steps, not a tenth of a
second of spinning threads later.
"""

import os
import time

import torch

FREE_CORE_SLACK = 0.3   # a core counts as free if others leave at least 1 - this of it unused
IDLE_CORES = 0.5        # a window in which this process used fewer cores than this: the engine idled
MIN_WINDOW_S = 0.05     # the first window after idling (/proc/stat counts in 10 ms ticks)


def cpus_we_may_use() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def read_busy_seconds(cpus: set[int], path: str = "/proc/stat") -> float | None:
    """CPU seconds spent busy so far, summed over `cpus` (None if the file cannot be read).
    A line of /proc/stat: cpuN user nice system idle iowait irq softirq steal ..., in clock ticks;
    busy = user + nice + system + irq + softirq (idle, iowait and the hypervisor's steal are not)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in rest.split()[:7])
            ticks += user + nice + system + irq + softirq
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds this process has used, every thread together."""
    t = os.times()
    return t.user + t.system


class CpuShare:
    """Sets torch's thread count to the cores other processes leave free (see the module doc).
    Call update() before each engine step; it measures at most once per interval_s."""

    def __init__(self, max_threads: int | None = None, interval_s: float = 0.1, stat_path: str = "/proc/stat"):
        self.cpus = cpus_we_may_use()
        self.max_threads = max(1, min(max_threads or len(self.cpus), len(self.cpus)))
        self.interval_s = interval_s
        self.stat_path = stat_path
        self.others = 0.0           # cores other processes kept busy in the last window
        self.threads = self.max_threads
        torch.set_num_threads(self.threads)
        self._last = self._sample()
        self._after_idle = True     # the next window may be short (MIN_WINDOW_S)

    def _sample(self):
        return time.monotonic(), read_busy_seconds(self.cpus, self.stat_path), own_cpu_seconds()

    def update(self) -> int:
        """-> the thread count for the next step (changed in torch when it changes)."""
        now = time.monotonic()
        if now - self._last[0] < (MIN_WINDOW_S if self._after_idle else self.interval_s):
            return self.threads
        sample = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, sample
        self._last = sample
        if busy0 is None or busy1 is None:
            return self.threads
        self._after_idle = own1 - own0 < IDLE_CORES * (t1 - t0)   # if so, decide again soon
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        free = len(self.cpus) - self.others
        threads = max(1, min(self.max_threads, int(free + FREE_CORE_SLACK)))
        if threads != self.threads or torch.get_num_threads() != threads:  # someone else may set it
            self.threads = threads
            torch.set_num_threads(threads)
        return threads
