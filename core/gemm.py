"""Batch-invariant matrix multiply, in three weight formats: the same row gives the same result
in any batch.

CPU matrix-multiply libraries pick a kernel by the shape of the problem, and different kernels
sum in different orders, so the same token could get slightly different logits alone and in a
batch (the problem "Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025, tackles
on GPUs). Each format below uses one kernel whose rounding does not depend on the batch, either
by construction or by padding the batch to the shapes where it holds; tests/test_gemm.py checks
every format bit for bit, alone against batched, with one and two threads.

- fp32: MKL's sgemm. Rows are computed in panels of MIN_GEMM_ROWS, and a partial panel (fewer
  rows, or the last rows of a small matrix when threads split the rows) goes to another kernel,
  so every product is padded to whole panels. The reference format, and the slowest: one decode
  step streams 538 MB of weights through a matrix-vector product that MKL runs at ~10 GB/s.
- bf16: weights in bfloat16, the product accumulated in fp32 by oneDNN (AVX512-BF16), rounded to
  bfloat16 on the way out. oneDNN takes a matrix-vector path for a single row that sums in
  another order, so one row is padded to BF16_MIN_ROWS.
- q4_1: the GGUF file's own 4-bit weights (llama.cpp's Q4_1: groups of 32 weights, w = d*q + m,
  q in 0..15), packed for PyTorch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, written for
  torchao's weight-only quantization), which computes w = (q - 8) * scale + zero with
  scale = d and zero = m + 8d, activations in bfloat16, accumulation in fp32. Its rows are
  independent by construction: each output is one fused multiply-add chain over k in a fixed
  order, whatever the number of rows or threads, so it needs no padding at all. A quarter of
  bf16's bytes (plus a bf16 scale and zero per 32 weights): the fastest format for decode.
"""

import torch
import torch.nn.functional as F

from .config import WeightFormat
from .errors import InvalidParameter

MIN_GEMM_ROWS = 4    # MKL sgemm's row panel: a partial one switches kernels (and rounding)
BF16_MIN_ROWS = 2    # oneDNN's bf16 matmul takes a matrix-vector kernel for one row
Q4_GROUP = 32        # weights per Q4_1 group (one scale and one minimum each)


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


def linear_q4(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """q4_1: x (N, in) any float dtype, packed (out, in/2) uint8, scales_zeros (in/32, out, 2)
    bfloat16 -> (N, out) bfloat16. No padding: rows are independent by construction."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, Q4_GROUP, scales_zeros)


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


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 blocks -> (packed (out, in/2) uint8, scales_zeros (in/32, out, 2) bfloat16) for
    linear_q4: w = d*q + m = (q - 8)*d + (m + 8d)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales_zeros = torch.stack([d.t(), (m + 8 * d).t()], dim=-1)   # (in/32, out, 2)
    return packed, scales_zeros.to(torch.bfloat16).contiguous()


def q8_0_as_two_q4(weight: torch.Tensor):
    """An 8-bit matrix (llama.cpp's Q8_0: w = d*q per group of 32, q in -127..127) as two 4-bit
    ones for the int4 kernel: q = 16*hi + lo with hi in -8..7 and lo in 0..15, so
    w = 16d*hi + d*lo. SmolLM2's embedding is Q8_0 in the GGUF, and re-quantizing its fp32
    values finds the same d and q. -> ((packed, scales_zeros) of 16d*hi, of d*lo)."""
    V, C = weight.shape
    groups = weight.float().reshape(V, C // Q4_GROUP, Q4_GROUP)
    d = (groups.abs().amax(-1) / 127).half().float()                    # (V, C/32)
    q = (groups / d.clamp_min(1e-12)[..., None]).round().clamp(-127, 127).to(torch.int32)
    hi, lo = (q >> 4).reshape(V, C), (q & 15).reshape(V, C)
    return (pack_q4_1(hi + 8, 16 * d, -8 * 16 * d), pack_q4_1(lo, d, torch.zeros_like(d)))


def linear_q8_0(x: torch.Tensor, halves) -> torch.Tensor:
    """x (N, in) times a q8_0_as_two_q4 matrix: the two 4-bit products, summed -> (N, out)
    bfloat16. Rows independent, as each product's are."""
    hi, lo = halves
    return linear_q4(x, *hi) + linear_q4(x, *lo)


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks -> the fp32 matrix (out, in) they stand for."""
    return q.float() * d.repeat_interleave(Q4_GROUP, 1) + m.repeat_interleave(Q4_GROUP, 1)


class PackedLinear:
    """The weight of one linear layer in one format, and the batch-invariant product with it
    (a plain object, not a module: the model's Linear holds one and its hooks stay where they are).

    Built from the fp32 weight (out, in), or for q4_1 from Q4_1 blocks (q, d, m) when the
    checkpoint has them (otherwise the fp32 weight is quantized). Output dtype: fp32 for fp32,
    bfloat16 for the others (the caller adds it to an fp32 residual, which promotes it).
    """

    def __init__(self, fmt: WeightFormat, weight: torch.Tensor, q4_blocks=None):
        self.format = WeightFormat(fmt)
        self.out_features, self.in_features = weight.shape
        if self.format is WeightFormat.FP32:
            self.tensors = (weight,)
        elif self.format is WeightFormat.BF16:
            self.tensors = (weight.to(torch.bfloat16),)
        else:
            self.tensors = pack_q4_1(*(q4_blocks or quantize_q4_1(weight)))  # (packed, scales_zeros)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from memory for the weight."""
        return sum(t.nbytes for t in self.tensors)

    def __call__(self, x):  # (N, in) -> (N, out)
        if self.format is WeightFormat.FP32:
            return linear(x, *self.tensors)
        if self.format is WeightFormat.BF16:
            return linear_bf16(x, *self.tensors)
        return linear_q4(x, *self.tensors)
