"""Build and load the engine's C++ extension (csrc/): the decoder's layers and its own kernels
(attention, RMSNorm, rotary embedding, SwiGLU's product, fp32, Q4_1 and Q8_0 products, the LM head's
exact candidates).

It is built on first use with torch's cpp_extension (a C++ compiler and ninja; the first build
takes a while on a small machine: only decoder.cpp, which binds the kernels to Python, includes
<torch/extension.h>), for this machine's CPU (-march=native: the kernels are written
for AVX-512 and AVX2, with a lane-by-lane fallback) and cached under torch's extensions directory.
Where it cannot be built, extension() says why once in the log and returns None; the model side
(core/model/linear.py, core/model/native_decoder.py) then runs PyTorch's operations instead.

A leaf: it imports nothing from core, so every layer above may use it.
"""

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("decoder.cpp", "paged_attention.cpp", "rms_norm.cpp", "rotary.cpp", "silu_mul.cpp",
                         "f32_matmul.cpp", "q4_matmul.cpp", "q8_matmul.cpp", "decode_step.cpp",
                         "lm_head.cpp")]


def build_name() -> str:
    """The extension's name, one per checkout. torch keeps one build folder per name, and its build
    commands name the sources' paths: two clones (or git worktrees) on one machine sharing a name
    would rebuild each other's objects, minutes each time."""
    where = hashlib.sha256(str(SOURCES[0].parent).encode()).hexdigest()[:10]
    return f"sendlens_decoder_{where}"


def clear_stale_lock(name: str, older_than_s: float = 1800) -> None:
    """A build killed part-way (Ctrl-C during the first `make serve`) leaves torch's lock file in
    the build folder, and every later start would wait on it for ever. No build here runs longer
    than `older_than_s`, so an older lock belongs to no live build: remove it, and say so."""
    import time
    from torch.utils import cpp_extension
    lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > older_than_s:
        log.warning("removing a stale build lock %s (%.0f minutes old: a build was killed part-way)",
                    lock, age / 60)
        lock.unlink(missing_ok=True)


@functools.cache
def extension():
    """The compiled module, or None (with the reason logged once) if it cannot be built here."""
    try:
        from torch.utils import cpp_extension
        venv_bin = str(Path(sys.executable).parent)  # pip's ninja lands beside python, maybe not on PATH
        if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        log.info("loading the C++ decoder (built on first use, which takes a while; cached after)")
        name = build_name()
        clear_stale_lock(name)
        return cpp_extension.load(name=name, sources=[str(p) for p in SOURCES],
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
