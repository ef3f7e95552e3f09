"""toy_models: the registry, the tiny model, and the GGUF conversion cache of smollm2-135m."""

import json

import pytest
import torch

from core import InvalidParameter
from core.model.model import Transformer
from toy_models import DEFAULT_MODEL, MODELS, default_cache_dir, load_model
from toy_models import gguf_loader
from toy_models.registry import TINY_CONFIG, random_weights


def test_registry_names():
    assert DEFAULT_MODEL == "smollm2-135m"
    assert {"smollm2-135m", "tiny"} <= set(MODELS)


def test_unknown_model_names_the_parameter():
    with pytest.raises(InvalidParameter) as exc:
        load_model("gpt-17")
    assert exc.value.param == "model"
    assert "tiny" in str(exc.value)


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SENDLENS_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SENDLENS_CACHE")
    assert default_cache_dir().name == "sendlens"


def test_tiny_is_seeded_and_fits_the_model(tiny_loaded):
    assert tiny_loaded.config == TINY_CONFIG
    assert tiny_loaded.config.num_layers == 2
    again = random_weights(TINY_CONFIG, seed=0)
    other = random_weights(TINY_CONFIG, seed=1)
    assert set(again) == set(tiny_loaded.state_dict)
    assert all(torch.equal(again[k], tiny_loaded.state_dict[k]) for k in again)
    assert not torch.equal(other["embed_tokens.weight"], again["embed_tokens.weight"])
    assert torch.equal(again["norm.weight"], torch.ones(TINY_CONFIG.hidden_size))
    model = Transformer.from_state_dict(TINY_CONFIG, again)     # strict: every name fits
    assert model.config.vocab_size == tiny_loaded.tokenizer.vocab_size


def test_unpermute_undoes_llama_cpp_row_order():
    """llama.cpp's converter permutes Q/K rows so RoPE pairs adjacent dims; unpermute undoes it."""
    heads, head_dim, cols = 3, 8, 5
    w = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(gguf_loader.unpermute(permuted, heads), w)


@pytest.mark.real_model
def test_smollm_config(smollm_loaded):
    cfg = smollm_loaded.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.kv_values_per_token == 2 * 30 * 3 * 64
    assert smollm_loaded.tokenizer.eos_token_id == cfg.eos_token_id
    assert smollm_loaded.state_dict["embed_tokens.weight"].dtype == torch.float32
    assert "GGUF" in smollm_loaded.source


@pytest.mark.real_model
def test_second_load_reuses_the_converted_cache(smollm_loaded, monkeypatch):
    """The session fixture loaded (and, on a fresh machine, converted) the model. Loading again
    must find the cache valid and convert nothing: the weights file is not rewritten."""
    directory = default_cache_dir() / "smollm2-135m"
    weights = directory / "model.safetensors"
    stamp = json.loads((directory / "source.json").read_text())
    assert stamp == gguf_loader.source_stamp(gguf_loader.find_gguf())
    assert stamp["format"] == gguf_loader.FORMAT_VERSION
    before = weights.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cache was valid; nothing should be converted")
    monkeypatch.setattr(gguf_loader, "convert", no_conversion)
    assert gguf_loader.ensure_converted(default_cache_dir(), "smollm2-135m") == directory
    tiny = load_model("tiny")             # loads the same cached tokenizer, through the same check
    assert tiny.tokenizer.encode("Hello world") == smollm_loaded.tokenizer.encode("Hello world")
    assert weights.stat().st_mtime_ns == before
    assert json.loads((directory / "config.json").read_text())["num_layers"] == smollm_loaded.config.num_layers


def test_a_stale_stamp_triggers_conversion(tmp_path, monkeypatch):
    calls = []

    def fake_convert(gguf_path, out_dir, name):
        calls.append((gguf_path, out_dir, name))
        out_dir.mkdir(parents=True)
        (out_dir / "source.json").write_text(json.dumps(gguf_loader.source_stamp(gguf_path)))

    monkeypatch.setattr(gguf_loader, "convert", fake_convert)
    out = gguf_loader.ensure_converted(tmp_path, "m")             # nothing there: convert
    assert len(calls) == 1 and out == tmp_path / "m"
    gguf_loader.ensure_converted(tmp_path, "m")                   # stamp matches: reuse
    assert len(calls) == 1
    stale = json.loads((out / "source.json").read_text())
    stale["format"] = gguf_loader.FORMAT_VERSION - 1
    (out / "source.json").write_text(json.dumps(stale))
    monkeypatch.setattr(gguf_loader, "convert", lambda g, o, n: calls.append((g, o, n)))
    gguf_loader.ensure_converted(tmp_path, "m")                   # old format: convert again
    assert len(calls) == 2
