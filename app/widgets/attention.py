"""Widget `attention` (section 6): the real attention weights of one layer, for one head or all.

Messages (jobs, cached by their inputs):
- `attention` {text, layer, head} -> the causal weight matrix of one head, or of every head of
  the layer (`head: "all"`, for small multiples), as lower-triangle rows; binned into b x b token
  blocks when the text is long, so the reply stays under a fixed size.
- `attention_row` {text, layer, head, query} -> one query token's full row (never binned): what
  the widget draws as bars when a reader clicks a token.

The weights are the model's own: core/inspect/probes.slices runs the text through the blocks up to
`layer`, computing each block's softmax(q k^T / sqrt(D)) with the causal mask by the engine's
own `attend`, a few query rows per slice (Vaswani et al., 2017; grouped-query attention, where query
head h reads KV head h // (H / Hkv), as in Ainslie et al., 2023). The pass stops after that layer.
A layer's full weights are kept for a few texts (WeightCache), so switching head or asking for a
row does not run the model again.

Binning: with n = ceil(T / b) blocks of b tokens, cell (I, J) is the mean over the queries of
block I of the summed weight on the keys of block J. Each binned row still sums to 1 and the
cells above the diagonal stay 0. b is the smallest size that keeps the lower triangles of all the
heads in the reply within MAX_CELLS numbers.
"""

import weakref
from collections import OrderedDict

import torch

from core.errors import InvalidParameter, is_int
from core.inspect import probes

from ..jobs import Progress
from .base import Widget, encode, message, required, text
from .seam import token_list

MAX_CELLS = 65_536          # numbers in one reply's matrices, all heads together (lower triangles)
DIGITS = 6                  # decimals kept in a reply (weights are probabilities; 1e-6 is far below what shows)
CACHE_VALUES = 3 * 9 * 1024 * 1024  # float32 weights kept across jobs (about 113 MB at most)


# ---- validation -------------------------------------------------------------------------------

def layer_of(msg: dict, num_layers: int) -> int:
    value = required(msg, "layer")
    return probes.check_index("layer", value, num_layers)


def heads_of(msg: dict, num_heads: int) -> list[int]:
    """The query heads asked for: one index, or every head for "all"."""
    value = required(msg, "head")
    if value == "all":
        return list(range(num_heads))
    if not is_int(value) or not 0 <= value < num_heads:
        raise InvalidParameter("head", f'must be an integer from 0 to {num_heads - 1} or "all", got {value!r}')
    return [value]


def query_of(msg: dict, num_tokens: int) -> int:
    value = required(msg, "query")
    if not is_int(value) or not 0 <= value < num_tokens:
        raise InvalidParameter("query", f"must be a token index from 0 to {num_tokens - 1} "
                                        f"(the text has {num_tokens} tokens), got {value!r}")
    return value


# ---- the layer's weights, computed once per (text, layer) ----------------------------------------

class WeightCache:
    """Full attention weights (H, T, T) of recent (ids, layer) pairs, least recently used out first.
    Read and written only on the engine loop's thread (inside jobs), so it needs no lock."""

    def __init__(self, max_values: int):
        self.max_values = max_values
        self.entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def get(self, key: tuple) -> torch.Tensor | None:
        weights = self.entries.get(key)
        if weights is not None:
            self.entries.move_to_end(key)
        return weights

    def put(self, key: tuple, weights: torch.Tensor) -> None:
        self.entries[key] = weights
        while sum(w.numel() for w in self.entries.values()) > self.max_values and len(self.entries) > 1:
            self.entries.popitem(last=False)


_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its WeightCache


def weight_cache(model) -> WeightCache:
    """The cache of one model's weights (two apps in a process, e.g. tests, never share one)."""
    cache = _CACHES.get(model)
    if cache is None:
        cache = _CACHES[model] = WeightCache(CACHE_VALUES)
    return cache


def layer_weights(engine, ids: list[int], layer: int):
    """A generator of slices (Progress or None) returning the layer's weights (H, T, T)."""
    key = (tuple(ids), layer)
    cache = weight_cache(engine.view.reference_model)
    weights = cache.get(key)
    if weights is not None:
        return weights
    for item in probes.slices(engine.view.reference_model, ids, attention={layer}):
        if item is None:
            yield None
            continue
        yield Progress(item.layer + 1, layer + 1, f"layer {item.layer} of {layer}")
        if item.layer == layer:
            weights = item.attention                                   # (H, T, T)
            break
    cache.put(key, weights)
    return weights


# ---- shaping the reply ----------------------------------------------------------------------------

def bin_size_for(num_tokens: int, num_heads: int, max_cells: int = MAX_CELLS) -> int:
    """The smallest block size b whose binned lower triangles, for num_heads heads, fit max_cells."""
    b = 1
    while True:
        n = -(-num_tokens // b)
        if num_heads * n * (n + 1) // 2 <= max_cells:
            return b
        b += 1


def binned(weights: torch.Tensor, b: int) -> torch.Tensor:
    """(H, T, T) -> (H, n, n), n = ceil(T / b): per block of queries, the mean of their summed
    weight on each block of keys (rows still sum to 1; the last blocks may be short)."""
    if b == 1:
        return weights
    H, T, _ = weights.shape
    n = -(-T // b)
    padded = weights.new_zeros(H, n * b, n * b)
    padded[:, :T, :T] = weights
    sums = padded.view(H, n * b, n, b).sum(-1)                        # (H, n*b, n): per query, per key block
    sums = sums.view(H, n, b, n).sum(2)                               # (H, n, n): summed over block queries
    counts = torch.full((n,), float(b))
    counts[-1] = T - (n - 1) * b                                      # queries in the last block
    return sums / counts[None, :, None]


def triangle_rows(matrix: torch.Tensor) -> list[list[float]]:
    """(n, n) lower-triangular -> its rows without the masked part: row i has i + 1 numbers."""
    rounded = matrix.double().round(decimals=DIGITS).tolist()
    return [row[: i + 1] for i, row in enumerate(rounded)]


def head_summary(weights: torch.Tensor) -> dict:
    """Per-head figures over the exact (H, T, T) weights."""
    T = weights.shape[-1]
    sink = weights[:, 1:, 0].mean(-1) if T > 1 else weights[:, 0, 0]  # (H,) mean weight on token 0
    previous = weights.diagonal(offset=-1, dim1=1, dim2=2).mean(-1) if T > 1 else torch.zeros(weights.shape[0])
    return {"sink_weight": [round(float(v), DIGITS) for v in sink],
            "previous_weight": [round(float(v), DIGITS) for v in previous]}


# ---- the handlers -------------------------------------------------------------------------------

def attention(call) -> None:
    info = call.info
    layer = layer_of(call.msg, info["num_layers"])
    heads = heads_of(call.msg, info["num_heads"])
    ids = encode(call, text(call.msg))
    group = info["num_heads"] // info["num_kv_heads"]
    tokens = token_list(call.tokenizer, ids)

    def work(engine):
        weights = yield from layer_weights(engine, ids, layer)        # (H, T, T)
        chosen = weights[heads]                                       # (h, T, T)
        b = bin_size_for(len(ids), len(heads))
        cells = binned(chosen, b)                                     # (h, n, n)
        yield None
        rows = []
        for matrix in cells:
            rows.append(triangle_rows(matrix))
            yield None
        summary = head_summary(chosen)
        return {
            "layer": layer, "head": call.msg["head"], "heads": heads,
            "kv_heads": [h // group for h in heads], "group_size": group,
            "num_tokens": len(ids), "tokens": tokens,
            "bin_size": b, "num_bins": cells.shape[-1], "max_cells": MAX_CELLS,
            "weights": rows, **summary,
        }

    call.job({"ids": ids, "layer": layer, "heads": heads}, work)


def attention_row(call) -> None:
    info = call.info
    layer = layer_of(call.msg, info["num_layers"])
    heads = heads_of(call.msg, info["num_heads"])
    ids = encode(call, text(call.msg))
    query = query_of(call.msg, len(ids))
    group = info["num_heads"] // info["num_kv_heads"]

    def work(engine):
        weights = yield from layer_weights(engine, ids, layer)        # (H, T, T)
        row = weights[heads, query, : query + 1]                      # (h, query + 1)
        return {
            "layer": layer, "head": call.msg["head"], "heads": heads,
            "kv_heads": [h // group for h in heads], "query": query, "num_tokens": len(ids),
            "weights": row.double().round(decimals=DIGITS).tolist(),
        }

    call.job({"ids": ids, "layer": layer, "heads": heads, "query": query}, work)


WIDGET = Widget("attention", messages=(
    message("attention", {"text", "layer", "head"}, attention, job=True),
    message("attention_row", {"text", "layer", "head", "query"}, attention_row, job=True),
))
