"""Named models and how they load; see registry.py."""

from .registry import DEFAULT_MODEL, MODELS, LoadedModel, default_cache_dir, load_model

__all__ = ["DEFAULT_MODEL", "MODELS", "LoadedModel", "default_cache_dir", "load_model"]
