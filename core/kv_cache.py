"""The KV pool: preallocated key and value tensors for every layer, cut into blocks.

Paged like virtual memory (Kwon et al., 2023): the pool is a fixed array of blocks of
`block_size` token slots, and the block manager decides which blocks each sequence owns. Slot s
of the pool is block s // block_size, offset s % block_size.
"""

import numpy as np
import torch

BYTES_PER_VALUE = 4  # fp32, like the weights


class KVCache:
    """k, v: (L, num_blocks, block_size, Hkv, D)."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, because attention reads whole blocks and masks the unused slots: 0 * garbage
        # could be NaN. numpy's zeros come from calloc, so the OS hands out zeroed pages only
        # when a block is first written, and a 1 GiB pool costs nothing up front.
        self.k = torch.from_numpy(np.zeros(shape, dtype=np.float32))
        self.v = torch.from_numpy(np.zeros(shape, dtype=np.float32))
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
