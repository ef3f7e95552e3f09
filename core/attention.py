"""Attention over a packed batch, reading keys and values from a paged KV cache.

One engine step packs the new tokens of many sequences into one flat tensor of T tokens: a
prefill chunk of one request, the single next token of another, and so on (no padding in the
linear layers). Attention is the one place where sequences must stay apart, so this module
regroups the queries per sequence and gathers each sequence's keys from its KV blocks, the way
vLLM's PagedAttention reads a block table (Kwon et al., 2023), written here in plain torch:

    gather:  k_cache[layer][block_tables]  ->  (S, blocks * block_size, Hkv, D)
    attend:  softmax(q k^T / sqrt(D) + causal mask) v, one batched matmul per group

Sequences are split into a few groups of similar lengths (plan_groups), so that a long prefill
or a long context does not pad every other sequence to its length.

Batch invariance: every matmul here has a whole number of row panels (see gemm.py), and the
score matmul and the softmax take another kernel for very few keys, so a group reads at least
MIN_KEYS key slots (the extra ones masked). Padding keys or queries never changes a member's
result; this is why a batched request gives exactly the tokens it gives alone.
"""

import math
from dataclasses import dataclass

import torch

from .gemm import MIN_GEMM_ROWS
from .kv_cache import KVCache

MIN_KEYS = 16  # fewer keys than this switch the score matmul's and the softmax's kernels


def min_query_rows(num_heads: int, num_kv_heads: int) -> int:
    """Queries per sequence are padded to a multiple of this, so that the score matmul (G queries
    per KV head, G * Q rows) has a whole number of MIN_GEMM_ROWS-row panels."""
    group = num_heads // num_kv_heads
    return MIN_GEMM_ROWS // math.gcd(group, MIN_GEMM_ROWS)


def attend(q, k, v, mask):
    """Grouped-query attention with an explicit softmax.

    q: (S, Q, H, D) queries; k, v: (S, K, Hkv, D); mask: (S, Q, K) True where query may see key.
    Returns y (S, Q, H, D) and the attention weights (S, H, Q, K). Query head h reads KV head
    h // (H // Hkv), as in Llama's repeat_kv.
    """
    S, Q, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    q = q.view(S, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(S, Hkv, G * Q, D)  # rows (g, i)
    scores = (q @ k.permute(0, 2, 3, 1)) * (1.0 / math.sqrt(D))          # (S, Hkv, G*Q, K)
    allowed = mask[:, None, None].expand(S, 1, G, Q, -1).reshape(S, 1, G * Q, -1)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    y = probs @ v.transpose(1, 2)                                        # (S, Hkv, G*Q, D)
    y = y.view(S, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(S, Q, H, D)
    return y, probs.view(S, H, Q, -1)


def causal_attention(q, k, v):
    """One whole sequence, no cache. q: (T, H, D), k, v: (T, Hkv, D) -> (T, H, D), (H, T, T)."""
    T = q.shape[0]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    y, probs = attend(q[None], k[None], v[None], mask[None])
    return y[0], probs[0]


@dataclass
class SequenceGroup:
    """Sequences attended together: queries padded to Q, keys gathered to K = blocks * block_size."""

    token_index: torch.Tensor   # (S, Q) index into the packed tokens (padding repeats a real one)
    query_mask: torch.Tensor    # (S, Q) True where the query is a real token
    block_tables: torch.Tensor  # (S, nb) physical block ids (padding points at block 0)
    mask: torch.Tensor          # (S, Q, K) causal mask: key position <= query position


@dataclass
class PagedBatch:
    """Where one step's packed tokens go in the pool and which keys each may read."""

    cache: KVCache
    slot_mapping: torch.Tensor  # (T,) pool slot of each new token's K and V
    groups: list[SequenceGroup]


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


def build_group(seqs, block_size: int, min_rows: int) -> SequenceGroup:
    """seqs: list of (first packed index, num_query_tokens, first position, block_table)."""
    S = len(seqs)
    Q = -(-max(n for _, n, _, _ in seqs) // min_rows) * min_rows
    nb = max(-(-MIN_KEYS // block_size), max(len(table) for _, _, _, table in seqs))
    rows = torch.arange(Q)
    token_index = torch.empty(S, Q, dtype=torch.long)
    query_pos = torch.empty(S, Q, dtype=torch.long)
    block_tables = torch.zeros(S, nb, dtype=torch.long)
    lens = torch.empty(S, dtype=torch.long)
    for i, (start, n, pos, table) in enumerate(seqs):
        token_index[i] = start + rows.clamp(max=n - 1)
        query_pos[i] = pos + rows
        lens[i] = n
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
    key_pos = torch.arange(nb * block_size)
    return SequenceGroup(
        token_index=token_index,
        query_mask=rows[None, :] < lens[:, None],
        block_tables=block_tables,
        mask=key_pos[None, None, :] <= query_pos[:, :, None],
    )


def paged_attention(q, k, v, layer: int, batch: PagedBatch):
    """q: (T, H, D), k, v: (T, Hkv, D) for the step's new tokens -> (T, H, D).

    Writes the new K and V into their slots first, so a token attends to itself and to all
    earlier tokens of its sequence, whether computed this step or in an earlier one.
    """
    cache = batch.cache
    Hkv, D = k.shape[1], k.shape[2]
    cache.k[layer].view(-1, Hkv, D).index_copy_(0, batch.slot_mapping, k)
    cache.v[layer].view(-1, Hkv, D).index_copy_(0, batch.slot_mapping, v)
    out = torch.empty_like(q)
    for g in batch.groups:
        keys = cache.k[layer][g.block_tables].flatten(1, 2)    # (S, K, Hkv, D)
        values = cache.v[layer][g.block_tables].flatten(1, 2)
        y, _ = attend(q[g.token_index], keys, values, g.mask)  # (S, Q, H, D)
        out[g.token_index[g.query_mask]] = y[g.query_mask]
    return out
