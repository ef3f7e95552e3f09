"""Looking inside the model for the widgets: attention weights, per-layer figures, tokens.

These run one uncached forward pass over a short text with a Probe attached (see model.py).
In the web app they run on the engine loop's thread between steps (EngineLoop.call), so they
never race the serving engine for the CPU or the weights.
"""

import torch

from .errors import InvalidParameter, is_int
from .model import Probe


def check_index(name: str, value, size: int) -> int:
    if not is_int(value) or not 0 <= value < size:
        raise InvalidParameter(name, f"must be an integer from 0 to {size - 1}, got {value!r}")
    return value


def encode_text(engine, text, max_tokens: int) -> list[int]:
    if not isinstance(text, str) or not text:
        raise InvalidParameter("text", "must be a non-empty string")
    ids = engine.tokenizer.encode(text)
    if len(ids) > max_tokens:
        raise InvalidParameter("text", f"is {len(ids)} tokens; the most this view takes is {max_tokens}")
    return ids


@torch.inference_mode()
def attention(engine, text: str, layer: int, head: int, max_tokens: int) -> dict:
    """Attention weights of one head of one layer for `text`: row i is query token i (causal)."""
    cfg = engine.model_config
    check_index("layer", layer, cfg.num_layers)
    check_index("head", head, cfg.num_heads)
    ids = encode_text(engine, text, max_tokens)
    probe = Probe(attention_layers={layer})
    engine.model.score(ids, probe)
    weights = probe.attention[layer][head]  # (T, T), zero above the diagonal
    return {
        "token_ids": ids,
        "tokens": engine.tokenizer.token_texts(ids),
        "weights": [[round(w, 6) for w in row] for row in weights.tolist()],
        "kv_head": head // (cfg.num_heads // cfg.num_kv_heads),
    }
