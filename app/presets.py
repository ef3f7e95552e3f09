"""The model presets (shapes from each model's public config.json) and the number formats, read
from static/data/models.json: the one file the KV-memory calculator reads in the browser and the
economics widget's sizing reads here.

For each preset, a KV cache holds per token 2 (K and V) x layers x KV heads x head size values,
or, for multi-head latent attention (DeepSeek-V2/V3, DeepSeek-AI 2024), one latent plus one RoPE
key per layer.
"""

import json
from pathlib import Path

MODELS_FILE = Path(__file__).resolve().parents[1] / "static" / "data" / "models.json"
_MODELS = json.loads(MODELS_FILE.read_text())
PRESETS: dict[str, dict] = _MODELS["presets"]     # name -> shape (keys as in the JSON: layers, kvHeads, head, mla ...)
DTYPES: dict[str, float] = _MODELS["dtypes"]      # name -> bytes per value


def values_per_token(shape: dict) -> int:
    """Values the KV cache holds per token: K and V for every layer and KV head, or MLA's latent
    plus RoPE key per layer."""
    if shape.get("mla"):
        return shape["layers"] * (shape["mla"]["latent"] + shape["mla"]["rope"])
    return 2 * shape["layers"] * shape["kvHeads"] * shape["head"]


def kv_bytes_per_token(shape: dict, dtype: str) -> float:
    return values_per_token(shape) * DTYPES[dtype]
