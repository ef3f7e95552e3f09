"""The engine on an AVX2-only CPU, on whatever machine runs the tests: an emulated AMD Zen 3.

Most machines that run these tests have AVX-512, where kernel_paths.py also builds the kernels'
sources with -mno-avx512f: that checks the AVX2 kernels' arithmetic, in a process that still has
AVX-512 everywhere else. A Zen 3 user's process differs: its CPUID has no AVX-512, so
-march=native resolves without it, PyTorch dispatches its AVX2 kernels, and an AVX-512 instruction
left anywhere stops the process (SIGILL). tools/emulated-cpu runs a program in such a process
(qemu-user, EPYC-Milan); here it runs the engine's batch-invariance and same-bits tests there.
qemu computes each instruction's result exactly as the instruction set defines it, so the bits are
a Zen 3's; its speed is not, and nothing here is timed.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "emulated-cpu"

# The tests that run on the emulated CPU, by name (-k): every product a format takes on a Zen 3
# (products_here: fp32 on ours or oneDNN's, bf16 and q4_1 and q8_0 on ours; oneDNN packs no
# bfloat16 there), the C++ decoder against Python, the LM head, the engine's logits in any batch.
# Not PyTorch's int4 and bf16 fallbacks ("plain"): minutes each under emulation, and not a product
# a Zen 3 user's engine takes.
INVARIANCE = [
    "tests/test_gemm.py", "tests/test_native.py", "tests/test_lm_head.py", "tests/test_attention.py",
    "-k", "(batch_invariant and (own or (onednn and fp32))) or linear_rows_are_batch_invariant "
          "or same_bits_tiny or same_tokens or alone_or_among or bit_identical_in_any_batch_tiny "
          "or built_for_this_cpu",
]


def emulated(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """`python args` on the emulated Zen 3, with none of this pytest run's own settings."""
    if shutil.which("qemu-x86_64") is None:
        pytest.fail("qemu-x86_64 is missing: `make test` installs Debian's qemu-user (Makefile: .test-deps)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k not in ("CXX", "CC")}
    return subprocess.run([str(TOOL), sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_emulated_cpu_has_avx2_only_and_the_engine_builds_its_avx2_kernels():
    probe = ("import sys; sys.path.insert(0, 'tests'); import kernel_paths; "
             "from core.model.linear import q4_kernel_isa, f32_kernel; import torch; "
             "print(sorted(kernel_paths.FLAGS), kernel_paths.PATHS, q4_kernel_isa(), f32_kernel() is not None, "
             "torch.backends.cpu.get_cpu_capability())")
    run = emulated(["-c", probe], timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "['avx2', 'f16c', 'fma'] ['native'] avx2 True AVX2", run.stdout


def test_rows_are_batch_invariant_on_the_emulated_cpu(tmp_path):
    """Each format's rows give the same bits alone or among others, and the C++ decoder gives the
    Python forward's, in a process of the emulated Zen 3: the tests of the native machine, run
    there (one path: the CPU's native one, AVX2)."""
    run = emulated(["-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rs",
                    f"--basetemp={tmp_path / 'inner'}", *INVARIANCE], timeout=1800)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 80, summary    # 85 when written: a selection not emptied
