"""Preemption by swapping: a bounded host pool that a preempted sequence's KV blocks wait in.

After vLLM's swap space (Kwon et al., 2023, section 4.5). When the KV pool runs short, the
scheduler takes blocks back from the newest request. By recompute, it drops them and prefills the
sequence again later; by swap, it copies them to this host pool and back when there is room, so
no token is computed twice but every block crosses the host link twice. Here both pools are in
the same memory and the copy is a memcpy, which the engine times; on a GPU the copy crosses PCIe,
whose cost app/lab/host_link.py computes from a stated bandwidth.

Each sequence swaps out a copy of every block in its table, shared ones included (a block another
sequence still reads stays in the pool for it). When the host pool cannot hold a victim's blocks,
the victim is recomputed instead.
"""

from collections import deque

from core.errors import InvalidParameter


class SwapSpace:
    """Which host-pool blocks are free (the runner holds their tensors)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise InvalidParameter("num_swap_blocks", f"must be at least 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def can_hold(self, count: int) -> bool:
        return count <= len(self.free)

    def take(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError("swap space taken without room; the scheduler checks can_hold first")
        return [self.free.popleft() for _ in range(count)]

    def give_back(self, block_ids: list[int]) -> None:
        self.free.extend(block_ids)
