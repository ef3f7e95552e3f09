"""The machine's own limits, measured in the same run as the systems: memory read bandwidth and
matmul peak. A decode step of one request has to read every weight once, so bandwidth divided
by the bytes a step reads is the fastest any engine can decode on this machine (the roofline
model, Williams, Waterman and Patterson, 2009)."""

import time

import torch


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memory_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s read by a sum over a buffer much larger than the caches (all threads)."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _best(lambda: buf.sum(), repeats)


class MemoryBandwidth:
    """The memory-bandwidth limit as a turn of its own in every round of decode alone: the machine's
    bandwidth moves with what its neighbours do (on a shared virtual machine, by a third within
    minutes), so the decode bound by it is held to the bandwidth measured beside it, in the same
    round, not to one measured minutes before (bench/report.py's line divides round by round)."""

    name = "memory bandwidth"
    unit = "GB/s"

    def decode(self, *_args) -> float:
        return memory_bandwidth(repeats=3) / 1e9


def matmul_peak(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an (n, n) @ (n, n) product, hot in cache."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / _best(lambda: a @ b, repeats)


def measure(quick: bool) -> dict:
    repeats = 3 if quick else 7
    return {
        "memory_bandwidth_gb_s": memory_bandwidth(repeats=repeats) / 1e9,
        "matmul_fp32_gflop_s": matmul_peak(torch.float32, repeats=repeats) / 1e9,
        "matmul_bf16_gflop_s": matmul_peak(torch.bfloat16, repeats=repeats) / 1e9,
    }
