"""Looking inside the model for the widgets, with forward hooks: the model itself stays clean.

A probe runs one uncached forward pass over a short text, one block at a time, and records what
the widgets draw: each layer's rotated queries and keys, its attention weights, and the sizes of
the updates the attention and the MLP add to the residual stream (the "residual stream" view of
Elhage et al., 2021, "A Mathematical Framework for Transformer Circuits"). It is a probe layer
around the model: it calls the model's own modules block by block (the way TransformerLens
exposes a model's activations, but without hook code inside the model), so core/model/model.py has no
code for it.

`slices()` is a generator that pauses after each small piece of work, so the web app can run a
long probe between serving steps and never stall a chat by more than one slice. Attention is
computed with the engine's own `attend` (the function the forward uses), split by query rows, so
the weights are the model's own, not an approximation.
"""

from dataclasses import dataclass

import torch

from core.errors import InvalidParameter, is_int
from core.model.attention import FULL, Eviction, attend
from core.model.model import Transformer


@dataclass
class LayerRecord:
    """What one block did to a sequence of T tokens (query heads H, KV heads Hkv, head size D)."""

    layer: int
    q: torch.Tensor                  # (T, H, D) queries after RoPE
    k: torch.Tensor                  # (T, Hkv, D) keys after RoPE
    q_raw: torch.Tensor              # (T, H, D) queries before RoPE
    k_raw: torch.Tensor              # (T, Hkv, D) keys before RoPE
    attention: torch.Tensor | None   # (H, T, T) softmax weights, zero above the diagonal
    entropy: torch.Tensor | None     # (H, T) entropy in nats of each query's attention row (None: not asked)
    attn_update: torch.Tensor        # (T,) L2 norm of what attention adds to the residual
    mlp_update: torch.Tensor         # (T,) L2 norm of what the MLP adds
    residual: torch.Tensor           # (T,) L2 norm of the residual stream after the block


def check_index(name: str, value, size: int) -> int:
    if not is_int(value) or not 0 <= value < size:
        raise InvalidParameter(name, f"must be an integer from 0 to {size - 1}, got {value!r}")
    return value


ROWS = 64                    # tokens through a linear layer per slice
ATTENTION_CELLS = 1 << 19    # query-key pairs x heads per slice of attention


@torch.inference_mode()
def slices(model: Transformer, ids: list[int], attention: bool | set[int] = False, eviction: Eviction = FULL,
           entropies: bool = True):
    """Run `ids` through the model in small slices: yields None after each slice of work and a
    LayerRecord when a block is done. A slice is at most ROWS tokens through a linear layer or
    ATTENTION_CELLS query-key pairs of attention, so a caller can pause between slices for
    serving steps, however long the text.

    Each block is run from its own modules, as Block.forward and Attention.forward do on the
    uncached path (norm, fused q/k/v, RoPE, causal `attend`, output projection, residual add;
    norm, MLP, residual add), with the attention split by query rows. attention: True keeps every
    layer's weights, a set of layer indices keeps some, False none. entropies: each query row's
    attention entropy per head (LayerRecord.entropy; None when False: a caller that wants only the
    residual stream, such as a perplexity, skips that work).
    eviction: the keys each query still sees (attention.Eviction; every earlier one by default).
    Returns (to `yield from`) the residual stream after the last block (T, C), before the final norm.
    """
    cfg = model.config
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    T = len(ids)
    positions = torch.arange(T)
    x = model.embed_tokens(torch.tensor(ids, dtype=torch.long))            # (T, C)
    for i, block in enumerate(model.layers):
        attn, keep = block.attn, attention is True or bool(attention and i in attention)
        qkv = yield from by_rows(attn.qkv_proj, block.attn_norm(x))          # (T, (H+2Hkv)D)
        q_raw, k_raw, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q_raw, k_raw, v = q_raw.view(T, H, D), k_raw.view(T, Hkv, D), v.view(T, Hkv, D)
        q, k = model.rotary(q_raw, positions), model.rotary(k_raw, positions)
        y = torch.empty(T, H, D)
        weights = torch.empty(H, T, T) if keep else None   # filled (and paged in) chunk by chunk
        ent = torch.empty(H, T) if entropies else None
        rows = max(1, ATTENTION_CELLS // (T * H))
        for start in range(0, T, rows):
            end = min(T, start + rows)
            mask = eviction.visible(positions[start:end, None], torch.arange(end)[None, :])  # (Q, K) causal
            out, w = attend(q[None, start:end], k[None, :end], v[None, :end], mask[None])
            y[start:end] = out[0]                                            # (Q, H, D)
            if entropies:
                ent[:, start:end] = entropy(w[0])                            # (H, Q)
            if keep:
                weights[:, start:end, :end] = w[0]
                weights[:, start:end, end:] = 0                              # above the diagonal
            yield None
        a = yield from by_rows(attn.o_proj, y.reshape(T, H * D))            # (T, C)
        x = x + a
        parts = []
        for h in block.mlp_norm(x).split(ROWS):
            parts.append(block.mlp(h).float())                               # (rows, C)
            if len(parts) * ROWS < T:
                yield None
        m = torch.cat(parts)                                                 # (T, C)
        x = x + m
        yield LayerRecord(layer=i, q=q, k=k, q_raw=q_raw, k_raw=k_raw, attention=weights, entropy=ent,
                          attn_update=a.norm(dim=-1), mlp_update=m.norm(dim=-1), residual=x.norm(dim=-1))
    return x


def by_rows(linear, x: torch.Tensor):
    """linear(x) ROWS tokens at a time, pausing (yield None) after each piece; returns the (T, out)
    fp32 result (`yield from` hands it to the caller)."""
    parts = []
    for piece in x.split(ROWS):
        parts.append(linear(piece).float())                                  # (rows, out)
        yield None
    return torch.cat(parts)


def layers(model: Transformer, ids: list[int], attention: bool | set[int] = False):
    """Like `slices`, yielding only the LayerRecords."""
    return (r for r in slices(model, ids, attention) if r is not None)


def run(model: Transformer, ids: list[int], attention: bool | set[int] = False) -> list[LayerRecord]:
    """Every layer at once (for tests and scripts; the web app iterates `layers` in slices)."""
    return list(layers(model, ids, attention))


def entropy(weights: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each attention row: (..., T) -> (...)."""
    return -(weights * torch.log(weights.clamp_min(1e-30))).sum(-1)
