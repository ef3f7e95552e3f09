"""The pieces of tests/bounds.py that other tests' tolerances rest on, checked against closed forms
and against their own definitions."""

import math

import pytest
import torch

from bounds import (ROUND, STEP, U_BF16, attention_rounding, chi2_quantile, exp_coarse_error, format_roundings,
                    redraw_factor, redraw_product, rounding_path)


@pytest.mark.parametrize("p", [1e-9, 1e-3, 0.05, 0.5, 0.99])
def test_chi2_quantile_matches_the_closed_form_of_two_degrees(p):
    """chi-square with 2 degrees of freedom is exponential with mean 2: its p-quantile is -2 ln(1 - p)."""
    exact = -2 * math.log1p(-p)
    assert abs(chi2_quantile(2, p) - exact) <= 1e-9 * exact


def test_chi2_quantile_orders_and_centres():
    """Quantiles rise with p, and the median of many degrees lies near k (Wilson-Hilferty: k (1 - 2 / 9k)^3)."""
    qs = [chi2_quantile(63, p) for p in (1e-8, 1e-4, 0.1, 0.5, 0.9)]
    assert qs == sorted(qs) and len(set(qs)) == 5
    assert abs(qs[3] - 63 * (1 - 2 / (9 * 63)) ** 3) < 0.05


def test_redraw_factor_grows_with_the_logits_covered_and_falls_with_the_redraws():
    assert redraw_factor(10) < redraw_factor(10_000)
    assert redraw_factor(1000, redraws=128) < redraw_factor(1000, redraws=32)
    # never below the Gaussian tail alone: the spread's own estimate only adds
    assert redraw_factor(1000) > math.sqrt(2 * math.log(2 * 1000 / 1e-3))


@pytest.mark.parametrize("kind", ["bf16", "int16", "int8"])
def test_a_rounding_moves_a_value_by_at_most_half_its_step(kind):
    """The redraw model's step (STEP) is the spacing the rounding (ROUND) lands on: rounding to
    nearest moves each value by at most half of it, and the step is not larger than needed."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 256, generator=g, dtype=torch.float64) * torch.logspace(-3, 4, 256, dtype=torch.float64))
    moved = (ROUND[kind](x) - x).abs()
    step = STEP[kind](x)
    assert bool((moved <= step / 2 * (1 + 1e-12)).all())
    assert float((moved / step).max()) > 0.45         # some values do move by nearly half a step


def test_a_redrawn_product_stays_within_half_a_step_per_activation():
    """redraw_product's activations lie within half a rounding step of the exact ones, with a new
    draw on every call and a mean error near zero (the model: independent, mean-zero errors)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g, dtype=torch.float64)
    eye = torch.eye(64, dtype=torch.float32)
    weight, x_kind, y_kind = format_roundings("q4_1", "avx512vnni")
    w = weight(eye)                                         # Q4_1's identity: fp16 scales, near 1
    assert (x_kind, y_kind) == ("int8", None)
    assert format_roundings("q4_1", "avx2")[1:] == ("int8", None)     # the same rounding on both paths
    assert format_roundings("q4_1", "")[1:] == ("bf16", "bf16")       # PyTorch's int4 kernel
    product = redraw_product("q4_1", "avx512vnni", g)
    a, b = product(x, eye), product(x, eye)
    assert not torch.equal(a, b)
    moved = (a - x @ w.T).abs()
    assert bool((moved <= (STEP["int8"](x) / 2) @ w.abs().T * (1 + 1e-12)).all())
    assert abs(float(((a - x @ w.T) / STEP["int8"](x)).mean())) < 0.05


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_1"])
def test_kernel_paths_share_redraws_exactly_where_they_round_alike(fmt):
    """rounding_path names two kernel paths alike (LogitBounds then redraws once for both) if and
    only if format_roundings gives them the same weights and the same kinds of rounding, and
    attention_rounding the same rounding of attention's operands."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    paths = ["avx512vnni", "avx2", ""]

    def roundings(isa):
        weight, x_kind, y_kind = format_roundings(fmt, isa)
        return weight(w), x_kind, y_kind, attention_rounding(fmt, isa)
    for a in paths:
        for b in paths:
            (wa, *kinds_a), (wb, *kinds_b) = roundings(a), roundings(b)
            alike = torch.equal(wa, wb) and kinds_a == kinds_b
            assert (rounding_path(fmt, a) == rounding_path(fmt, b)) == alike, (fmt, a, b)


def test_the_bf16_numerators_exp_is_far_finer_than_their_rounding():
    """The kernels' exp for softmax numerators rounded to bfloat16 next (vec.h: exp_coarse): its
    error bound, derived from its own constants, is under a hundredth of the rounding that follows,
    so attention_bf16_bound, which adds both, is still the rounding's."""
    assert 0 < exp_coarse_error() < U_BF16 / 100
