"""The decoder's layers in C++ (csrc/decoder.cpp), for the engine's steps: the same ATen
operations as model.py, in the same order, and the same kernels of our own (csrc/kernels.h:
attention, RMSNorm, rotary embedding, SwiGLU's product, fp32 and Q4_1 products, which model.py
calls too), so the same bits, without Python.

A decode step of SmolLM2 is several hundred small tensor operations; through Python each costs a
few microseconds more than the operation itself (profile in the README). Tracing or compiling the
forward was tried and dropped (torch.compile took 50 s and changed greedy tokens); this is the
forward written out once more, in C++, operation for operation, and a test holds it to the Python
one bit for bit in every weight format.

It is built on first use with torch's cpp_extension (a C++ compiler and ninja; two to three
minutes on two cores), for this machine's CPU (-march=native: the kernels are written for
AVX-512 and AVX2, with a lane-by-lane fallback) and cached under torch's extensions directory. A model with experts runs
model.py's Python with the kernels. Where the extension cannot be built, the engine runs
model.py's Python with attention.py's torch path (batch-invariant too, slower; it rounds
differently) and says so once in the log.
"""

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

from .attention import PagedBatch
from .config import WeightFormat
from .gemm import Q4_GROUP, Product

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("decoder.cpp", "paged_attention.cpp", "rms_norm.cpp", "rotary.cpp", "silu_mul.cpp",
                         "f32_matmul.cpp", "q4_matmul.cpp", "q8_matmul.cpp")]
FORMAT_CODES = {WeightFormat.FP32: 0, WeightFormat.BF16: 1, WeightFormat.Q4_1: 2}
PRODUCT_CODES = {Product.OWN: 0, Product.ONEDNN: 1, Product.PLAIN: 2}   # decoder.cpp's enum Product


@functools.cache
def extension():
    """The compiled module, or None (with the reason logged once) if it cannot be built here."""
    try:
        from torch.utils import cpp_extension
        venv_bin = str(Path(sys.executable).parent)  # pip's ninja lands beside python, maybe not on PATH
        if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        log.info("loading the C++ decoder (built on first use, two to three minutes on two cores; cached after)")
        return cpp_extension.load(name="sendlens_decoder", sources=[str(p) for p in SOURCES],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: Python does the same work
        log.warning("the C++ decoder could not be built (%s: %s); the engine runs model.py's Python "
                    "forward with torch's operations instead (batch-invariant too, slower, other bits)",
                    type(exc).__name__, str(exc).strip()[:300])
        return None


def kernels(cfg):
    """The extension, for its kernels (attention, RMSNorm, rotary, SwiGLU's product), where it is
    built and handles the model's shapes (a head size it has a kernel for, hidden and MLP sizes
    multiples of 16); else None."""
    ext = extension()
    shapes_fit = cfg.hidden_size % 16 == 0 and cfg.intermediate_size % 16 == 0
    return ext if ext is not None and shapes_fit and ext.supports_head_dim(cfg.head_dim) else None


class NativeDecoder:
    """A Transformer's dense layers as one C++ object, holding its tensors (no copies)."""

    def __init__(self, model, ext):
        cfg = model.config
        fmt = model.weight_format
        products = model.layers[0].attn.qkv_proj.kernel   # every layer's are alike (gemm.PackedLinear)
        layers = []
        for block in model.layers:
            tensors = [block.attn_norm.weight, block.mlp_norm.weight]
            for linear in (block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj):
                tensors.extend(linear.kernel.tensors)
            layers.append(tensors)
        self.decoder = ext.Decoder(FORMAT_CODES[fmt], model.embed_tokens.weight, model.norm.weight,
                                   model.rotary.cos, model.rotary.sin, layers,
                                   cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                   PRODUCT_CODES[products.product], products.min_rows, Q4_GROUP)

    def forward(self, input_ids, positions, batch: PagedBatch):
        """As Transformer.forward with a PagedBatch: (T,), (T,) -> final hidden states (T, C)."""
        return self.decoder.forward(input_ids, positions, batch.cache.k, batch.cache.v, batch.slot_mapping,
                                    batch.block_tables, batch.token_seq)


def native_decoder(model) -> NativeDecoder | None:
    """The C++ decoder for `model`, or None where it cannot run (no build here, or experts)."""
    if model.config.num_experts:
        return None
    ext = kernels(model.config)
    return NativeDecoder(model, ext) if ext is not None else None
