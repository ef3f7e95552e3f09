"""Batch-invariant matrix multiply: the same row gives the same result in any batch.

CPU matrix-multiply libraries pick a kernel by the shape of the problem, and different kernels
sum in different orders, so the same token could get slightly different logits alone and in a
batch (the problem "Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025, tackles
on GPUs). Measured here on MKL's sgemm: rows are computed in panels of MIN_GEMM_ROWS, and a
partial panel (fewer rows, or the last rows of a small matrix when threads split the rows) goes
to another kernel. Padding every matmul to a whole number of panels removes the difference;
tests/test_attention.py checks it bit for bit. This is why a batched request gives exactly the
tokens it gives alone, and a chunked prefill exactly what one pass gives.
"""

import torch
import torch.nn.functional as F

MIN_GEMM_ROWS = 4  # MKL sgemm's row panel: a partial one switches kernels (and rounding)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T, x: (N, in), weight: (out, in) -> (N, out), padded to whole row panels."""
    n = x.shape[0]
    rows = max(MIN_GEMM_ROWS, -(-n // MIN_GEMM_ROWS) * MIN_GEMM_ROWS)
    if rows == n:
        return F.linear(x, weight)
    padded = torch.cat([x, x.new_zeros(rows - n, x.shape[1])])
    return F.linear(padded, weight)[:n]
