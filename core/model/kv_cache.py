"""The KV pool: preallocated key and value tensors for every layer, cut into blocks.

Paged like virtual memory (Kwon et al., 2023): the pool is a fixed array of blocks of
`block_size` token slots, and the block manager decides which blocks each sequence owns. Slot s
of the pool is block s // block_size, offset s % block_size.

Inside a block, keys are stored transposed, (Hkv, D, block_size): the attention kernel
(csrc/paged_attention.cpp) scores 16 keys at once, and dimension d of 16 neighbouring keys is then
one contiguous vector. Values stay one row per token, (Hkv, block_size, D), which is how they are
summed. `token_major` gives both as (blocks, block_size, Hkv, D) views.

The pool holds fp32, or bf16 where attention rounds its keys and values to bf16 anyway (q4_1 on
the engine's kernels, csrc/attention_bf16.h): written rounded once, read as they are, with the
same bits, twice the tokens in the same bytes and half the bytes a step reads (vLLM's
kv_cache_dtype; llama.cpp keeps its cache in f16).
"""

import numpy as np
import torch

from core.config import KVCacheDtype
from core.errors import InvalidParameter

DTYPES = {KVCacheDtype.FP32: torch.float32, KVCacheDtype.BF16: torch.bfloat16}


def kv_dtype(setting: KVCacheDtype | str, attention_operands: str) -> KVCacheDtype:
    """The pool's dtype for EngineConfig.kv_cache_dtype and the model's attention operands
    (Transformer.attention_operands: "bf16" or "fp32"): auto takes bf16 exactly where attention's
    operands are bf16; bf16 elsewhere would round what fp32 attention reads, so it is refused."""
    setting = KVCacheDtype(setting)
    if setting is KVCacheDtype.AUTO:
        return KVCacheDtype.BF16 if attention_operands == "bf16" else KVCacheDtype.FP32
    if setting is KVCacheDtype.BF16 and attention_operands != "bf16":
        raise InvalidParameter("kv_cache_dtype", "bf16 keeps the keys and values bf16 attention reads (q4_1 on "
                                                 "the engine's kernels); this model's attention reads fp32")
    return setting


def bytes_per_value(dtype: KVCacheDtype) -> int:
    return DTYPES[KVCacheDtype(dtype)].itemsize


class KVCache:
    """k: (L, num_blocks, Hkv, D, block_size); v: (L, num_blocks, Hkv, block_size, D)."""

    DIMS = {"k": ("layers", "blocks", "KV heads", "head size", "slots per block"),
            "v": ("layers", "blocks", "KV heads", "slots per block", "head size")}

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                 dtype: KVCacheDtype | str = KVCacheDtype.FP32):
        # Zeros: numpy's zeros come from calloc, so the OS hands out zeroed pages only when a
        # block is first written, and a 1 GiB pool costs nothing up front. Attention never uses
        # a slot beyond a token's position (the kernel reads a last tile of keys whole and masks
        # its scores; the torch path reads whole blocks and masks them, where 0 * garbage could
        # be NaN; zeros keep that safe too). numpy has no bfloat16: its
        # uint16 zeros, viewed as bfloat16, are the same zero bits.
        L, B, Hkv, D, bs = num_layers, num_blocks, num_kv_heads, head_dim, block_size
        self.dtype = KVCacheDtype(dtype)
        if self.dtype is KVCacheDtype.AUTO:
            raise InvalidParameter("dtype", "a pool is fp32 or bf16 (kv_dtype() decides what auto means)")
        store = np.float32 if self.dtype is KVCacheDtype.FP32 else np.uint16
        self.k = torch.from_numpy(np.zeros((L, B, Hkv, D, bs), dtype=store)).view(DTYPES[self.dtype])
        self.v = torch.from_numpy(np.zeros((L, B, Hkv, bs, D), dtype=store)).view(DTYPES[self.dtype])
        self.num_blocks = num_blocks
        self.block_size = block_size

    def touch(self) -> None:
        """Write every page of the pool once (the zeros it holds), so that the OS maps them now rather
        than at each block's first write: what a pool is after a while of serving, and what
        llama.cpp's KV buffer is from the start (it clears it when a context is created)."""
        self.k.zero_()
        self.v.zero_()

    def token_major(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as (blocks, block_size, Hkv, D) views of the pool."""
        return self.k[layer].permute(0, 3, 1, 2), self.v[layer].permute(0, 2, 1, 3)

    def copy_to(self, other: "KVCache", src: list[int], dst: list[int]) -> None:
        """Blocks src of this pool into blocks dst of `other` (this pool itself for copy-on-write,
        the host pool for a swap), every layer, keys and values."""
        s, d = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
        other.k[:, d] = self.k[:, s]
        other.v[:, d] = self.v[:, s]

    @property
    def bytes_per_value(self) -> int:
        return self.k.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
