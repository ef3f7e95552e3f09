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


# ---- a live server for the websocket tests ---------------------------------------------------
# Small limits, so each one can be reached in a test.
LIVE_SETTINGS = {
    "model": "tiny",
    "num_kv_blocks": 256,               # 4096 token slots: the tiny model's 2048-token window fits
    "max_connections": 4,
    "max_requests_per_connection": 2,
    "max_queue": 3,
    "max_message_bytes": 4096,
    "max_tokens_limit": 64,
    "default_max_tokens": 16,
    "max_inspect_tokens": 64,
    "max_messages": 8,
    "testing": True,
}


@pytest.fixture(scope="session")
def live_server(tiny_loaded):
    """The app (tiny model, LIVE_SETTINGS) served on loopback by werkzeug in a thread.

    Yields a namespace: app, runtime, port, http (base URL), ws (the /ws URL).
    """
    import threading
    from types import SimpleNamespace

    from werkzeug.serving import make_server

    from app import create_app

    app = create_app(dict(LIVE_SETTINGS), loaded=tiny_loaded)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="live-server", daemon=True)
    thread.start()
    port = server.server_port
    yield SimpleNamespace(app=app, runtime=app.extensions["sendlens"], port=port,
                          http=f"http://127.0.0.1:{port}", ws=f"ws://127.0.0.1:{port}/ws")
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)
    app.extensions["sendlens"].shutdown()


# ---- engine helpers for the core tests --------------------------------------------------------

@pytest.fixture
def make_tiny_engine(tiny_loaded):
    """LLMEngine on the tiny model with EngineConfig(**settings), sharing the session's weights."""
    from core import EngineConfig, LLMEngine

    def make(**settings):
        return LLMEngine(EngineConfig(model="tiny", **settings), loaded=tiny_loaded)
    return make


def _assert_pool_clean(engine):
    """Nothing running or queued, every KV block free, every reference count 0."""
    stats = engine.kv_stats()
    assert not engine.has_unfinished_requests()
    assert stats["free_blocks"] == stats["total_blocks"]
    assert stats["used_blocks"] == 0
    assert set(engine.block_manager.ref_counts()) == {0}
    assert all(slot is None for slot in engine.scheduler.slots)


@pytest.fixture(scope="session")
def assert_pool_clean():
    """A check to call at the end of a test: the engine gave every block and slot back."""
    return _assert_pool_clean
