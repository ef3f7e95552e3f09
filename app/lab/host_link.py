"""What copying KV blocks over a GPU's host link would cost: bytes over a stated bandwidth.

On a GPU server, preemption by swap (core/engine/swap.py) moves a sequence's KV blocks from GPU
memory to host memory and back over PCIe. Here both pools are in the same memory, so the engine
measures a memcpy; this computes what the same bytes would take over the link instead.
HOST_LINK_BYTES_PER_S is PCIe 4.0 x16's nominal rate in one direction (16 GT/s per lane, 16
lanes, 128b/130b coding: about 31.5 GB/s), the link of an A100 server; real copies reach less.
"""

HOST_LINK_NAME = "PCIe 4.0 x16"
HOST_LINK_BYTES_PER_S = 16e9 * 16 * 128 / 130 / 8


def host_link_ms(num_bytes: int, bytes_per_s: float = HOST_LINK_BYTES_PER_S) -> float:
    """Milliseconds to move num_bytes one way at bytes_per_s (no latency, no contention)."""
    return 1e3 * num_bytes / bytes_per_s
