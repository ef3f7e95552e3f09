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
kv_cache_dtype; llama.cpp keeps its cache in f16). A bf16 pool keeps its numbers in the pairs
that VDPBF16PS multiplies (two bf16 in each 32-bit lane), so attention reads them straight from
the block: keys as pairs of dimensions, (Hkv, D/2, block_size, 2), and values as pairs of
neighbouring slots, (Hkv, block_size/2, D, 2). So its blocks hold an even number of slots.
"""

import numpy as np
import torch

from core.config import KVCacheDtype
from core.errors import InvalidParameter

DTYPES = {KVCacheDtype.FP32: torch.float32, KVCacheDtype.BF16: torch.bfloat16}


def kv_dtype(setting: KVCacheDtype | str, attention_operands: str, block_size: int = 16) -> KVCacheDtype:
    """The pool's dtype for EngineConfig.kv_cache_dtype, the model's attention operands
    (Transformer.attention_operands: "bf16" or "fp32") and the block size: auto takes bf16 exactly
    where attention's operands are bf16 and a block's slots pair up (an even block_size); bf16
    elsewhere would round what fp32 attention reads, so it is refused, as is an odd block_size."""
    setting = KVCacheDtype(setting)
    if setting is KVCacheDtype.AUTO:
        paired = attention_operands == "bf16" and block_size % 2 == 0
        return KVCacheDtype.BF16 if paired else KVCacheDtype.FP32
    if setting is KVCacheDtype.BF16 and attention_operands != "bf16":
        raise InvalidParameter("kv_cache_dtype", "bf16 keeps the keys and values bf16 attention reads (q4_1 on "
                                                 "the engine's kernels); this model's attention reads fp32")
    if setting is KVCacheDtype.BF16 and block_size % 2:
        raise InvalidParameter("kv_cache_dtype", f"a bf16 pool keeps its values in pairs of slots; block_size "
                                                 f"{block_size} is odd (auto takes fp32 there)")
    return setting


def bytes_per_value(dtype: KVCacheDtype) -> int:
    return DTYPES[KVCacheDtype(dtype)].itemsize


class KVCache:
    """fp32: k (L, num_blocks, Hkv, D, block_size), v (L, num_blocks, Hkv, block_size, D).
    bf16, in pairs: k (L, num_blocks, Hkv, D/2, block_size, 2), v (L, num_blocks, Hkv, block_size/2, D, 2)."""

    DIMS = {KVCacheDtype.FP32: {"k": ("layers", "blocks", "KV heads", "head size", "slots per block"),
                                "v": ("layers", "blocks", "KV heads", "slots per block", "head size")},
            KVCacheDtype.BF16: {"k": ("layers", "blocks", "KV heads", "pairs of dimensions", "slots per block",
                                      "dimension in the pair"),
                                "v": ("layers", "blocks", "KV heads", "pairs of slots", "head size",
                                      "slot in the pair")}}

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
        if self.dtype is KVCacheDtype.FP32:
            k_shape, v_shape, store = (L, B, Hkv, D, bs), (L, B, Hkv, bs, D), np.float32
        elif bs % 2 or D % 2:
            raise InvalidParameter("block_size", f"a bf16 pool pairs slots and dimensions: block_size {bs} "
                                                 f"and head size {D} must be even")
        else:
            k_shape, v_shape, store = (L, B, Hkv, D // 2, bs, 2), (L, B, Hkv, bs // 2, D, 2), np.uint16
        self.k = torch.from_numpy(np.zeros(k_shape, dtype=store)).view(DTYPES[self.dtype])
        self.v = torch.from_numpy(np.zeros(v_shape, dtype=store)).view(DTYPES[self.dtype])
        self.dims = self.DIMS[self.dtype]
        self.num_blocks = num_blocks
        self.block_size = block_size

    def touch(self) -> None:
        """Write every page of the pool once (the zeros it holds), so that the OS maps them now rather
        than at each block's first write: what a pool is after a while of serving, and what
        llama.cpp's KV buffer is from the start (it clears it when a context is created)."""
        self.k.zero_()
        self.v.zero_()

    def token_major(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as (blocks, block_size, Hkv, D): views of an fp32 pool
        (the torch path writes through them), copies of a bf16 pool's pairs."""
        if self.dtype is KVCacheDtype.FP32:
            return self.k[layer].permute(0, 3, 1, 2), self.v[layer].permute(0, 2, 1, 3)
        B, Hkv, half, bs, _ = self.k[layer].shape
        keys = self.k[layer].permute(0, 3, 1, 2, 4).reshape(B, bs, Hkv, 2 * half)       # (B, bs, Hkv, D)
        values = self.v[layer].permute(0, 1, 2, 4, 3).reshape(B, Hkv, bs, -1)            # (B, Hkv, bs, D)
        return keys, values.permute(0, 2, 1, 3)

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
