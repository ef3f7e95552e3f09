"""Batch-invariant matrix multiply, in four weight formats: the same row gives the same result
in any batch.

CPU matrix-multiply libraries pick a kernel by the shape of the problem, and different kernels
sum in different orders, so the same token could get slightly different logits alone and in a
batch (the problem "Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025, tackles
on GPUs). Each format below uses one kernel whose rounding does not depend on the batch, either
by construction or by padding the batch to the shapes where it holds; tests/test_gemm.py checks
every format bit for bit, alone against batched, with one and two threads.

- fp32: the engine's own kernel (csrc/f32_matmul.cpp) where the CPU has AVX2 and FMA: each output
  is one chain of fused multiply-adds over k in order, in whatever tile its row falls, so rows are
  never padded. One row streams the weights at memory speed, and tiles of five rows serve from a
  few rows to a prompt's hundreds (the widget `gemm` and `python -m bench` measure it against
  oneDNN's).
- bf16 keeps its weights in bfloat16 and accumulates in fp32, the activations and the result
  rounded to bfloat16. Where the CPU converts to bfloat16 natively (AVX-512 BW/VL/DQ or
  AVX-NE-CONVERT), oneDNN's matmul on weights reordered once, at load, into its blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's freezing pass does for CPU
  linears), its dot products in AVX512-BF16; oneDNN takes another kernel for a single row at some
  shapes (an input of 1,536 here), so rows are padded to PREPACKED_MIN_ROWS. Elsewhere (an
  AVX2-only CPU, where oneDNN's bf16 is slow reference code) the engine's fp32
  kernel reads the bfloat16 weights and widens them to fp32 (exactly; for many rows once per
  panel): the same chains, half the bytes.
- Without the engine's extension, fp32 takes oneDNN's prepacked product (padded as above) and,
  without oneDNN, MKL's sgemm padded to whole MIN_GEMM_ROWS-row panels (a partial panel goes to
  another kernel); bf16 takes a plain product with one row padded to BF16_MIN_ROWS. The plain
  padded sgemm is also `linear`, the product of unpacked fp32 weights (attention's torch path,
  the MoE router).
- q4_1: the GGUF file's own 4-bit weights (llama.cpp's Q4_1: groups of 32 weights, w = d*q + m,
  q in 0..15, d and m in fp16). A quarter of bf16's bytes (plus d and m per 32 weights): the
  fastest format for decode. Where the CPU has AVX-512 VNNI or AVX2, the engine's own kernel
  (csrc/q4_matmul.cpp) multiplies them as llama.cpp does: each row of activations rounded to
  8-bit integers per group of 32 (at most 1/254 of the group's largest off), per group the exact
  integer sum of those times q (VPDPBUSD with VNNI, VPMADDUBSW with AVX2: the same bits), then
  d * s * that + m * the group's sum of activations, accumulated in fp32. The widget `gemm`
  measures it against PyTorch's int4 kernel.
  Elsewhere, PyTorch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, written for torchao's
  weight-only quantization) computes w = (q - 8) * scale + zero with scale = d and
  zero = m + 8d in bfloat16. Both are row-independent by construction: each output is one fixed
  chain of operations over k, whatever the number of rows or threads, so neither pads.
- q8_0: llama.cpp's Q8_0 (groups of 32 weights, w = d*q, q in -127..127, d in fp16), quantized
  at load from the fp32 weights: a byte a weight plus 2 bytes per 32, a little over half of
  bf16's. The engine's kernel (csrc/q8_matmul.cpp) rounds each row of activations per group of
  32, to 8-bit integers with AVX-512 VNNI (llama.cpp's rounding, VPDPBUSD) and to 16-bit integers
  with AVX2 (VPMADDWD), and sums exactly in 32-bit integers; elsewhere two 4-bit products on
  PyTorch's int4 kernel (PackedQ8_0). Row-independent by construction, like q4_1. The same
  format is q4_1's LM head (the GGUF file keeps the embedding in Q8_0).
"""

from enum import Enum

import torch
import torch.nn.functional as F

from core.config import WeightFormat
from core.errors import InvalidParameter
from core.kernels import loader

MIN_GEMM_ROWS = 4       # MKL sgemm's row panel: a partial one switches kernels (and rounding)
BF16_MIN_ROWS = 2       # oneDNN's plain bf16 matmul takes a matrix-vector kernel for one row
PREPACKED_MIN_ROWS = 2  # oneDNN's prepacked matmul takes another kernel for one row at some shapes
PACK_FOR_ROWS = 64      # the batch size oneDNN picks the prepacked weights' blocked layout for
Q4_GROUP = 32        # weights per Q4_1 group (one scale and one minimum each)


class Product(str, Enum):
    """Which product a PackedLinear multiplies with."""
    OWN = "own"          # the engine's kernels: f32_matmul (fp32, bf16) or q4_matmul (q4_1); never padded
    ONEDNN = "onednn"    # oneDNN's matmul on prepacked weights (fp32 without the extension, bf16 with AVX512-BF16)
    PLAIN = "plain"      # PyTorch's plain product (MKL sgemm, padded; bf16; the int4 kernel for q4_1)


class ActivationRounding(str, Enum):
    """How a product rounds the activations it multiplies (the pages say it beside the format)."""
    NONE = "none"        # kept in fp32
    BF16 = "bf16"        # to bfloat16
    INT8 = "int8"        # to 8-bit integers times a scale per group of 32 (llama.cpp's rounding)
    INT16 = "int16"      # to 16-bit integers times a scale per group of 32
    MIXED = "mixed"      # a model's layers round in more than one of these ways


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x (N, in) with zero rows appended up to a whole, non-zero number of `multiple`-row panels."""
    n = x.shape[0]
    rows = max(multiple, -(-n // multiple) * multiple)
    if rows == n:
        return x
    return torch.cat([x, x.new_zeros(rows - n, x.shape[1])])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32: x @ weight.T, x: (N, in), weight: (out, in) -> (N, out), padded to whole row panels."""
    n = x.shape[0]
    return F.linear(pad_rows(x, MIN_GEMM_ROWS), weight)[:n]


def linear_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16: x (N, in) any float dtype, weight (out, in) bfloat16 -> (N, out) bfloat16."""
    n = x.shape[0]
    return F.linear(pad_rows(x.to(torch.bfloat16), BF16_MIN_ROWS), weight)[:n]


def prepacking_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this PyTorch has oneDNN's prepacked linear (CPU builds with oneDNN do) for `dtype`:
    fp32 everywhere, bfloat16 only where the CPU converts to it natively (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; oneDNN refuses to pack bfloat16 weights elsewhere)."""
    try:
        if not (torch.backends.mkldnn.is_available() and callable(torch.ops.mkldnn._linear_pointwise)):
            return False
        return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in), fp32 or bfloat16 -> the same values in oneDNN's blocked layout: an
    opaque tensor of the same shape and bytes, usable only by linear_prepacked."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_FOR_ROWS)


def linear_prepacked(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (N, in) in the weight's dtype, packed by prepack_weight() -> (N, out) in that dtype."""
    n = x.shape[0]
    y = torch.ops.mkldnn._linear_pointwise(pad_rows(x, PREPACKED_MIN_ROWS), packed, None, "none", [], "")
    return y[:n]


def linear_q4(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """q4_1: x (N, in) any float dtype, packed (out, in/2) uint8, scales_zeros (in/32, out, 2)
    bfloat16 -> (N, out) bfloat16. No padding: rows are independent by construction."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, Q4_GROUP, scales_zeros)


def f32_kernel():
    """The engine's own fp32 product (csrc/f32_matmul.cpp) where it is built and the CPU has AVX2
    and FMA, else None."""
    ext = loader.extension()
    return ext if ext is not None and ext.f32_matmul_available() else None


def pack_f32_native(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in), fp32 or bfloat16 -> the layout f32_matmul reads: (out/16, in, 16), each
    panel of 16 output columns with their weights at k side by side."""
    N, K = weight.shape
    return weight.view(N // 16, 16, K).transpose(1, 2).contiguous()


# -- the Q4_1 format ---------------------------------------------------------------------------

def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 of a float matrix (out, in): -> q (out, in) uint8 in 0..15, d and m
    (out, in/32) fp32, with w ~ d*q + m per group. For models that come without a Q4_1 file
    (the random `tiny`); SmolLM2's loader hands over the GGUF file's own blocks instead."""
    out, cols = w.shape
    if cols % Q4_GROUP:
        raise InvalidParameter("weight_format", f"q4_1 needs every layer's input size to be a multiple "
                                                f"of {Q4_GROUP}; this model has one of {cols}")
    groups = w.float().reshape(out, cols // Q4_GROUP, Q4_GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    d = ((hi - lo) / 15).half().float()        # GGUF keeps d and m in fp16
    m = lo.half().float()
    q = ((groups - m[..., None]) / d.clamp_min(1e-12)[..., None]).round().clamp(0, 15)
    return q.reshape(out, cols).to(torch.uint8), d, m


def q4_kernel():
    """The engine's own Q4_1 product (csrc/q4_matmul.cpp) where it is built and the CPU has
    AVX-512 VNNI or AVX2 (q4_kernel_isa() says which), else None."""
    ext = loader.extension()
    return ext if ext is not None and ext.q4_matmul_isa() else None


def q4_kernel_isa() -> str:
    """"avx512vnni" or "avx2" (either way the activations rounded to 8-bit integers per group of
    32, the same bits), or "" where the engine's Q4_1 kernel does not run here."""
    ext = q4_kernel()
    return ext.q4_matmul_isa() if ext is not None else ""


def pack_q4_1_native(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                     isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 blocks (q (out, in) in 0..15, d and m (out, in/32)) -> the layout q4_matmul reads for
    `isa` (q4_kernel_isa()'s, by default; "avx512vnni" and "avx2" read the same layout), per panel
    of 16 output columns: nibbles (out/16, in/4, 32) uint8 and dm (out/16, in/32, 2, 16) fp16, each
    group's d, then m. The nibbles come in octets of 8 k, 64 bytes each: byte 4c + j holds column
    c's q at k = 8o + j (low nibble) and at k = 8o + 4 + j (high nibble), so a mask and a shift
    give the quads of 4 k per column that VPDPBUSD (and VPMADDUBSW, a 32-byte half at a time) read."""
    N, K = q.shape
    isa = q4_kernel_isa() if isa is None else isa
    if isa not in ("avx2", "avx512vnni"):
        raise InvalidParameter("isa", f"the Q4_1 kernel has a layout for 'avx2' and 'avx512vnni', not {isa!r}")
    q = q.to(torch.uint8)
    # (panel, column, octet, high, j) -> (panel, octet, column, j, high): byte 4c + j of each octet
    t = q.view(N // 16, 16, K // 8, 2, 4).permute(0, 2, 1, 4, 3).reshape(N // 16, K // 4, 32, 2)
    nibbles = (t[..., 0] | (t[..., 1] << 4)).contiguous()            # the last axis: low, high nibble
    dm = torch.stack([v.view(N // 16, 16, K // Q4_GROUP).transpose(1, 2) for v in (d, m)], dim=2)
    return nibbles, dm.half().contiguous()


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 blocks -> (packed (out, in/2) uint8, scales_zeros (in/32, out, 2) bfloat16) for
    linear_q4: w = d*q + m = (q - 8)*d + (m + 8d)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales_zeros = torch.stack([d.t(), (m + 8 * d).t()], dim=-1)   # (in/32, out, 2)
    return packed, scales_zeros.to(torch.bfloat16).contiguous()


# -- the Q8_0 format (every layer of q8_0, the LM head of q4_1) -------------------------------------------------------

def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of a float matrix (out, in): -> q (out, in) int8 in -127..127 and d
    (out, in/32) fp32 (fp16 values), w ~ d*q per group of 32. SmolLM2's embedding is Q8_0 in the
    GGUF file, and re-quantizing its fp32 values finds the same d and q."""
    V, C = weight.shape
    groups = weight.float().reshape(V, C // Q4_GROUP, Q4_GROUP)
    d = (groups.abs().amax(-1) / 127).half().float()                    # (V, C/32)
    q = (groups / d.clamp_min(1e-12)[..., None]).round().clamp(-127, 127)
    return q.reshape(V, C).to(torch.int8), d


def pack_q8_0_native(q: torch.Tensor, d: torch.Tensor, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks -> the layout q8_matmul reads for `isa` (q4_kernel_isa()'s, by default: the Q8_0
    kernel is built with the same instructions), per panel of 16 output columns: q (out/16, in/2,
    32) int8 and d (out/16, in/32, 16) fp16.
    - avx2: byte b of unit u holds column b/2's q at k = 2u + b%2 (the pairs VPMADDWD reads);
    - avx512vnni: in quads of 4 k, 64 bytes each, byte 4c + j holds column c's q + 128 (an unsigned
      byte, as VPDPBUSD reads it) at k = 4u + j."""
    N, K = q.shape
    isa = q4_kernel_isa() if isa is None else isa
    if isa not in ("avx2", "avx512vnni"):
        raise InvalidParameter("isa", f"the Q8_0 kernel has layouts for 'avx2' and 'avx512vnni', not {isa!r}")
    if isa == "avx2":
        qp = q.view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3)
    else:                # (panel, column, quad, j) -> (panel, quad, column, j), offset to unsigned
        qp = (q.to(torch.int16) + 128).to(torch.uint8).view(torch.int8).view(N // 16, 16, K // 4, 4).permute(0, 2, 1, 3)
    return (qp.reshape(N // 16, K // 2, 32).contiguous(),
            d.view(N // 16, 16, K // Q4_GROUP).transpose(1, 2).half().contiguous())


class PackedQ8_0:
    """A matrix in Q8_0 and its row-independent product: the engine's kernel (csrc/q8_matmul.cpp,
    one pass over the 8-bit weights, exact integer sums per group) where it runs (AVX2), else two
    4-bit products, since q = 16*hi + lo with hi in -8..7 and lo in 0..15 makes w = 16d*hi + d*lo:
    the q4_1 layers of 16d*hi and of d*lo, summed (PyTorch's int4 kernel, which reads more bytes than
    the 8-bit pass: each half has its own d and m). product=Product.PLAIN takes the two 4-bit products on
    PyTorch's int4 kernel."""

    def __init__(self, weight: torch.Tensor, product: Product | None = None):
        self.out_features, self.in_features = weight.shape
        product = None if product is None else Product(product)
        q, d = quantize_q8_0(weight)
        ext = q4_kernel() if self.out_features % 16 == 0 else None
        self.q8 = ext if ext is not None and ext.q8_matmul_available() else None
        if product not in (None, Product.OWN, Product.PLAIN):
            raise InvalidParameter("product", f"a Q8_0 weight is multiplied by the engine's kernel (own) or "
                                              f"by PyTorch's int4 kernel (plain), not {product.value}")
        if product is Product.OWN and self.q8 is None:
            raise InvalidParameter("product", "the engine's Q8_0 kernel does not run here (it needs AVX2)")
        self.prepacked = self.q8 is not None and product is not Product.PLAIN
        if self.prepacked:
            self.tensors = pack_q8_0_native(q, d)
            return
        q = q.to(torch.int32)
        hi, lo = (q >> 4) + 8, q & 15                                   # q = 16*(hi - 8) + lo
        half_product = None if product is None else Product.PLAIN
        self.halves = tuple(PackedLinear(WeightFormat.Q4_1, weight, q4_blocks=blocks, product=half_product)
                            for blocks in ((hi, 16 * d, -8 * 16 * d), (lo, d, torch.zeros_like(d))))
        self.tensors = tuple(t for half in self.halves for t in half.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from memory for the weight."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def activation_rounding(self) -> str:
        """ActivationRounding of this product: the engine's kernel rounds to 8-bit integers per
        group of 32 with AVX-512 VNNI and to 16-bit ones with AVX2; PyTorch's int4 kernel takes bf16."""
        if not self.prepacked:
            return ActivationRounding.BF16.value
        vnni = q4_kernel_isa() == "avx512vnni"
        return (ActivationRounding.INT8 if vnni else ActivationRounding.INT16).value

    def __call__(self, x):  # (N, in) -> (N, out): fp32 from the kernel, bfloat16 from the halves
        if self.prepacked:
            return self.q8.q8_matmul(x, *self.tensors)
        hi, lo = self.halves
        return hi(x) + lo(x)


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks -> the fp32 matrix (out, in) they stand for."""
    return q.float() * d.repeat_interleave(Q4_GROUP, 1) + m.repeat_interleave(Q4_GROUP, 1)


def q8_kernel():
    """The engine's own Q8_0 product (csrc/q8_matmul.cpp) where it is built and the CPU has AVX2,
    else None."""
    ext = q4_kernel()
    return ext if ext is not None and ext.q8_matmul_available() else None


def products_here(fmt: WeightFormat, out_features: int) -> list[Product]:
    """The products a weight of the format with `out_features` outputs can take on this machine,
    fastest first. The engine's kernels need a whole number of 16-column panels."""
    fmt = WeightFormat(fmt)
    kernel = {WeightFormat.Q4_1: q4_kernel, WeightFormat.Q8_0: q8_kernel}.get(fmt, f32_kernel)()
    own = [Product.OWN] if out_features % 16 == 0 and kernel is not None else []
    if fmt in (WeightFormat.Q4_1, WeightFormat.Q8_0):
        return own + [Product.PLAIN]
    dtype = torch.float32 if fmt is WeightFormat.FP32 else torch.bfloat16
    onednn = [Product.ONEDNN] if prepacking_available(dtype) else []
    # oneDNN packs bfloat16 only where it has AVX512-BF16 dot products, and there they are fastest
    fastest = onednn + own if fmt is WeightFormat.BF16 else own + onednn
    return fastest + [Product.PLAIN]


class PackedLinear:
    """The weight of one linear layer in one format, and the batch-invariant product with it
    (a plain object, not a module: the model's Linear holds one and its hooks stay where they are).

    Built from the fp32 weight (out, in), or for q4_1 from Q4_1 blocks (q, d, m) when the
    checkpoint has them (otherwise the fp32 weight is quantized). `product` (Product): the fastest
    this machine has (products_here) unless one is named. Output dtype: fp32 for fp32 and the
    engine's q4_1 kernel, bfloat16 for bf16 and PyTorch's int4 kernel (the caller adds it to an
    fp32 residual, which promotes it).
    """

    def __init__(self, fmt: WeightFormat, weight: torch.Tensor, q4_blocks=None, product: Product | None = None):
        self.format = WeightFormat(fmt)
        self.out_features, self.in_features = weight.shape
        here = products_here(self.format, self.out_features)
        if product is not None and Product(product) not in here:
            raise InvalidParameter("product", f"{Product(product).value} cannot multiply a {self.format.value} "
                                              f"weight of {self.out_features} outputs here; "
                                              f"this machine has {', '.join(p.value for p in here)}")
        self.product = here[0] if product is None else Product(product)
        if self.format is WeightFormat.Q8_0:
            self.q8 = PackedQ8_0(weight, product=self.product)
            self.tensors = self.q8.tensors   # (q, d) for the kernel, or the two 4-bit halves' four
            return
        if self.format is WeightFormat.Q4_1:
            blocks = q4_blocks or quantize_q4_1(weight)
            self.q4 = q4_kernel()
            pack = pack_q4_1_native if self.product is Product.OWN else pack_q4_1
            self.tensors = pack(*blocks)   # (nibbles, dm) or (packed, scales_zeros)
            return
        self.dtype = torch.float32 if self.format is WeightFormat.FP32 else torch.bfloat16
        w = weight.to(self.dtype)
        self.f32 = f32_kernel()
        pack = {Product.OWN: pack_f32_native, Product.ONEDNN: prepack_weight, Product.PLAIN: lambda w: w}
        self.tensors = (pack[self.product](w),)

    @property
    def prepacked(self) -> bool:
        """Whether the weight is laid out for a faster product than PyTorch's plain one."""
        return self.product is not Product.PLAIN

    @property
    def activation_rounding(self) -> str:
        """ActivationRounding of this product's input: fp32 keeps it; bf16, and q4_1 on PyTorch's
        int4 kernel, round it to bf16; q4_1 on the engine's kernel to 8-bit integers per group of
        32 (both instruction sets); q8_0 as PackedQ8_0 says."""
        if self.format is WeightFormat.Q8_0:
            return self.q8.activation_rounding
        if self.format is WeightFormat.Q4_1:
            own = self.product is Product.OWN
            return (ActivationRounding.INT8 if own else ActivationRounding.BF16).value
        return (ActivationRounding.NONE if self.format is WeightFormat.FP32 else ActivationRounding.BF16).value

    @property
    def min_rows(self) -> int:
        """The fewest rows a product runs with (fewer are padded with zero rows)."""
        if self.product is Product.OWN or self.format in (WeightFormat.Q4_1, WeightFormat.Q8_0):
            return 1
        if self.product is Product.ONEDNN:
            return PREPACKED_MIN_ROWS
        return MIN_GEMM_ROWS if self.format is WeightFormat.FP32 else BF16_MIN_ROWS

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from memory for the weight."""
        return sum(t.nbytes for t in self.tensors)

    def __call__(self, x):  # (N, in) -> (N, out)
        if self.format is WeightFormat.Q8_0:
            return self.q8(x)
        if self.format is WeightFormat.Q4_1:
            return self.q4.q4_matmul(x, *self.tensors) if self.product is Product.OWN else linear_q4(x, *self.tensors)
        if self.product is Product.OWN:
            if self.format is WeightFormat.FP32:
                return self.f32.f32_matmul(x, *self.tensors)
            return self.f32.f32_matmul(x.to(torch.bfloat16), *self.tensors).to(torch.bfloat16)
        if self.product is Product.ONEDNN:
            return linear_prepacked(x.to(self.dtype), *self.tensors)
        if self.format is WeightFormat.FP32:
            return linear(x, *self.tensors)
        return linear_bf16(x, *self.tensors)
