"""Looking inside the model for the widgets, with forward hooks: the model itself stays clean.

A probe runs one uncached forward pass over a short text, one block at a time, and records what
the widgets draw: each layer's rotated queries and keys, its attention weights, and the sizes of
the updates the attention and the MLP add to the residual stream (the "residual stream" view of
Elhage et al., 2021, "A Mathematical Framework for Transformer Circuits"). It calls the model's own
modules, block by block, and reads the queries and keys with a forward hook on each block's q/k/v
projection (TransformerLens' hook points, done with torch's register_forward_hook), so
core/model.py has no code for it.

`slices()` is a generator that pauses after each small piece of work, so the web app can run a
long probe between serving steps and never stall a chat by more than one slice. Attention weights are
recomputed from the hooked q and k with the engine's own `attend` (the same function the forward
uses), so they are the model's weights, not an approximation.
"""

from contextlib import contextmanager
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


@contextmanager
def _qkv_hook(block):
    """Capture the output of a block's fused q/k/v projection while the block runs."""
    seen: dict[str, torch.Tensor] = {}

    def keep(module, args, output):
        seen["qkv"] = output

    handle = block.attn.qkv_proj.register_forward_hook(keep)
    try:
        yield seen
    finally:
        handle.remove()


MLP_ROWS = 256  # the MLP runs over at most this many tokens per slice (it is per token, so exact)


@torch.inference_mode()
def slices(model: Transformer, ids: list[int], attention: bool | set[int] = False):
    """Run `ids` through the model in small slices: yields None after each slice of work and a
    LayerRecord when a block is done. A slice is a block's attention, its attention weights, or
    up to MLP_ROWS tokens of its MLP, so a caller can pause between slices for serving steps.

    attention: True for every layer's weights, a set of layer indices for some, False for none.
    """
    cfg = model.config
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    T = len(ids)
    positions = torch.arange(T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    x = model.embed_tokens(torch.tensor(ids, dtype=torch.long))  # (T, C)
    for i, block in enumerate(model.layers):
        # the block's two residual updates, as Block.forward adds them
        with _qkv_hook(block) as seen:
            a = block.attn(block.attn_norm(x), positions, model.rotary, None)   # (T, C)
        x = x + a
        yield None
        q_raw, k_raw, v = seen["qkv"].split([H * D, Hkv * D, Hkv * D], dim=-1)
        q_raw, k_raw, v = q_raw.view(T, H, D), k_raw.view(T, Hkv, D), v.view(T, Hkv, D)
        q, k = model.rotary(q_raw, positions), model.rotary(k_raw, positions)
        weights = None
        if attention is True or (attention and i in attention):
            _, weights = attend(q[None], k[None], v[None], mask[None])          # (1, H, T, T)
            weights = weights[0]
            yield None
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
