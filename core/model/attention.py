"""Attention over a packed batch, reading keys and values from a paged KV cache.

One engine step packs the new tokens of many sequences into one flat tensor of T tokens: a
prefill chunk of one request, the single next token of another, and so on (no padding in the
linear layers). Attention is the one place where sequences must stay apart: each token reads the
keys and values of its own sequence, 0..its position, through the sequence's block table, the way
vLLM's PagedAttention does (Kwon et al., 2023).

Two implementations, one contract (a token's output depends on nothing but its own query and its
sequence's keys and values, so a request gives the same bits alone, batched or chunked):

- the kernel in C++ (csrc/paged_attention.cpp), used wherever the extension builds (native.py):
  one fixed sequence of float operations per query row, reading the pool in place, with no
  padding; invariant by construction.
- the torch path below, where it cannot be built: sequences are regrouped (plan_groups), their
  blocks gathered, and softmax(q k^T / sqrt(D) + causal mask) v computed with one batched matmul
  per group. Every matmul there has a whole number of row panels (see gemm.py), and the score
  matmul and the softmax take another kernel for very few keys, so a group reads at least
  MIN_KEYS key slots (the extra ones masked); padding keys or queries never changes a member's
  result. The two paths round differently, so an engine uses one of them throughout.

bfloat16 operands (the q4_1 format on the engine's own kernels, model.Attention.bf16_operands):
the kernel rounds the query (times 1/sqrt(D)), the keys, the values and the softmax's numerators
exp(score - max) to bfloat16, and sums their products (exact in fp32) in fp32; the denominator is
the sum of the rounded numerators. Where the CPU has AVX-512 BF16, VDPBF16PS then does two of those
multiply-adds per lane and instruction, which halves the arithmetic of a long prompt's attention.
q4_1 is judged by its quality figures against fp32 (top-5 agreement, KL, perplexity), which
include these roundings, not by fp32's parity bound. `attend` rounds the same numbers for one whole
sequence; the torch path of paged_attention has fp32 only.

`attend` and `causal_attention` (the explicit softmax, with the attention weights) also serve the
widgets that look inside the model (probes.py).

KV eviction (StreamingLLM: Xiao et al., 2023, "Efficient Streaming Language Models with Attention
Sinks"): an engine may keep only the first `sink_tokens` keys of a sequence plus a sliding window
of its last `window` (Eviction). Both paths apply it as a mask on the scores: the evicted keys'
blocks stay in the pool (nothing is freed), and a token keeps its own position for RoPE (StreamingLLM
renumbers the positions inside the cache so that it can run past the context window; inside the
window, as here, the model's own positions are the ones it was trained on). What the rule would
keep in memory is (sink_tokens + window) tokens' keys and values per sequence: Eviction.kept_tokens.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from core.errors import InvalidParameter
from core.model.kv_cache import KVCache
from core.model.linear import MIN_GEMM_ROWS

MIN_KEYS = 16  # fewer keys than this switch the score matmul's and the softmax's kernels


@dataclass(frozen=True)
class Eviction:
    """Which keys a query still sees: every one (window 0), or the first `sink_tokens` and the
    last `window` up to its own position (query p sees key j when j < sink_tokens or p - window < j)."""

    sink_tokens: int = 0
    window: int = 0

    @property
    def active(self) -> bool:
        return self.window > 0

    def visible(self, query_pos, key_pos):
        """Broadcast numpy or torch positions -> True where the query sees the key (causal too)."""
        seen = key_pos <= query_pos
        if self.active:
            seen = seen & ((key_pos < self.sink_tokens) | (key_pos > query_pos - self.window))
        return seen

    def kept_tokens(self, num_tokens: int) -> int:
        """Tokens whose keys and values a sequence of num_tokens would keep under the rule."""
        return num_tokens if not self.active else min(num_tokens, self.sink_tokens + self.window)


FULL = Eviction()


def min_query_rows(num_heads: int, num_kv_heads: int) -> int:
    """Queries per sequence are padded to a multiple of this, so that the score matmul (G queries
    per KV head, G * Q rows) has a whole number of MIN_GEMM_ROWS-row panels."""
    group = num_heads // num_kv_heads
    return MIN_GEMM_ROWS // math.gcd(group, MIN_GEMM_ROWS)


def attend(q, k, v, mask, blocked=None, mask_from: int = 0, bf16: bool = False):
    """Grouped-query attention with an explicit softmax.

    q: (S, Q, H, D) queries; k, v: (S, K, Hkv, D); mask: (S, Q, K) True where query may see key.
    blocked: the mask laid out for the scores from column `mask_from` on, (S, 1, G*Q, K - mask_from)
    True where a key is hidden, if the caller has it already (paged_attention makes it once per
    step, not per layer). Every query sees the keys before `mask_from` (the context before a
    chunk), so only the columns after it are masked: at a long context that is most of the scores.
    Returns y (S, Q, H, D) and the attention weights (S, H, Q, K). Query head h reads KV head
    h // (H // Hkv), as in Llama's repeat_kv. The 1/sqrt(D) scale is applied to q before the
    product: for D a power of 4 (64 here) it is a power of two, so the bits are the same as
    scaling the (much larger) scores.
    bf16: the operands rounded as the C++ kernel's bf16 mode rounds them (the module docstring:
    bfloat16 operands), the same numbers summed in another order (one whole sequence: the
    widgets and Transformer.score).
    """
    S, Q, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    q = q * (1.0 / math.sqrt(D))
    if bf16:
        q, k, v = (to_bf16(t) for t in (q, k, v))
    q = q.view(S, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(S, Hkv, G * Q, D)
    scores = q @ k.permute(0, 2, 3, 1)                                   # (S, Hkv, G*Q, K), rows (g, i)
    if blocked is None:
        mask_from = first_blocked_column(mask)
        blocked = score_mask(mask[..., mask_from:], G)
    scores[..., mask_from:].masked_fill_(blocked, float("-inf"))
    if bf16:
        e = to_bf16(torch.exp(scores - scores.amax(-1, keepdim=True)))  # the numerators, rounded
        probs = e / e.sum(-1, keepdim=True)
    else:
        probs = torch.softmax(scores, dim=-1)
    y = probs @ v.transpose(1, 2)                                        # (S, Hkv, G*Q, D)
    y = y.view(S, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(S, Q, H, D)
    return y, probs.view(S, H, Q, -1)


def first_blocked_column(mask) -> int:
    """The first key that some query may not see (mask: (S, Q, K)); K if every query sees all."""
    hidden = (~mask).any(dim=0).any(dim=0).nonzero()
    return int(hidden[0]) if len(hidden) else mask.shape[-1]


def score_mask(mask, G: int):
    """(S, Q, K) True where a query may see a key -> (S, 1, G*Q, K) True where it may not, in the
    row order of attend's scores (g, i)."""
    S, Q, K = mask.shape
    return ~mask[:, None, None].expand(S, 1, G, Q, K).reshape(S, 1, G * Q, K)


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (to nearest even), kept as fp32."""
    return x.to(torch.bfloat16).to(x.dtype)


def causal_attention(q, k, v, eviction: Eviction = FULL, bf16: bool = False):
    """One whole sequence, no cache. q: (T, H, D), k, v: (T, Hkv, D) -> (T, H, D), (H, T, T).
    bf16: the kernel's bf16 operands (attend)."""
    T = q.shape[0]
    pos = torch.arange(T)
    mask = eviction.visible(pos[:, None], pos[None, :])                   # (T, T)
    y, probs = attend(q[None], k[None], v[None], mask[None], bf16=bf16)
    return y[0], probs[0]


@dataclass
class SequenceGroup:
    """Sequences attended together: queries padded to Q, keys gathered to K = blocks * block_size."""

    token_index: torch.Tensor   # (S, Q) index into the packed tokens (padding repeats a real one)
    query_mask: torch.Tensor    # (S, Q) True where the query is a real token
    block_tables: torch.Tensor  # (S, nb) physical block ids (padding points at block 0)
    mask: torch.Tensor          # (S, Q, K) causal mask: key position <= query position
    # Derived once per step, read by every layer: flat indices for index_select / index_copy_.
    flat_blocks: torch.Tensor = None   # (S * nb,) block_tables flattened
    flat_tokens: torch.Tensor = None   # (S * Q,) token_index flattened
    real_rows: torch.Tensor = None     # (R,) rows of the (S * Q) queries that are real tokens
    real_tokens: torch.Tensor = None   # (R,) their packed index
    blocked: torch.Tensor = None       # (S, 1, G * Q, K - mask_from) score mask for attend, made by the first layer
    mask_from: int = 0                 # keys before this are seen by every query (see attend)
    in_order: bool = False             # real queries are packed tokens 0..R-1 in order (no scatter)

    def __post_init__(self):
        if self.flat_blocks is None:
            self.flat_blocks = self.block_tables.reshape(-1)
            self.flat_tokens = self.token_index.reshape(-1)
            self.real_rows = self.query_mask.reshape(-1).nonzero().squeeze(1)
            self.real_tokens = self.flat_tokens[self.real_rows]
            self.in_order = torch.equal(self.real_tokens, torch.arange(len(self.real_tokens)))

    def score_mask(self, G: int) -> torch.Tensor:
        """`blocked` for query groups of G heads, made once per step (the first layer asks)."""
        if self.blocked is None:
            self.mask_from = first_blocked_column(self.mask)
            self.blocked = score_mask(self.mask[..., self.mask_from:], G)
        return self.blocked


@dataclass
class PagedBatch:
    """Where one step's packed tokens go in the pool and which keys each may read."""

    cache: KVCache
    slot_mapping: torch.Tensor  # (T,) pool slot of each new token's K and V
    block_tables: torch.Tensor  # (S, nb) each sequence's blocks, as far as this step reads (0-padded)
    token_seq: torch.Tensor     # (T,) each token's row of block_tables
    positions: torch.Tensor     # (T,) each token's position: it reads keys 0..position
    kernel: object = None       # the C++ extension (core.kernels.loader.extension()); None: the torch path
    groups: list["SequenceGroup"] = field(default_factory=list)  # the torch path's groups (plan_groups)
    eviction: Eviction = FULL   # the engine's KV eviction rule (a mask in both paths)


MAX_PADDING = 1.5                # a group may do at most this much more work than its members alone
PADDING_SLACK = 4096             # ... plus this many query-key pairs (small groups stay together)
MAX_GROUP_PAIRS = 4 * 1024 * 1024  # query-key pairs in one group's scores (x heads x 4 bytes)


def plan_groups(seqs, block_size: int, min_rows: int) -> list[list]:
    """Split the step's sequences into groups that attend together.

    A group pads every member to its longest query run and its longest key run, so one long
    context next to many short ones would multiply the work. Sequences are sorted (decodes first,
    then by key length) and a new group starts when padding would cost more than MAX_PADDING
    times the members' own work. The number of groups stays small (it grows with the spread of
    lengths, not with the batch), and padding never changes a member's result (see above).
    seqs: list of (first packed index, num_query_tokens, first position, block_table).
    """
    def rows(n):
        return -(-n // min_rows) * min_rows

    def keys(table):
        return max(MIN_KEYS, len(table) * block_size)

    groups, current = [], []
    max_q = max_k = own = 0
    for seq in sorted(seqs, key=lambda s: (s[1] > 1, len(s[3]), s[1])):
        q, k = rows(seq[1]), keys(seq[3])
        new_q, new_k, new_own = max(max_q, q), max(max_k, k), own + q * k
        padded = (len(current) + 1) * new_q * new_k
        if current and (padded > MAX_PADDING * new_own + PADDING_SLACK or padded > MAX_GROUP_PAIRS):
            groups.append(current)
            current, new_q, new_k, new_own = [], q, k, q * k
        current.append(seq)
        max_q, max_k, own = new_q, new_k, new_own
    if current:
        groups.append(current)
    return groups


def build_group(seqs, block_size: int, min_rows: int, eviction: Eviction = FULL) -> SequenceGroup:
    """seqs: list of (first packed index, num_query_tokens, first position, block_table)."""
    S = len(seqs)
    Q = -(-max(n for _, n, _, _ in seqs) // min_rows) * min_rows
    nb = max(-(-MIN_KEYS // block_size), max(len(table) for _, _, _, table in seqs))
    starts = np.array([start for start, _, _, _ in seqs], dtype=np.int64)[:, None]
    lens = np.array([n for _, n, _, _ in seqs], dtype=np.int64)[:, None]
    first = np.array([pos for _, _, pos, _ in seqs], dtype=np.int64)[:, None]
    rows = np.arange(Q, dtype=np.int64)[None, :]
    block_tables = np.zeros((S, nb), dtype=np.int64)
    for i, (_, _, _, table) in enumerate(seqs):
        block_tables[i, : len(table)] = table
    query_pos = first + rows                                            # (S, Q)
    key_pos = np.arange(nb * block_size, dtype=np.int64)
    return SequenceGroup(
        token_index=torch.from_numpy(starts + np.minimum(rows, lens - 1)),
        query_mask=torch.from_numpy(rows < lens),
        block_tables=torch.from_numpy(block_tables),
        mask=torch.from_numpy(eviction.visible(query_pos[:, :, None], key_pos[None, None, :])),
    )


def paged_attention(q, k, v, layer: int, batch: PagedBatch, bf16: bool = False):
    """q: (T, H, D), k, v: (T, Hkv, D) for the step's new tokens -> (T, H, D).

    Writes the new K and V into their slots first, so a token attends to itself and to all
    earlier tokens of its sequence, whether computed this step or in an earlier one.
    bf16: the kernel's bfloat16 operands (the module docstring); the torch path has only fp32.
    """
    cache = batch.cache
    if batch.kernel is not None:
        batch.kernel.write_kv(cache.k[layer], cache.v[layer], batch.slot_mapping, k, v)
        return batch.kernel.paged_attention(q, cache.k[layer], cache.v[layer], batch.block_tables,
                                            batch.token_seq, batch.positions, batch.eviction.sink_tokens,
                                            batch.eviction.window, bf16)
    if bf16:
        raise InvalidParameter("bf16", "bfloat16 attention operands are the C++ kernel's; the torch path is fp32")
    Hkv, D = k.shape[1], k.shape[2]
    H = q.shape[1]
    keys_pool, values_pool = cache.token_major(layer)          # (blocks, block_size, Hkv, D) views
    block, offset = batch.slot_mapping // cache.block_size, batch.slot_mapping % cache.block_size
    keys_pool[block, offset] = k
    values_pool[block, offset] = v
    out = None
    for g in batch.groups:
        S, Q = g.token_index.shape
        keys = keys_pool[g.flat_blocks].reshape(S, -1, Hkv, D)                      # (S, K, Hkv, D)
        values = values_pool[g.flat_blocks].reshape(S, -1, Hkv, D)
        y, _ = attend(q.index_select(0, g.flat_tokens).view(S, Q, H, D), keys, values, g.mask,
                      g.score_mask(H // Hkv), g.mask_from)
        rows = y.reshape(S * Q, H, D).index_select(0, g.real_rows)          # (R, H, D)
        if len(batch.groups) == 1 and g.in_order and len(g.real_rows) == q.shape[0]:
            return rows                                   # one group of every token, in order
        if out is None:
            out = torch.empty_like(q)
        out.index_copy_(0, g.real_tokens, rows)
    return out
