"""Build and load the engine's C++ extension (csrc/): the decoder's layers and its own kernels
(attention, RMSNorm, rotary embedding, SwiGLU's product, fp32, Q4_1 and Q8_0 products).

It is built on first use with torch's cpp_extension (a C++ compiler and ninja; the first build
takes minutes on a small machine), for this machine's CPU (-march=native: the kernels are written
for AVX-512 and AVX2, with a lane-by-lane fallback) and cached under torch's extensions directory.
Where it cannot be built, extension() says why once in the log and returns None; the model side
(core/model/linear.py, core/model/native_decoder.py) then runs PyTorch's operations instead.

A leaf: it imports nothing from core, so every layer above may use it.
"""

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("decoder.cpp", "paged_attention.cpp", "rms_norm.cpp", "rotary.cpp", "silu_mul.cpp",
                         "f32_matmul.cpp", "q4_matmul.cpp", "q8_matmul.cpp")]


@functools.cache
def extension():
    """The compiled module, or None (with the reason logged once) if it cannot be built here."""
    try:
        from torch.utils import cpp_extension
        venv_bin = str(Path(sys.executable).parent)  # pip's ninja lands beside python, maybe not on PATH
        if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        log.info("loading the C++ decoder (built on first use, which takes minutes; cached after)")
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
    built and handles the model's shapes (cfg: a ModelConfig; a head size it has a kernel for,
    hidden and MLP sizes multiples of 16); else None."""
    ext = extension()
    shapes_fit = cfg.hidden_size % 16 == 0 and cfg.intermediate_size % 16 == 0
    return ext if ext is not None and shapes_fit and ext.supports_head_dim(cfg.head_dim) else None
