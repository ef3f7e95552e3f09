"""The Transformer's parts against their definitions, and the whole model's basic contracts
(on the tiny model; parity with transformers on the real one is in test_parity.py)."""

import math

import pytest
import torch

from bounds import (SILU_ROUNDINGS, SPLIT_SUM_ERROR_RATIO, U32, U_BF16, against_f64, fp32_dot_bound, gamma,
                    llama_logits_f64, rmsnorm_f32_bound, rotary_f32_bound)
from kernel_paths import kernel_path  # noqa: F401 (a fixture: every kernel path this CPU offers)
from conftest import lm_head_bytes_per_weight_q4_1
from core.model.model import MLP, RMSNorm, Rotary, Transformer


@pytest.fixture(scope="module")
def tiny_model(tiny_loaded):
    return Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict)


@pytest.fixture(scope="module")
def ids(tiny_loaded):
    out = tiny_loaded.tokenizer.encode("A model reads tokens, and every position predicts the next one.")
    assert len(out) >= 12
    return out


def test_rmsnorm_is_x_over_rms_times_weight():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=g))
    x = torch.randn(5, 8, generator=g) * 3
    expected = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    # fp32 evaluations of one definition, each within rmsnorm_f32_bound of exact (tests/bounds.py)
    bound = 2 * rmsnorm_f32_bound(x, norm.weight, 1e-5)
    assert ((norm(x).double() - expected.double()).abs() <= bound).all()
    assert ((norm(x).double() - torch.nn.functional.rms_norm(x, (8,), norm.weight, eps=1e-5).double()).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 63, 64, 200])   # 64 and more: rows split across threads
def test_the_rmsnorm_kernel_is_the_definition_row_by_row(rows, kernel_path):
    """The engine's kernel (csrc/rms_norm.cpp), once use_kernels sets it: the same definition to
    float rounding, and each row's bits independent of the others."""
    from core.kernels import loader
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    x = torch.randn(rows, 576, generator=g) * 3
    expected = torch.nn.functional.rms_norm(x, (576,), norm.weight, eps=1e-5)
    norm.kernel = loader.extension()
    y = norm(x)
    assert ((y.double() - expected.double()).abs() <= 2 * rmsnorm_f32_bound(x, norm.weight, 1e-5)).all()
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(norm(x[r:r + 1])[0], y[r])


@pytest.mark.parametrize("delta_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 200])
def test_add_rms_norm_is_the_add_then_the_norm(rows, delta_dtype, kernel_path):
    """The prefill's fused residual add (csrc/rms_norm.cpp: add_rms_norm): x += delta in place, then
    the norm of the new x: the same bits as `x + delta` (delta promoted to fp32) and rms_norm."""
    from core.kernels import loader
    kernel = loader.extension()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 576, generator=g) * 3
    delta = (torch.randn(rows, 576, generator=g)).to(delta_dtype)
    w = torch.randn(576, generator=g)
    summed = x + delta
    expected = kernel.rms_norm(summed, w, 1e-5)
    y = kernel.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, summed)
    assert torch.equal(y, expected)


def test_add_rms_norm_refuses_what_it_cannot_take():
    from core.kernels import loader
    kernel = loader.extension()
    with pytest.raises(RuntimeError, match="delta has the shape of x"):
        kernel.add_rms_norm(torch.zeros(2, 32), torch.zeros(3, 32), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous float"):
        kernel.add_rms_norm(torch.zeros(32, 2).t(), torch.zeros(2, 32), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous float"):
        kernel.add_rms_norm(torch.zeros(2, 32, dtype=torch.float64), torch.zeros(2, 32), torch.ones(32), 1e-5)


def test_use_kernels_sets_every_norm(tiny_loaded):
    from core.kernels import loader
    model = Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict)
    parts = [m for m in model.modules() if isinstance(m, (RMSNorm, Rotary, MLP))]
    assert len(parts) == 3 * tiny_loaded.config.num_layers + 2 and all(m.kernel is None for m in parts)
    model.use_kernels(loader.kernels(tiny_loaded.config))
    assert all(m.kernel is loader.extension() for m in parts)


def test_the_rotary_kernel_is_the_definition(kernel_path):
    """csrc/rotary.cpp against Rotary's torch code, on strided rows as the model passes them."""
    from core.kernels import loader
    g = torch.Generator().manual_seed(2)
    rotary = Rotary(64, 10000.0, 512)
    qkv = torch.randn(37, 15 * 64, generator=g)
    x = qkv[:, : 12 * 64].view(37, 12, 64)                  # (T, heads, D), rows strided
    positions = torch.randint(0, 512, (37,), generator=g)
    expected = rotary(x, positions)
    rotary.kernel = loader.extension()
    y = rotary(x, positions)
    cos, sin = rotary.cos[positions][:, None, :], rotary.sin[positions][:, None, :]
    bound = 2 * rotary_f32_bound(x, cos, sin)         # each within gamma_2 of exact (tests/bounds.py)
    assert y.is_contiguous() and ((y.double() - expected.double()).abs() <= bound).all()
    assert torch.equal(rotary(x[5:6], positions[5:6])[0], y[5])     # a token alone: the same bits
    with pytest.raises(RuntimeError, match="outside the table"):
        rotary(x[:1], torch.tensor([512]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_silu_mul_kernel_is_the_definition(dtype, kernel_path):
    """csrc/silu_mul.cpp: silu(gate) * up computed in float and rounded once to the input's dtype
    (to nearest even for bfloat16), each row on its own, also where silu saturates."""
    from core.kernels import loader
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(9, 2 * 1536, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])   # e^-gate overflows, vanishes; zeros
    y = loader.extension().silu_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up                   # in float
    assert y.dtype == dtype and y.shape == (9, 1536)
    # silu(g) * up in fp32: SILU_ROUNDINGS + 1 roundings relative to the exact product (tests/bounds.py),
    # and where e^-g overflows fp32 (g = -200) silu is below fp32's smallest normal number: that much
    exact64 = torch.nn.functional.silu(gate.double()) * up.double()
    in_float = (SILU_ROUNDINGS + 1) * U32 * exact64.abs() + torch.finfo(torch.float32).tiny * up.double().abs()
    if dtype == torch.float32:
        assert ((y.double() - exact64).abs() <= in_float).all()
    else:                                                         # one rounding of a float close to exact
        assert ((y.double() - exact64).abs() <= U_BF16 * (exact64.abs() + in_float) + in_float).all()
    assert y[0, 0] == 0 and y[0, 1] == 200 * up[0, 1].to(dtype) and y[0, 2] == 0
    assert torch.equal(loader.extension().silu_mul(gate_up[4:5])[0], y[4])


def test_rotary_rotates_pairs_of_half_dimensions():
    D, theta = 8, 10000.0
    rot = Rotary(D, theta, max_positions=64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, D, generator=g)
    pos = torch.tensor([0, 1, 2, 7, 30, 63])
    y = rot(x, pos)
    assert torch.allclose(y[0], x[0])                                  # position 0: identity
    # a rotation keeps norms: the tables' cos^2 + sin^2 is 1 to a few u (each rounded once, 2u each,
    # plus the fp32 angle's own rounding cancels in cos^2 + sin^2), the products gamma_2 (rotary_f32_bound),
    # the norms' sums gamma_D: in all (gamma_2 + gamma_D + 4u) |x|, doubled
    assert ((y.norm(dim=-1) - x.norm(dim=-1)).abs() <= 2 * (gamma(2) + gamma(D) + 4 * U32) * x.norm(dim=-1)).all()
    # dimension i pairs with i + D/2 and turns by pos * theta^(-2i/D); the table's angle is the fp32
    # product of an fp32 frequency (pow within 1 ulp, so 3u relative in all), cos and sin rounded once
    # (u): each output within |angle| 3u (|a| + |b|) + u (|a| + |b|) + gamma_2 (|a| + |b|), doubled
    i, p = 1, 7
    angle = p * theta ** (-2 * i / D)
    a, b = x[3, :, i], x[3, :, i + D // 2]
    tol = float(2 * (3 * U32 * angle + U32 + gamma(2)) * (a.abs() + b.abs()).max())
    assert torch.allclose(y[3, :, i], a * math.cos(angle) - b * math.sin(angle), rtol=0, atol=tol)
    assert torch.allclose(y[3, :, i + D // 2], b * math.cos(angle) + a * math.sin(angle), rtol=0, atol=tol)


def test_rotary_scores_depend_on_relative_position():
    D = 16
    rot = Rotary(D, 10000.0, max_positions=128)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, D, generator=g), torch.randn(1, 1, D, generator=g)

    def score(m, n):
        return (rot(q, torch.tensor([m])) * rot(k, torch.tensor([n]))).sum()
    # each score is exact up to the tables' angles (fp32, 3u relative: up to 57 * 3u rad here),
    # cos and sin's rounding (u) and the rotation's and the dot's sums (gamma_2, gamma_D), all
    # times sum |q| |k| at most; doubled for second order and for the two scores compared
    scale = float((q.abs() * 2).sum() * (k.abs() * 2).sum())            # |rotated| <= |a| + |b| per pair
    tol = 2 * 2 * (3 * U32 * 57 + U32 + gamma(2) + gamma(D)) * scale
    assert torch.allclose(score(10, 3), score(57, 50), rtol=0, atol=tol)
    assert torch.allclose(score(5, 5), (q * k).sum(), rtol=0, atol=tol)


def test_from_state_dict_adopts_the_tensors(tiny_loaded, tiny_model):
    sd = tiny_loaded.state_dict
    assert tiny_model.embed_tokens.weight.data_ptr() == sd["embed_tokens.weight"].data_ptr()
    assert not any(p.requires_grad for p in tiny_model.parameters())
    assert not tiny_model.training
    assert set(tiny_model.state_dict()) == set(sd)


def test_from_state_dict_is_strict(tiny_loaded):
    sd = dict(tiny_loaded.state_dict)
    del sd["norm.weight"]
    with pytest.raises(RuntimeError):
        Transformer.from_state_dict(tiny_loaded.config, sd)


def test_score_shape_and_causality(tiny_model, ids):
    cfg = tiny_model.config
    full = tiny_model.score(ids)
    assert full.shape == (len(ids), cfg.vocab_size) and full.dtype == torch.float32
    assert torch.isfinite(full).all()
    # the same positions computed in another batch: each within SPLIT_SUM_ERROR_RATIO times the
    # full run's error against float64 (plus 4 ulps), so within tol of each other (tests/bounds.py)
    _, each, _ = against_f64(full, full, llama_logits_f64(tiny_model, ids), SPLIT_SUM_ERROR_RATIO)
    tol = 2 * each
    prefix = tiny_model.score(ids[:5])
    assert torch.allclose(prefix, full[:5], rtol=0, atol=tol)    # later tokens do not leak back
    changed = tiny_model.score(ids[:5] + [ids[6]] + ids[6:])
    assert torch.allclose(changed[:5], full[:5], rtol=0, atol=tol)
    assert not torch.allclose(changed[5], full[5], rtol=0, atol=tol)


def test_tied_lm_head(tiny_model, ids):
    hidden = tiny_model(torch.tensor(ids), torch.arange(len(ids)))
    assert hidden.shape == (len(ids), tiny_model.config.hidden_size)
    logits = tiny_model.logits(hidden)
    emb = tiny_model.embed_tokens.weight                     # both fp32 products within gamma_C of exact
    assert ((logits.double() - hidden.double() @ emb.double().T).abs() <= fp32_dot_bound(hidden, emb)).all()


def test_paged_forward_matches_score(make_tiny_engine, tiny_model, ids):
    """The engine's path (packed batch, paged KV cache) against the plain causal one."""
    from core import SamplingParams

    engine = make_tiny_engine()
    seq = engine.make_sequence(ids, SamplingParams(temperature=0.0))
    engine.block_manager.allocate(seq, len(ids))
    step = engine.runner.prepare([(seq, len(ids))])
    with torch.inference_mode():
        paged = engine.view.model.logits(engine.view.model(step.input_ids, step.positions, step.batch))
    # the paged kernels are other fp32 arithmetic of the same function: their error against float64
    # at most SPLIT_SUM_ERROR_RATIO times the plain path's, plus 4 ulps (tests/bounds.py)
    err, bound, err_plain = against_f64(paged, tiny_model.score(ids), llama_logits_f64(tiny_model, ids),
                                        SPLIT_SUM_ERROR_RATIO)
    assert err <= bound, (err, bound, err_plain)


@pytest.mark.parametrize("fmt", ["bf16", "q4_1"])
def test_reference_runs_the_same_weights_in_fp32(tiny_loaded, tiny_model, ids, fmt):
    """A packed model's reference() is the fp32 model over the same weight tensors (no copy)."""
    packed = Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict, fmt)
    ref = packed.reference()
    assert ref is not packed and ref.weight_format.value == "fp32" and ref.lm_head is None
    for (name, a), (_, b) in zip(packed.state_dict().items(), ref.state_dict().items()):
        assert a.data_ptr() == b.data_ptr(), name
    plain = Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict, packed=False)
    assert torch.equal(ref.score(ids), plain.score(ids))
    # tiny_model: prepacked fp32, other kernels of the same fp32 function (tests/bounds.py)
    err, bound, _ = against_f64(ref.score(ids), tiny_model.score(ids), llama_logits_f64(tiny_model, ids),
                                SPLIT_SUM_ERROR_RATIO)
    assert err <= bound
    assert not torch.equal(packed.score(ids), tiny_model.score(ids))     # the packed one rounds
    assert tiny_model.reference() is tiny_model


def test_only_q4_1_on_its_own_kernel_rounds_attentions_operands(tiny_loaded):
    """model.Attention.bf16_operands, what tests/bounds.py's attention_rounding models: q4_1 on the
    engine's own product (where it runs here), no other format or product."""
    from bounds import attention_rounding
    from core.model.linear import q4_kernel_isa
    for fmt in ("fp32", "bf16", "q8_0", "q4_1"):
        model = Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict, fmt)
        want = attention_rounding(fmt, q4_kernel_isa()) == "bf16"
        assert [layer.attn.bf16_operands for layer in model.layers] == [want] * len(model.layers), fmt
    assert q4_kernel_isa() == "" or Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict,
                                                                "q4_1").layers[0].attn.bf16_operands


def test_decode_weight_bytes_counts_each_format(tiny_loaded):
    """What one decode step reads: fp32 4 bytes a weight, bf16 2, q4_1 half a byte plus a bf16
    scale and zero per 32; the tied LM head once (q4_1: its Q8_0 form, a byte a weight and an fp16
    scale per 32, or two 4-bit halves where the Q8_0 kernel does not run)."""
    cfg = tiny_loaded.config
    C, I, D, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    linear = L * (C * (cfg.num_heads + 2 * cfg.num_kv_heads) * D + cfg.num_heads * D * C + 3 * C * I)
    head = cfg.vocab_size * C
    per = {"fp32": (4, 4), "bf16": (2, 2), "q4_1": (0.5 + 4 / 32, lm_head_bytes_per_weight_q4_1())}
    for fmt, (w, h) in per.items():
        model = Transformer.from_state_dict(cfg, tiny_loaded.state_dict, fmt)
        assert model.decode_weight_bytes() == linear * w + head * h, fmt
