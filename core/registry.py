"""Find a named model's loader without importing who provides it (Python entry points).

The engine takes an already loaded model (config, weights, tokenizer). Packages announce the
models they can load under the entry-point group `sendlens.models` (this project's own are in
pyproject.toml, provided by toy_models), so `LLM("smollm2-135m")` works while core/ never imports
toy_models: the dependency points one way only, toy_models -> core.
"""

from importlib.metadata import entry_points

from core.errors import InvalidParameter

GROUP = "sendlens.models"


def available() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load(name: str, cache_dir=None):
    """-> the provider's loaded model (an object with config, state_dict, tokenizer, source)."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise InvalidParameter("model", f"unknown model {name!r}; choose one of {available()}")
    return found[0].load()(cache_dir)
