"""The engine's kernel paths this CPU can run, for tests that check every one of them.

The extension (core/model/native_decoder.py) is built with -march=native, so it runs the widest kernels the CPU
has: AVX-512 (and AVX-512 BF16 for q4_1) where present, else AVX2. A test of a bound or of batch
invariance must hold on every path a user's CPU may take, so on an AVX-512 CPU the same sources
are also built a second time without AVX-512 (-mno-avx512f turns off every AVX-512 extension),
which runs the AVX2 kernels; and on an AVX-512 BF16 CPU a third time without BF16
(-mno-avx512bf16, as on the many AVX-512 CPUs without it), which runs q4_1's attention on its
bfloat16 operands through the fp32 chains instead of VDPBF16PS. `use_path` puts a build where
core's kernel lookups find it.
"""

import functools
import os
import shutil
import subprocess

import pytest

# the compiler's macro for each instruction-set extension the kernels test for, by /proc/cpuinfo's name
MACROS = {"avx2": "__AVX2__", "fma": "__FMA__", "f16c": "__F16C__", "avx512f": "__AVX512F__",
          "avx512bw": "__AVX512BW__", "avx512_vnni": "__AVX512VNNI__", "avx512_bf16": "__AVX512BF16__",
          "avx_vnni": "__AVXVNNI__", "avx_ne_convert": "__AVXNECONVERT__"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The extensions (MACROS' names) that -march=native turns on for the compiler that builds the
    kernels (CXX, as torch's builds read it, else c++), so the extensions the build has, not what
    /proc/cpuinfo lists: they differ under an emulated CPU (qemu-user passes the host's
    /proc/cpuinfo through; see tools/emulated-cpu), and where the compiler predates the CPU. No
    compiler: no extension, as no kernel is built."""
    compiler = os.environ.get("CXX") or shutil.which("c++")
    if not compiler:
        return frozenset()
    macros = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                            capture_output=True, text=True, check=True).stdout
    defined = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    return frozenset(flag for flag, macro in MACROS.items() if macro in defined)


FLAGS = cpu_flags()
NATIVE = "native"      # the build for this CPU: AVX-512 where it has it
AVX2 = "avx2"          # the same sources without AVX-512
AVX512 = "avx512"      # the same sources without AVX-512 BF16
# every path this CPU offers: the native one, AVX-512 without BF16 where the native one has BF16,
# and AVX2 where the native one is AVX-512
PATHS = ([NATIVE] + ([AVX512] if "avx512_bf16" in FLAGS else [])
         + ([AVX2] if "avx512f" in FLAGS and {"avx2", "fma", "f16c"} <= FLAGS else []))
WITHOUT = {AVX2: "-mno-avx512f", AVX512: "-mno-avx512bf16"}


@functools.cache
def path_extension(path: str):
    """The extension's sources built for `path` (WITHOUT: the flag that turns an extension off),
    cached by torch under its own name."""
    from torch.utils import cpp_extension

    from core.kernels import loader

    loader.extension()                       # the same set-up (ninja on PATH) as the native build
    return cpp_extension.load(name=f"{loader.build_name()}_{path}", sources=[str(p) for p in loader.SOURCES],
                              extra_cflags=["-O3", "-march=native", WITHOUT[path], "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)


def use_path(path: str, monkeypatch) -> None:
    """Make core's kernel lookups (core.kernels.loader.extension, read at call time) return `path`'s build."""
    if path == NATIVE:
        return
    from core.kernels import loader
    ext = path_extension(path)
    monkeypatch.setattr(loader, "extension", lambda: ext)
    from core.model import linear
    if linear.q4_kernel() not in (None, ext) or linear.f32_kernel() not in (None, ext):
        raise RuntimeError("a kernel lookup bypasses core.kernels.loader.extension: the AVX2 path would not be tested")


@pytest.fixture(params=PATHS)
def kernel_path(request, monkeypatch) -> str:
    """Each kernel path this CPU offers (kernel_paths.PATHS), in turn, for the test's duration."""
    use_path(request.param, monkeypatch)
    return request.param
