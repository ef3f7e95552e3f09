"""Paged KV memory: fixed-size blocks, block tables, reference counts, and prefix caching.

After vLLM (Kwon et al., 2023, "Efficient Memory Management for LLM Serving with PagedAttention")
and its v1 prefix cache. The KV pool is cut into blocks of `block_size` token slots. A sequence
owns a list of blocks (its block table) and gets a new one only when its tokens reach the end of
the last: no memory is reserved for tokens that may never be generated.

Prefix caching. A full block is named by a chained hash, hash(parent block's hash, its token
ids), so equal hashes mean equal whole prefixes. Once a block's KV has been written, its hash is
published; a later request whose prompt starts with the same tokens takes those blocks (reference
count + 1) instead of computing them again. A block whose last user finishes is free but keeps its
contents and hash: it is reused on a hit, or evicted, least recently used first, when the pool
needs a block.

Sharing and copy-on-write. Parallel samples and beams fork from one sequence by taking its block
table (every block's reference count + 1). Full shared blocks are only read; the first write into
a shared, partial block gives the writer a fresh copy (the last user writes in place), so one
divergence costs one block copy. The copies, and the swap-outs and swap-ins of preemption by
swapping (swap.py), are queued in `ops` in the order they were decided, for the model runner to
carry out before the step's forward pass.
"""

import hashlib
from collections import OrderedDict

from enum import Enum

import numpy as np

from core.errors import InvalidParameter


class BlockOp(str, Enum):
    COPY = "copy"          # pool block -> pool block (copy-on-write)
    SWAP_OUT = "swap_out"  # pool block -> host-pool block
    SWAP_IN = "swap_in"    # host-pool block -> pool block


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None        # set once the block is full and its KV written
        self.token_ids: tuple[int, ...] = ()  # kept to rule out hash collisions


class Blocks:
    """The pool's Block objects, each made when first used; indexed and iterated as a list of all
    `num_blocks`. A pool sized by bytes holds many blocks (1 GiB of the tiny model's KV is 131,072
    of them), and making them all up front took most of an engine's start (a Python object each),
    while most are never touched."""
    __slots__ = ("made", "num_blocks")

    def __init__(self, num_blocks: int):
        self.made: dict[int, Block] = {}
        self.num_blocks = num_blocks

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, block_id: int) -> Block:
        block = self.made.get(block_id)
        if block is None:
            if not 0 <= block_id < self.num_blocks:
                raise IndexError(f"block {block_id} of {self.num_blocks}")
            block = self.made[int(block_id)] = Block(int(block_id))
        return block

    def __iter__(self):
        return (self[i] for i in range(self.num_blocks))


def hash_block(parent: bytes | None, token_ids) -> bytes:
    """sha256 over the parent block's hash and this block's token ids. A cryptographic hash, so
    no one can craft a prompt whose blocks collide with another user's prefix (CVE-2025-25183)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(np.asarray(list(token_ids), dtype=np.int64).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise InvalidParameter("num_kv_blocks", f"must be at least 1, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = Blocks(num_blocks)
        # Blocks no one uses, in eviction order: the first is taken next. Blocks holding a cached
        # prefix go to the end when freed (least recently used first); empty ones to the front.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # published hash -> block id
        self.ops: list[tuple[BlockOp, int, int]] = []  # (op, source, destination), for the runner
        self.num_copies = 0                  # copy-on-write copies so far

    # -- pool state ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a published prefix (in use or free but not yet evicted)."""
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, seq) -> tuple[list[int], list[bytes]]:
        """Block ids and hashes of the longest cached prefix of seq's tokens.

        The last token is always left to compute (its logits give the next token), so a prompt
        that is cached whole still recomputes its last block.
        """
        if not self.enable_prefix_caching:
            return [], []
        ids, hashes, parent = [], [], None
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        return ids, hashes

    def publish(self, seq) -> None:
        """Publish the hashes of seq's blocks that are full and whose KV is now written."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached and block.hash is None:  # an equal block may already be cached
                self.cached[h] = block.block_id
                block.hash, block.token_ids = h, tokens

    # -- allocation ---------------------------------------------------------------------------
    def can_admit(self, seq, cached_ids: list[int], num_new_tokens: int) -> bool:
        """Can a waiting seq start, reusing cached_ids and computing num_new_tokens more?"""
        new = self.blocks_needed(len(cached_ids) * self.block_size + num_new_tokens) - len(cached_ids)
        reclaimed = sum(1 for b in cached_ids if self.blocks[b].ref_count == 0)  # counted as free now
        return new <= self.num_free_blocks - reclaimed

    def admit(self, seq, cached_ids: list[int], cached_hashes: list[bytes], num_new_tokens: int) -> None:
        for b in cached_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free[b]
            block.ref_count += 1
        seq.block_table = list(cached_ids)
        seq.block_hashes = list(cached_hashes)
        seq.num_computed_tokens = len(cached_ids) * self.block_size
        self.allocate(seq, num_new_tokens)

    def can_allocate(self, seq, num_new_tokens: int) -> bool:
        """Are there blocks for seq's next num_new_tokens (beyond those computed), a copy of a
        shared block they write into included?"""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need + (self._shared_write_block(seq) is not None) <= self.num_free_blocks

    def allocate(self, seq, num_new_tokens: int) -> None:
        """Append blocks to seq's table so its next num_new_tokens have slots (may_append); copy
        the block they start in if another sequence shares it (copy-on-write)."""
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError("allocate called without room; the scheduler checks can_allocate first")
        i = self._shared_write_block(seq)
        if i is not None:
            src = self.blocks[seq.block_table[i]]
            dst = self._take_free_block()
            src.ref_count -= 1                 # still >= 1: the others keep reading it
            seq.block_table[i] = dst
            self.ops.append((BlockOp.COPY, src.block_id, dst))
            self.num_copies += 1
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def _shared_write_block(self, seq) -> int | None:
        """Index in seq's table of the block its next token is written into, if others share it."""
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def fork(self, parent, child) -> None:
        """child takes parent's blocks (each block's reference count + 1) and computed tokens."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the cached prefix it held
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def free_blocks(self, seq) -> None:
        """Give back seq's blocks. Last blocks first, so a prefix's tail is evicted before its head."""
        self.release(seq)
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def release(self, seq) -> None:
        """Give back seq's blocks but keep its computed count (their contents went to the host pool)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)
        seq.block_table = []

    def take_blocks(self, count: int) -> list[int]:
        """count free blocks, each with reference count 1 (for a sequence swapped back in)."""
        if count > self.num_free_blocks:
            raise RuntimeError("take_blocks called without room")
        return [self._take_free_block() for _ in range(count)]

    def trim(self, seq) -> None:
        """Give back the blocks past seq's computed tokens (a speculative pass's rejected draft
        tokens, speculative.py): newly taken blocks that hold no computed token, never published."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]

    def ref_counts(self) -> list[int]:
        return [b.ref_count for b in self.blocks]
