"""Widget `kv-memory` (section 10): how big the KV cache is, and the live pool it is checked against.

The calculator itself runs in the browser (static/js/widgets/kv-memory.js): per token a cache
holds 2 (K and V) x layers x KV heads x head size values, or for multi-head latent attention
(DeepSeek-V2/V3, DeepSeek-AI 2024) one latent plus one RoPE key per layer. This module answers
the one question the browser cannot: what this server's engine really set aside.

The presets (SmolLM2-135M, Llama-3.1-8B and 70B, Mixtral-8x7B, DeepSeek-V3, from each model's
public config.json) live in one file, static/data/models.json, read by the calculator in the
browser and on the server by app/presets.py (the economics widget's sizing).

Message: `kv_pool` {} -> a one-slice job that reads the engine's KV tensors (their shapes, dtype
and bytes) and its pool of blocks, and divides: `live_pool_bytes_per_token` = KV tensor bytes /
token slots (blocks x block size). Cached by its (empty) inputs: the pool never changes while the
server runs.
"""

from .base import Widget, message


def kv_pool(call) -> None:
    call.job({}, kv_pool_job)


def kv_pool_job(engine) -> dict:
    """One slice on the loop thread: engine.view.cache's tensors and kv_stats(), never the scheduler."""
    kv = engine.view.kv_stats()
    cache = engine.view.cache
    tensors = {name: getattr(cache, name) for name in ("k", "v") if hasattr(cache, name)}
    slots = kv["total_blocks"] * kv["block_size"]
    total = int(cache.nbytes)
    dtype = next(iter(tensors.values())).dtype if tensors else None
    return {
        "tensors": {name: {"shape": list(t.shape), "dims": list(cache.dims[name]),
                           "dtype": str(t.dtype).replace("torch.", ""), "bytes": int(t.nbytes)}
                    for name, t in tensors.items()},
        "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
        "bytes_per_value": dtype.itemsize if dtype is not None else None,
        "kv_bytes": total,
        "total_blocks": kv["total_blocks"],
        "block_size": kv["block_size"],
        "token_slots": slots,
        "live_pool_bytes_per_token": total / slots,
        "engine_bytes_per_token": kv["bytes_per_token"],
        "num_layers": engine.view.model_config.num_layers,
        "num_kv_heads": engine.view.model_config.num_kv_heads,
        "head_dim": engine.view.model_config.head_dim,
    }


WIDGET = Widget("kv-memory", messages=(
    message("kv_pool", set(), kv_pool, job=True),
))
