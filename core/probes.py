"""Looking inside the model for the widgets, from outside it: the model itself stays clean.

A probe runs one uncached forward pass over a short text, one block at a time, and records what
the widgets draw: each layer's rotated queries and keys, its attention weights, and the sizes of
the updates the attention and the MLP add to the residual stream (the "residual stream" view of
Elhage et al., 2021, "A Mathematical Framework for Transformer Circuits"). It calls the model's own
modules and functions, block by block: the norms, the fused q/k/v projection, the rotary embedding,
the engine's `attend` and the output projection, as Attention.forward does, so core/model.py has no
code for it and the weights are the model's weights, not an approximation.

`slices()` is a generator that pauses after each small piece of work, so the web app can run a
long probe between serving steps and never stall a chat by more than one slice. A block's attention
is computed in slices of ATTENTION_ROWS queries (each query reads every key before it), so a text
of a thousand tokens costs many short slices, not one long one. Every matrix multiply goes through
the model's batch-invariant linear layers in whole panels, so the slices give the same numbers as
one pass.
"""

from dataclasses import dataclass

import torch

from .attention import attend
from .errors import InvalidParameter, is_int
from .model import Transformer


@dataclass
class LayerRecord:
    """What one block did to a sequence of T tokens (query heads H, KV heads Hkv, head size D)."""

    layer: int
    q: torch.Tensor                  # (T, H, D) queries after RoPE
    k: torch.Tensor                  # (T, Hkv, D) keys after RoPE
    q_raw: torch.Tensor              # (T, H, D) queries before RoPE
    k_raw: torch.Tensor              # (T, Hkv, D) keys before RoPE
    attention: torch.Tensor | None   # (H, T, T) softmax weights, zero above the diagonal
    attn_update: torch.Tensor        # (T,) L2 norm of what attention adds to the residual
    mlp_update: torch.Tensor         # (T,) L2 norm of what the MLP adds
    residual: torch.Tensor           # (T,) L2 norm of the residual stream after the block


def check_index(name: str, value, size: int) -> int:
    if not is_int(value) or not 0 <= value < size:
        raise InvalidParameter(name, f"must be an integer from 0 to {size - 1}, got {value!r}")
    return value


MLP_ROWS = 256  # the MLP runs over at most this many tokens per slice (it is per token, so exact)
ATTENTION_ROWS = 128  # queries per slice of a block's attention (and rows per slice of its q/k/v projection)


def _attention(block, rotary, h: torch.Tensor, positions: torch.Tensor, want_weights: bool):
    """A block's attention update for h (T, C), as Attention.forward computes it, in slices of
    ATTENTION_ROWS rows: a generator of None returning (update (T, C), q, k, q_raw, k_raw, weights)."""
    attn = block.attn
    H, Hkv, D = attn.H, attn.Hkv, attn.D
    T = h.shape[0]
    qkv = h.new_empty(T, (H + 2 * Hkv) * D)
    for start in range(0, T, ATTENTION_ROWS):
        qkv[start:start + ATTENTION_ROWS] = attn.qkv_proj(h[start:start + ATTENTION_ROWS])   # (rows, (H+2Hkv)D)
        yield None
    q_raw, k_raw, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q_raw, k_raw, v = q_raw.view(T, H, D), k_raw.view(T, Hkv, D), v.view(T, Hkv, D)
    q, k = rotary(q_raw, positions), rotary(k_raw, positions)            # (T, H, D), (T, Hkv, D)
    update = torch.empty_like(h)                                         # (T, C)
    weights = h.new_zeros(H, T, T) if want_weights else None             # zero above the diagonal
    for start in range(0, T, ATTENTION_ROWS):
        end = min(T, start + ATTENTION_ROWS)
        mask = positions[None, :end] <= positions[start:end, None]       # (rows, end): causal
        y, probs = attend(q[None, start:end], k[None, :end], v[None, :end], mask[None])  # (1, rows, H, D)
        update[start:end] = attn.o_proj(y[0].reshape(end - start, H * D))
        if weights is not None:
            weights[:, start:end, :end] = probs[0]                       # (H, rows, end)
        yield None
    return update, q, k, q_raw, k_raw, weights


@torch.inference_mode()
def slices(model: Transformer, ids: list[int], attention: bool | set[int] = False):
    """Run `ids` through the model in small slices: yields None after each slice of work and a
    LayerRecord when a block is done. A slice is up to ATTENTION_ROWS rows of a block's q/k/v
    projection or of its attention (with the weights, when asked for), or up to MLP_ROWS tokens of
    its MLP, so a caller can pause between slices for serving steps.

    attention: True for every layer's weights, a set of layer indices for some, False for none.
    """
    T = len(ids)
    positions = torch.arange(T)
    x = model.embed_tokens(torch.tensor(ids, dtype=torch.long))  # (T, C)
    for i, block in enumerate(model.layers):
        # the block's two residual updates, as Block.forward adds them
        want = attention is True or bool(attention and i in attention)
        a, q, k, q_raw, k_raw, weights = yield from _attention(block, model.rotary, block.attn_norm(x), positions, want)
        x = x + a
        h = block.mlp_norm(x)
        m = torch.empty_like(x)
        for start in range(0, T, MLP_ROWS):
            m[start:start + MLP_ROWS] = block.mlp(h[start:start + MLP_ROWS])   # (rows, C)
            yield None
        x = x + m
        yield LayerRecord(layer=i, q=q, k=k, q_raw=q_raw, k_raw=k_raw, attention=weights,
                          attn_update=a.norm(dim=-1), mlp_update=m.norm(dim=-1), residual=x.norm(dim=-1))


def layers(model: Transformer, ids: list[int], attention: bool | set[int] = False):
    """Like `slices`, yielding only the LayerRecords."""
    return (r for r in slices(model, ids, attention) if r is not None)


def run(model: Transformer, ids: list[int], attention: bool | set[int] = False) -> list[LayerRecord]:
    """Every layer at once (for tests and scripts; the web app iterates `layers` in slices)."""
    return list(layers(model, ids, attention))


def entropy(weights: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each attention row: (..., T) -> (...)."""
    return -(weights * torch.log(weights.clamp_min(1e-30))).sum(-1)
