"""Shared fixtures. Fast tests use the `tiny` model; tests on the real model share one load.

Markers: `real_model` (smollm2-135m), `browser` (Chromium against a live server).
"""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("SENDLENS_ARTIFACTS", ROOT / "artifacts"))


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def tiny_loaded():
    from toy_models import load_model
    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm_loaded():
    """SmolLM2-135M-Instruct, loaded once for the whole session."""
    from toy_models import load_model
    return load_model("smollm2-135m")


@pytest.fixture
def make_tiny_llm(tiny_loaded):
    """LLM(\"tiny\", **engine settings) sharing the session's weights."""
    from core import LLM

    def make(**kwargs):
        return LLM("tiny", loaded=tiny_loaded, **kwargs)
    return make


@pytest.fixture
def make_smollm(smollm_loaded):
    """LLM(\"smollm2-135m\", **engine settings) sharing the session's weights."""
    from core import LLM

    def make(**kwargs):
        return LLM("smollm2-135m", loaded=smollm_loaded, **kwargs)
    return make


@pytest.fixture(scope="session")
def smollm(smollm_loaded):
    """One LLM on the real model with default settings, shared by the session."""
    from core import LLM
    return LLM("smollm2-135m", loaded=smollm_loaded)


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' LlamaForCausalLM and tokenizer, loaded from the same GGUF file."""
    import warnings

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toy_models.gguf_loader import find_gguf

    path = find_gguf()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own deprecation chatter is not ours
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    return model, tokenizer
