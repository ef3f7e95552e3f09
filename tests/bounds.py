"""Float tolerances derived from the arithmetic, for the tests that compare two computations.

A test that compares floats computed in two different ways (another kernel, another summation
order, another process split, another weight format) needs a bound that holds on every CPU and
every kernel path, not one read off a run on one machine. Two ways to get one, both here:

- an a-priori bound from rounding-error analysis (Higham, "Accuracy and Stability of Numerical
  Algorithms", 2nd ed., ch. 3): a dot product of n terms summed in floating point in ANY order,
  with or without fused multiply-adds, is within gamma_n * sum_i |a_i b_i| of the exact value,
  gamma_n = n u / (1 - n u), u the unit roundoff (2^-24 for fp32). The order-independence is
  what makes it hold for an AVX2 kernel, an AVX-512 kernel, oneDNN's or MKL's alike.
- for a whole network, where an a-priori bound through 30 layers would be useless, a float64
  reference of the same function with the same constants: the error of the computation under
  test is compared with the error of the computation it stands in for, both against float64
  (against_f64). Both errors are the network's amplification of per-operation roundings, so a
  ratio k between them is a statement about the arithmetic, not about one machine.
- for a weight format, whose few large roundings no single emulation reproduces, the probabilistic
  model of rounding (Higham and Mary, 2019): each rounding error an independent mean-zero variable;
  float32 runs with every rounding redrawn measure each logit's spread, and a stated significance
  turns it into a bound (LogitBounds, redraw_factor).

Nothing here reads a measured number: every bound is computed from the tensors of the test.
"""

import functools
import math

import torch

U32 = 2.0 ** -24        # fp32 unit roundoff: |fl(x) - x| <= u |x| for round-to-nearest
U_BF16 = 2.0 ** -8      # bfloat16 unit roundoff (8 significant bits)
U64 = 2.0 ** -53        # float64 unit roundoff

# A sum split into chains (tensor parallel ranks, mixture-of-experts' experts), against one chain.
# Tensor parallelism changes only the row-parallel products' sums (o_proj, down_proj): each output's
# fp32 chain over n inputs becomes d chains of n/d, then the all-reduce adds the d partials (d - 1
# roundings): n/d + d - 1 <= n roundings, so its a-priori bound (gamma * sum |a b|, Higham 3.5) is
# no larger than one process's. Every other operation is the same arithmetic on the same inputs, and
# the same network carries the roundings to the logits. So the TP logits' error against float64 is
# the same kind and size as one process's: at most SPLIT_SUM_ERROR_RATIO times it (a different draw of the
# same rounding process, whose max over T x V logits can land higher), plus a floor of 4 ulps of the
# logit scale (against_f64). It holds for any CPU and kernel path: both errors are
# measured on the machine, with the kernels it runs. The same holds for a mixture of experts with
# every expert on: the dense MLP's down-projection sum over its units, cut into one chain per expert.
SPLIT_SUM_ERROR_RATIO = 2.0
# Another fp32 implementation of the same function (transformers: MKL's sgemm, SDPA's softmax) makes
# dot products of the same lengths, whose a-priori rounding bounds (gamma_n * sum |a b|) are the same
# whatever the order, and uses the same RoPE tables: its error against float64 is the same kind and
# size as ours, so the same ratio.
OTHER_KERNELS_ERROR_RATIO = SPLIT_SUM_ERROR_RATIO
SILU_ROUNDINGS = 8   # silu(g) = g / (1 + exp(-g)) in fp32: exp within 2 ulps (Cephes' expf, libm), 3 more ops; doubled


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n successive roundings
    (a sum or dot product of n terms, any order, with or without FMA). Needs n u < 1."""
    if n * u >= 1:
        raise ValueError(f"gamma: n * u = {n * u} >= 1, no bound")
    return n * u / (1 - n * u)


def f64_rel(n: int) -> float:
    """Two float64 evaluations of one formula, in any order or form (here and in the code under
    test), each of at most n roundings on terms of one sign (no cancellation): each within gamma_n
    of the exact value, relative (Higham 3.1), so within 2 gamma_n of each other."""
    return 2 * gamma(n, U64)


def decimal_half(places: int) -> float:
    """The largest error of a number rounded to `places` decimal places (Python's round, JS's
    toFixed) and held as the nearest float64: half a unit of the last place, the float64 being
    within u of it (counted by the caller, at the number's scale)."""
    return 0.5 * 10.0 ** -places


def fp32_dot_bound(a: torch.Tensor, b: torch.Tensor, u: float = U32, extra_roundings: int = 0) -> torch.Tensor:
    """Elementwise bound on |fl(a @ b.T) - a @ b.T| for a (N, n), b (M, n) in fp32:
    gamma_{n + extra} * (|a| @ |b|.T), computed in float64 (Higham, Thm 3.1 / eq. 3.5). It holds
    for any summation order and any blocking, so for every kernel (AVX2 or AVX-512 FMA chains,
    oneDNN, MKL, several partial sums added afterwards); `extra_roundings` for kernels that round
    a few more times on each term's path (a scale applied per group). Returns (N, M) float64."""
    n = a.shape[-1] + extra_roundings
    return gamma(n, u) * (a.double().abs() @ b.double().abs().T)


def ulps(x, n: float = 1.0) -> float:
    """n units in the last place of fp32 at the scale of x (a number, or a tensor's largest
    magnitude): n * 2^(floor(log2 |x|) - 23). A floor for bounds whose other term can be 0
    (a result rounded once to fp32 is within half an ulp of the exact value)."""
    scale = float(x.abs().max()) if isinstance(x, torch.Tensor) else abs(float(x))
    if scale == 0.0:
        return 0.0
    return n * 2.0 ** (math.floor(math.log2(scale)) - 23)


def rounded_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` once (round to nearest even), back in float64."""
    return x.to(dtype).double()


def against_f64(got: torch.Tensor, base: torch.Tensor, exact: torch.Tensor, k: float,
                floor_ulps: float = 4.0) -> tuple[float, float, float]:
    """(error of `got`, its bound, error of `base`), all against the float64 `exact`:
    bound = k * max|base - exact| + ulps(exact, floor_ulps).

    `base` is the computation `got` stands in for (one process, for tensor parallel; the dense MLP
    for MoE), with the same inputs and fp32 arithmetic; its own error against float64 measures
    how much this network amplifies fp32 roundings on these inputs. `got` makes the same kinds
    of roundings, some in another order or a few more (say why in the test), so its error is at
    most k times as large; the floor of a few ulps of the output scale covers the case where
    `base` happens to be (nearly) exact. Then |got - base| <= error(got) + error(base) too."""
    err_got = float((got.double() - exact).abs().max())
    err_base = float((base.double() - exact).abs().max())
    return err_got, k * err_base + ulps(exact, floor_ulps), err_base


def llama_logits_f64(model, ids: list[int]) -> torch.Tensor:
    """llama_f64's logits (T, V)."""
    return llama_f64(model, ids)[1]


def llama_f64(model, ids: list[int], product=None, taps: dict | None = None, dtype: torch.dtype = torch.float64,
              batch: int = 0, operand=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The last block's residual stream (T, C) and the logits (T, V) of core.model.model.Transformer's function on one sequence, in float64: the same
    fp32 weights and the same constants (its RoPE tables, as fp32 values), with every operation in
    float64 (unit roundoff 2^-53, so within ~1e-12 relative of exact for this depth). A reference
    for fp32 computations of the same model, written out here so it shares no code with core/.
    `product` (x, w) -> x @ w.T, both float64, replaces the blocks' linear layers (not the LM head):
    format_product's, to make a weight format's roundings and nothing else. `taps`, if given, gets
    each layer i's qkv projection (T, (H + 2 Hkv) D), before RoPE, under i; its attention weights
    (H, T, T) under ("probs", i), its MLP's output (T, C) under ("mlp", i) and the residual stream
    after it (T, C) under ("residual", i). `dtype` and `batch` (> 0: that many copies of the
    sequence side by side, shapes (batch, T, ...)) are for LogitBounds' redraws, whose products
    differ per copy. `operand` x -> x, if given, rounds attention's operands as the engine's bf16
    mode does (core/model/attention.py): the query times 1/sqrt(D), the keys and the values (once
    per KV head, before the query heads share them) and the softmax's numerators exp(score - max),
    whose sum is then the denominator."""
    def lin(x, w):
        return x @ w.T if product is None else product(x, w)

    cfg = model.config
    sd = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    T, H, Hkv, D = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lead = (batch,) if batch else ()
    pos = torch.arange(T)
    cos, sin = model.rotary.cos[pos].to(dtype)[:, None], model.rotary.sin[pos].to(dtype)[:, None]   # (T, 1, D)

    def norm(x, w):   # RMSNorm
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rotate(x):    # rotate half, with the model's tables: sin holds (-sin, sin)
        half = D // 2
        return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin

    x = sd["embed_tokens.weight"][torch.tensor(ids)].expand(*lead, T, cfg.hidden_size)   # (..., T, C)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        qkv = lin(norm(x, sd[p + "attn_norm.weight"]), sd[p + "attn.qkv_proj.weight"])
        if taps is not None:
            taps[i] = qkv
        q = rotate(qkv[..., :H * D].unflatten(-1, (H, D)))
        k = rotate(qkv[..., H * D:(H + Hkv) * D].unflatten(-1, (Hkv, D)))
        v = qkv[..., (H + Hkv) * D:].unflatten(-1, (Hkv, D))
        if operand is not None:
            q, k, v = operand(q / math.sqrt(D)) * math.sqrt(D), operand(k), operand(v)
        k, v = (t.repeat_interleave(H // Hkv, dim=-2) for t in (k, v))  # (..., T, H, D): query head h reads KV h // group
        scores = torch.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(D)
        if operand is None:
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)   # (..., H, T, T)
        else:
            scores = scores.masked_fill(~mask, float("-inf"))
            e = operand(torch.exp(scores - scores.amax(-1, keepdim=True)))
            probs = e / e.sum(-1, keepdim=True)
        y = torch.einsum("...hqk,...khd->...qhd", probs, v).flatten(-2)   # (..., T, H * D)
        x = x + lin(y, sd[p + "attn.o_proj.weight"])
        gate, up = lin(norm(x, sd[p + "mlp_norm.weight"]), sd[p + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
        mlp = lin(torch.nn.functional.silu(gate) * up, sd[p + "mlp.down_proj.weight"])
        x = x + mlp
        if taps is not None:
            taps[("probs", i)], taps[("mlp", i)], taps[("residual", i)] = probs, mlp, x
    return x, norm(x, sd["norm.weight"]) @ sd["embed_tokens.weight"].T


def swiglu_f32_bound(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                     extra_roundings: int = 0) -> torch.Tensor:
    """Elementwise bound on |fl32(down(silu(gate x) * up x)) - exact|, x (N, C), w_gate and w_up
    (F, C), w_down (C', F): to first order in u, the products' own roundings (fp32_dot_bound)
    plus the hidden unit's error carried through down: err(h) <= sup|silu'| err(g) |u|
    + |silu(g)| err(u) + (SILU_ROUNDINGS + 1) u |h|, with sup|silu'| < 1.1. Second-order terms
    (u^2 times these) are covered by doubling. Any order of the sums, any kernel. (N, C') float64."""
    x = x.double()
    g, up = x @ w_gate.double().T, x @ w_up.double().T
    s = torch.nn.functional.silu(g)
    err_h = 1.1 * fp32_dot_bound(x, w_gate) * up.abs() + s.abs() * fp32_dot_bound(x, w_up) \
        + (SILU_ROUNDINGS + 1) * U32 * (s * up).abs()
    out = fp32_dot_bound(s * up, w_down, extra_roundings=extra_roundings) + err_h @ w_down.double().abs().T
    return 2 * out


def softmax_sum_bound(n: int) -> float:
    """|sum_j fl(p_j) - 1| for a softmax of n terms computed in fp32 and its weights summed in
    fp32: each p_j = e_j / S is off by at most (gamma_n + u) relative (S summed, one divide; the
    exp's own error cancels between e_j and S to first order, its 2 ulps bounded in both: 4u),
    then the n-term sum adds gamma_n. So gamma_n + u + 4u + gamma_n, doubled for second order."""
    return 2 * (2 * gamma(n) + 5 * U32)


def attention_f32_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise bound on |fl32(causal attention) - exact| for q (T, H, D), k, v (T, Hkv, D),
    query head h reading KV head h // (H / Hkv), scores scaled by 1/sqrt(D): (T, H, D) float64.
    Scores: err_s <= gamma_{D+1} |q||k| / sqrt(D) (the dot product and the scale). Softmax: a
    score error moves p_j by at most p_j (|err_s_j| + sum_i p_i |err_s_i|) <= 2 p_j max_i err_s_i,
    and its own roundings (max, exp, sum of T, divide) by (gamma_T + 6u) p_j. Output: sum_j p_j v_j,
    whose roundings add gamma_T sum_j p_j |v_j|. Any order of the sums (SDPA, the engine's kernel,
    AVX2 or AVX-512). To first order; doubled for the rest. mask: (T, T) True where a query sees a
    key (KV eviction's; causal by default): fewer keys only shorten the sums, gamma_T still bounds them."""
    T, H, D = q.shape
    group = H // k.shape[1]
    qd = q.double()
    kd, vd = (t.double().repeat_interleave(group, dim=1) for t in (k, v))   # (T, H, D)
    mask = torch.ones(T, T, dtype=torch.bool).tril() if mask is None else mask
    scores = torch.einsum("qhd,khd->hqk", qd, kd) / math.sqrt(D)
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)                 # (H, T, T)
    err_s = gamma(D + 1) * torch.einsum("qhd,khd->hqk", qd.abs(), kd.abs()) / math.sqrt(D)
    worst = err_s.masked_fill(~mask, 0).amax(-1, keepdim=True)              # (H, T, 1)
    rel_p = 2 * worst + gamma(T) + 6 * U32                                   # (H, T, 1)
    pv = torch.einsum("hqk,khd->qhd", p, vd.abs())                           # sum_j p_j |v_j|
    return 2 * (rel_p.permute(1, 0, 2) * pv + gamma(T) * pv)


@functools.lru_cache(maxsize=None)
def exp_coarse_error() -> float:
    """Relative error bound of the kernels' e^x for numerators rounded to bfloat16 next
    (csrc/vec.h: exp_coarse, x = n ln2 + r, e^r = 1 + r q(r), q of degree 3), from its own
    constants, read from vec.h:
    - the polynomial's error, |1 + r q(r) - e^r| / e^r, against float64's exp on 20,001 points of
      |r| <= ln2 / 2 (the error is smooth, a degree-4 remainder: between points it moves by far
      less than the margin below);
    - r = x - n ln2 in one multiply-add: one rounding (u) and the constant's distance from ln2 times
      |n| <= 127, an absolute error of r, so relative of e^r;
    - Horner's 4 multiply-adds, one rounding each: gamma_4 (the sums stay near 1; the products are
      small beside them); 2^n is exact.
    Doubled for the second order and the grid."""
    from pathlib import Path
    import re
    source = (Path(__file__).resolve().parents[1] / "core" / "kernels" / "csrc" / "vec.h").read_text()
    body = source[source.index("inline Vec exp_coarse("):]
    body = body[: body.index("\n}\n")]
    numbers = [float(v.rstrip("f")) for v in re.findall(r"set1\((-?[0-9.e-]+f)\)", body)]
    ln2 = -numbers[2]                  # -87.3365 (the clamp), log2(e), -ln2, then q's, highest first
    q = numbers[3:-1]                  # and the last: the 1 that 1 + r q(r) adds
    if len(q) != 4 or numbers[-1] != 1.0:
        raise ValueError(f"exp_coarse_error: vec.h's exp_coarse no longer has the form this reads: {numbers}")
    r = torch.linspace(-math.log(2) / 2, math.log(2) / 2, 20_001, dtype=torch.float64)
    poly = torch.zeros_like(r)
    for c in q:
        poly = poly * r + c
    fit = ((1 + r * poly - r.exp()).abs() / r.exp()).max().item()
    reduction = U32 + 127 * abs(ln2 - math.log(2))
    return 2 * (fit + reduction + gamma(4))


def attention_bf16_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound) for attention with bfloat16 operands (core/model/attention.py), shapes as
    attention_f32_bound's: exact is softmax(q' k'^T) v' in float64 on the operands as the kernel
    rounds them (q' = bf16(q / sqrt(D)), k' = bf16(k), v' = bf16(v): to nearest even, the same
    numbers on every path), and |kernel - exact| <= bound elementwise:
    - scores: fp32 sums of exact products, err_s <= gamma_D |q'||k'|; the max subtracted exactly;
      the numerator e_j = exp(s_j - max) within err_s_j + err_max + e + 2u relative (the kernel's
      exp for numbers rounded next, exp_coarse_error(), and its argument's rounding), err_max <=
      max_i err_s_i, then rounded to bfloat16: within U_BF16 more, so each e_j within
      rho = 2 max_i err_s_i + e + 2u + U_BF16 relative of exact;
    - the weights e_j / sum_i e_i then within 2 rho relative, and y = sum_j w_j v'_j moves by at
      most 2 rho sum_j p_j |v'_j|; its fp32 sums (values and denominator: gamma_T each) and the
      divide add (2 gamma_T + u) sum_j p_j |v'_j|.
    To first order; doubled for the rest. Any order of the sums (VDPBF16PS pairs or fp32 chains)."""
    T, H, D = q.shape
    group = H // k.shape[1]

    def bf16(t):
        return t.to(torch.bfloat16).double()
    qd = bf16(q / math.sqrt(D))
    kd, vd = (bf16(t).repeat_interleave(group, dim=1) for t in (k, v))        # (T, H, D)
    mask = torch.ones(T, T, dtype=torch.bool).tril() if mask is None else mask
    scores = torch.einsum("qhd,khd->hqk", qd, kd)
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)                   # (H, T, T)
    exact = torch.einsum("hqk,khd->qhd", p, vd)
    err_s = gamma(D) * torch.einsum("qhd,khd->hqk", qd.abs(), kd.abs())
    worst = err_s.masked_fill(~mask, 0).amax(-1, keepdim=True)                # (H, T, 1)
    rho = 2 * worst + exp_coarse_error() + 2 * U32 + U_BF16
    pv = torch.einsum("hqk,khd->qhd", p, vd.abs())                             # sum_j p_j |v'_j|
    return exact, 2 * ((2 * rho).permute(1, 0, 2) * pv + (2 * gamma(T) + U32) * pv)


def rmsnorm_f32_bound(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Elementwise bound on |fl32(x / sqrt(mean(x^2) + eps) * w) - exact|: the sum of C squares
    (positive terms: gamma_{C+1} relative, any order), the divide by C, the add of eps, the sqrt
    (half its input's relative error, plus u), the reciprocal or divide, and two products: at most
    (gamma_{C+1} + 3u) / 2 + 4u <= gamma_{C+8} relative to the exact result. Doubled for second order."""
    xd = x.double()
    exact = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * weight.double()
    return 2 * gamma(x.shape[-1] + 8) * exact.abs()


def rotary_f32_bound(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |fl32(x * cos + rotate_half(x) * sin) - exact| with the same tables:
    two products and one add (or an FMA), gamma_2 (|x cos| + |x' sin|)."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1).double()
    return gamma(2) * ((x.double() * cos.double()).abs() + (swapped * sin.double()).abs())


def entropy_bound(n: int) -> float:
    """|fl32(-sum p log p) - exact| for attention weights of n keys computed in fp32: each p_j within
    delta p_j of exact, delta = softmax_sum_bound(n), moves p log p by |dp| |1 + log p|, and
    sum_j p_j (1 + |log p_j|) = 1 + H <= 1 + log n; the log's own rounding (2u) and the n-term
    sum (gamma_n) are relative to the same sum of |p log p|. So (delta + gamma_n + 2u)(1 + log n)."""
    return (softmax_sum_bound(n) + gamma(n) + 2 * U32) * (1 + math.log(n))


# The prompt LogitBounds measures on (tests/conftest.py: logit_bounds; test_parity compares on it).
REFERENCE_PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens, and watched the fishing boats come home across the grey water. "
    "Nobody in the village remembered a night when the light had failed. One winter the storm "
    "came early, and for three days the sea threw itself against the rocks below the tower."
)
INT16_MAX = 32767   # core/kernels/csrc/int16_rows.h: x ~ s * i, s = the group's largest |x| / 32767 (Q8_0)
INT8_MAX = 127      # core/kernels/csrc/int8_rows.h: x ~ s * i, s = the group's largest |x| / 127 (Q4_1)


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers (8 significant bits) at each |x|: 2^(e - 8) for |x| in
    [2^(e-1), 2^e); 0 at 0. Rounding to nearest moves x by at most half of it.

    For float32 (LogitBounds' redraws: a billion entries a format) it is read off the bits: |x| in
    [2^(E-127), 2^(E-126)) for a biased exponent E, so the step 2^(E-134) is a float32 whose
    exponent field is E - 7, its mantissa 0: x's bits masked to the exponent, minus 7 << 23.
    Entries with E <= 7 (zero, and values below 2^-120, whose step is not a normal float32) take
    the general path."""
    if x.dtype == torch.float32:
        exponent = x.view(torch.int32) & 0x7F800000
        step = (exponent - (7 << 23)).view(torch.float32)
        small = exponent <= (7 << 23)
        if small.any():
            step[small] = _bf16_step_general(x[small])
        return step
    return _bf16_step_general(x)


def _bf16_step_general(x: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)
    return torch.where(x == 0, torch.zeros_like(x), torch.ldexp(torch.ones_like(x), exponent - 8))


def int_group_step(x: torch.Tensor, top: int, group: int = 32) -> torch.Tensor:
    """The step the integer kernels round activations to, for each entry of x (..., n): per group
    of 32, s = the group's largest |x| / top, so x ~ s * an integer in -top..top."""
    g = x.reshape(*x.shape[:-1], -1, group)
    return (g.abs().amax(-1, keepdim=True) / top).expand_as(g).reshape(x.shape)


def int16_group_step(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """int_group_step of the Q8_0 kernel's 16-bit integers (top 32767)."""
    return int_group_step(x, INT16_MAX, group)


def int8_group_step(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """int_group_step of the Q4_1 kernels' 8-bit integers (top 127), llama.cpp's rounding of
    activations: 258 times the 16-bit step."""
    return int_group_step(x, INT8_MAX, group)


def rounded_to_int_groups(x: torch.Tensor, top: int, group: int = 32) -> torch.Tensor:
    """x (..., n) rounded as the integer kernels round activations: per group of 32, to integers
    times s = the group's largest |x| / top (an error of at most s / 2 each). float64."""
    s = int_group_step(x.double(), top, group)
    return torch.round(x.double() / s.clamp_min(1e-300)) * s


def rounded_to_int16_groups(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """rounded_to_int_groups with 16-bit integers (the Q8_0 kernel)."""
    return rounded_to_int_groups(x, INT16_MAX, group)


def rounded_to_int8_groups(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """rounded_to_int_groups with 8-bit integers (the Q4_1 kernels)."""
    return rounded_to_int_groups(x, INT8_MAX, group)


# How each kind of activation rounding a format makes is done (to nearest) and how far apart its
# values lie (the step: a rounding moves a value by at most half of it).
ROUND = {"bf16": lambda x: rounded_to(x, torch.bfloat16).to(x.dtype), "int16": rounded_to_int16_groups,
         "int8": rounded_to_int8_groups}
STEP = {"bf16": bf16_step, "int16": int16_group_step, "int8": int8_group_step}


def format_roundings(fmt: str, isa: str):
    """(weight, x_kind, y_kind) of weight format `fmt` on kernel path `isa`
    (core.model.linear.q4_kernel_isa(): "avx512vnni", "avx2", or "" for PyTorch's int4 kernel):
    weight(w) the values the engine multiplies by for the fp32 weight w (float64); x_kind and
    y_kind how the activations and the result are rounded (a key of ROUND, or None: kept):
    - bf16: weights, activations and the result rounded to bfloat16 (every bf16 path: oneDNN's
      AVX512-BF16, the engine's fp32 kernel on bfloat16 weights, PyTorch's bf16 product);
    - q4_1: the weights the engine quantizes to (core.model.linear.quantize_q4_1: the format's
      definition, checked by test_gemm), the activations rounded to 8-bit integers per group of 32
      (avx512vnni and avx2 alike, llama.cpp's rounding; the integer sums exact), the result fp32;
      PyTorch's int4 kernel instead takes scale = d and zero = m + 8d in bfloat16, bfloat16
      activations and result;
    - q8_0: the engine's Q8_0 kernel (csrc/q8_matmul.cpp, on every AVX2 CPU, AVX-512 or not): the
      weights core.model.linear.quantize_q8_0 makes (llama.cpp's Q8_0), the activations rounded
      per group of 32 to 8-bit integers (avx512vnni) or 16-bit integers (avx2), the integer sums
      exact, the result fp32."""
    from core.model.linear import Q4_GROUP, quantize_q4_1, quantize_q8_0
    bf16 = torch.bfloat16
    if fmt == "bf16":
        return (lambda w: rounded_to(w, bf16)), "bf16", "bf16"
    if fmt == "q8_0":
        def q8_weight(w):
            q, d = quantize_q8_0(w.float())
            return q.double() * d.double().repeat_interleave(Q4_GROUP, 1)
        return q8_weight, ("int8" if isa == "avx512vnni" else "int16"), None
    if fmt != "q4_1":
        raise ValueError(f"format_roundings: fmt {fmt!r} is not bf16, q8_0 or q4_1")

    def q4_weight(w):
        q, d, m = (t.double() for t in quantize_q4_1(w.float()))
        if not isa:
            d, m = rounded_to(d, bf16), rounded_to(m + 8 * d, bf16) - 8 * rounded_to(d, bf16)
        return q * d.repeat_interleave(Q4_GROUP, 1) + m.repeat_interleave(Q4_GROUP, 1)
    return q4_weight, ("int8" if isa else "bf16"), (None if isa else "bf16")


def attention_rounding(fmt: str, isa: str) -> str | None:
    """How attention rounds its operands for weight format `fmt` on kernel path `isa` (a key of
    ROUND, or None: fp32): q4_1 on the engine's own kernel rounds them to bfloat16
    (model.Attention.bf16_operands: the query, keys, values and softmax numerators)."""
    return "bf16" if fmt == "q4_1" and isa else None


def rounding_path(fmt: str, isa: str) -> str:
    """The one kernel path that stands for `isa` among those on which format `fmt` makes the same
    roundings (format_roundings: the same weights, the same kinds of activation and result
    rounding), so that LogitBounds computes their redraws once: q4_1 rounds alike on avx512vnni
    and avx2 (8-bit integers), q8_0 on avx2 and "" (16-bit), bf16 on every path. test_bounds
    checks that paths sharing a name share their roundings."""
    if fmt == "q4_1":
        return "avx512vnni" if isa else ""
    if fmt == "q8_0":
        return "avx512vnni" if isa == "avx512vnni" else "avx2"
    return ""


def redraw_product(fmt: str, isa: str, generator: torch.Generator):
    """(x (..., N, in), w (out, in), w the fp32 weight) -> x @ w.T with the roundings weight format
    `fmt` makes on kernel path `isa` (format_roundings), each rounding of an activation or a result
    redrawn: instead of to nearest (ROUND), x moves by a uniform random fraction in [-1/2, 1/2) of its rounding's step, drawn
    independently for every entry (the model of LogitBounds: a rounding error as an independent,
    mean-zero variable of the rounding's size). The weights are rounded as the format rounds them:
    those are the same numbers in the engine."""
    weight, x_kind, y_kind = format_roundings(fmt, isa)

    def product(x, w):
        y = redraw(x_kind, x, generator) @ weight(w).to(x.dtype).T
        return y if y_kind is None else redraw(y_kind, y, generator)
    return product


def redraw(kind: str, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """x moved by a uniform random fraction in [-1/2, 1/2) of its `kind` rounding's step (STEP),
    independently for every entry: a redrawn rounding (redraw_product)."""
    noise = torch.rand(x.shape, generator=generator, dtype=x.dtype).sub_(0.5)
    return noise.mul_(STEP[kind](x)).add_(x)


def redraw_operand(fmt: str, isa: str, generator: torch.Generator):
    """llama_f64's `operand` for format `fmt` on kernel path `isa`: attention's operand roundings
    (attention_rounding) redrawn as redraw_product redraws the products'; None where attention
    runs in fp32."""
    kind = attention_rounding(fmt, isa)
    return None if kind is None else (lambda x: redraw(kind, x, generator))


def chi2_quantile(k: int, p: float) -> float:
    """The p-quantile of the chi-square distribution with k degrees of freedom: its CDF is the
    regularized lower incomplete gamma P(k/2, x/2); solved by bisection to float64 precision."""
    lo, hi = 0.0, float(k + 40 * math.sqrt(k) + 100)
    kk = torch.tensor(k / 2, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(torch.special.gammainc(kk, torch.tensor(mid / 2, dtype=torch.float64))) < p:
            lo = mid
        else:
            hi = mid
    return hi


# The redraws (LogitBounds): how many, and the probability that a bound fails on a correct engine.
REDRAWS = 64
SIGNIFICANCE = 1e-3


def redraw_factor(n: int, redraws: int = REDRAWS, significance: float = SIGNIFICANCE) -> float:
    """q such that |r - mean| <= q * s for every one of n variables r at once, with probability
    >= 1 - 2 * significance, where each r is a sum of independent mean-zero rounding errors (a
    strictly sub-Gaussian variable: a uniform one is, and so are sums of them, with the variance
    sigma^2 as the proxy), and mean and s^2 are the sample mean and variance of `redraws` other
    independent draws of it:
    - r - mean has variance sigma^2 (1 + 1 / redraws), and P(|r - mean| > z sd) <= 2 exp(-z^2 / 2):
      z = sqrt(2 ln(2 n / significance)) for all n at once (a union bound);
    - (redraws - 1) s^2 / sigma^2 is chi-square with redraws - 1 degrees of freedom for Gaussian
      draws, and more concentrated for the lighter-tailed sums of uniform errors, so
      sigma <= s sqrt((redraws - 1) / c) with c its (significance / n)-quantile, for all n at once."""
    z = math.sqrt(2 * math.log(2 * n / significance))
    dof = redraws - 1
    return z * math.sqrt(1 + 1 / redraws) * math.sqrt(dof / chi2_quantile(dof, significance / n))


class LogitBounds:
    """Bounds on how far an engine's logits may lie from another fp32 implementation's
    (transformers') on one sequence of a dense model, per weight format, derived against the
    float64 logits `exact` of the same fp32 weights:
    - fp32: each implementation is within OTHER_KERNELS_ERROR_RATIO times our fp32 model's error
      plus 4 ulps of the logit scale (`fp32_each`, against_f64); the two, within twice that
      (`fp32_pair`).
    - bf16, q8_0, q4_1: the engine's logits differ from exact by its format's roundings of
      activations (and of results, for bf16), carried through the network, plus its fp32
      arithmetic's (within `fp32_each`, the same operations as the fp32 model's). No single
      emulation of those roundings bounds them: SmolLM2 grows massive activations (the residual's
      largest entry is ~2e4 from layer 11 on), so a logit's format error is dominated by a few
      roundings of huge values, and from layer 1 on the engine's inputs differ enough from any
      emulation's for those few to fall on the other side of a tie: the same roundings, drawn
      again (an AVX-512 BF16 run found the engine's q4_1 error 2.8 times the emulation's). So the
      bound treats them as what they are, random draws: Higham and Mary's probabilistic model of
      rounding ("A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput.,
      2019), each rounding error an independent mean-zero variable of at most half its step.
      A logit's format error is then, to first order, the weights' rounding (the same numbers in
      the engine: a fixed part) plus a sum of such variables. REDRAWS float32 runs of the network
      with every activation rounding redrawn (redraw_product) estimate, per logit, the fixed part
      (their mean) and the spread of the rest (s), and redraw_factor turns s into a bound that
      holds for every logit compared at once, except with probability 2 * SIGNIFICANCE. Per logit:
      |engine - transformers| <= |mean| + redraw_factor * s + fp32_pair (the redraws' own fp32
      arithmetic only widens s).
    Two logits each within B of transformers' lead or trail by at most 2B more or less than
    there: a greedy choice can differ only where transformers' two best are within 2B.
    Nothing is read off a past run: every number is computed from this model on these tokens, on
    the machine and kernel path the test runs."""

    def __init__(self, model, ids: list[int]):
        """model: core.model.model.Transformer in fp32 (packed or not)."""
        self.model, self.ids = model, ids
        self.exact = llama_logits_f64(model, ids)                        # (T, V) float64
        self.fp32 = model.score(ids)                                     # (T, V) fp32, our kernels
        _, self.fp32_each, self.fp32_error = against_f64(self.fp32, self.fp32, self.exact,
                                                         OTHER_KERNELS_ERROR_RATIO)
        self.fp32_pair = 2 * self.fp32_each

    def runs(self, fmt: str, isa: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """compute_runs, once for all the kernel paths that round alike (rounding_path)."""
        return self.compute_runs(fmt, rounding_path(fmt, isa))

    @functools.cache
    def compute_runs(self, fmt: str, isa: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """REDRAWS float32 runs of the network with every activation rounding of format `fmt` on
        kernel path `isa` redrawn (one batch, a fixed seed), summed up: (mean, s) (T, V) float64,
        the sample mean and standard deviation of each logit's error against `exact`; and each
        run's quality figures against `exact` as the quantization table computes them
        (app/lab/formats.compare, written out here): top5 (REDRAWS,), the share of positions whose
        top-5 set is exact's, and kl (REDRAWS,), the mean KL(exact || run) per position."""
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            _, logits = llama_f64(self.model, self.ids, redraw_product(fmt, isa, generator),
                                  dtype=torch.float32, batch=REDRAWS,
                                  operand=redraw_operand(fmt, isa, generator))   # (REDRAWS, T, V)
        total, squares = torch.zeros_like(self.exact), torch.zeros_like(self.exact)
        lp_exact = torch.log_softmax(self.exact, -1)
        top_exact = self.exact.topk(5, dim=-1).indices.sort(-1).values
        top5, kl = [], []
        for run in logits:
            err = run.double() - self.exact
            total += err
            squares += err * err
            lp = torch.log_softmax(run.double(), -1)
            kl.append(float((lp_exact.exp() * (lp_exact - lp)).sum(-1).clamp_min(0.0).mean()))
            same = (run.topk(5, dim=-1).indices.sort(-1).values == top_exact).all(-1)
            top5.append(float(same.double().mean()))
        mean = total / REDRAWS
        sd = ((squares - REDRAWS * mean * mean).clamp_min(0) / (REDRAWS - 1)).sqrt()
        return mean, sd, torch.tensor(top5, dtype=torch.float64), torch.tensor(kl, dtype=torch.float64)

    def redrawn(self, fmt: str, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, s) (T, V) float64: the sample mean and standard deviation over REDRAWS redrawn
        runs of each logit's error against `exact` (runs). The mean holds what every run shares,
        the format's rounding of the weights (the engine's weights are the same numbers); s, the
        activations' roundings drawn again."""
        return self.runs(fmt, isa)[:2]

    def quality_bounds(self, fmt: str, isa: str) -> tuple[float, float]:
        """(lowest top-5 agreement, highest mean KL) against fp32 that the engine's format `fmt` on
        kernel path `isa` may show on these tokens, from the redrawn runs' quality figures (runs):
        the engine's figure is one more draw of the same rounding process. Each figure is a mean
        over the T positions of a bounded quantity whose roundings are drawn independently, taken
        as sub-Gaussian like the logits' errors, so redraw_factor (for the two figures at once)
        times the runs' standard deviation bounds its distance from their mean, except with
        probability 2 * SIGNIFICANCE. The engine's figures are against our fp32 logits, within
        fp32_each of `exact`: a few ulps, nothing at this scale."""
        _, _, top5, kl = self.runs(fmt, isa)
        q = redraw_factor(2)
        return float(top5.mean() - q * top5.std()), float(kl.mean() + q * kl.std())

    def logit_bound(self, fmt: str, isa: str = "", candidates: int = 64) -> torch.Tensor:
        """The bound (T, V) on |engine logit - transformers' fp32 logit| for weight format `fmt` on
        kernel path `isa` (the class docstring), holding at once for the T * (candidates + 1)
        logits a test compares: each row's `candidates` the engine recomputes exactly and
        transformers' best."""
        if fmt == "fp32":
            return torch.full_like(self.exact, self.fp32_pair)
        mean, sd = self.redrawn(fmt, isa)
        return mean.abs() + redraw_factor(len(self.ids) * (candidates + 1)) * sd + self.fp32_pair

    def bound(self, fmt: str, isa: str = "", candidates: int = 64) -> float:
        """One number for the format: the largest logit_bound over each row's `candidates` best
        exact logits (the ones that decide a greedy choice). Tests on other text than these
        tokens (a chat's continuation) use it as the scale of the format's error."""
        if fmt == "fp32":
            return self.fp32_pair
        top = self.exact.topk(candidates, dim=-1).indices
        return float(self.logit_bound(fmt, isa, candidates).gather(-1, top).max())


def rope_table_error(position: int) -> float:
    """Bound on |fp32 RoPE table entry - exact cos or sin of position * theta^(-2i/D)| for the
    tables core.model.model.Rotary and transformers build alike, with D a power of two: 2i/D exact,
    theta^(2i/D) in fp32 within 2 ulps, its reciprocal and the product with the position rounded
    once each (5u relative on the angle, so 5u * position absolute, the frequency being <= 1), and
    cos or sin of that fp32 angle within 2 ulps of its value (2u absolute, |cos| <= 1)."""
    return 5 * U32 * position + 2 * U32


def clear_choices(ref: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """(R,) bool: the rows of logits `ref` (R, V) whose best token leads every other by more than
    the two logits' bounds (R, V) together: there, another computation whose logits each lie within
    their bound of ref's makes the same greedy choice (each may move by its bound, in opposite
    directions)."""
    best = ref.argmax(-1, keepdim=True)
    lead = ref.gather(-1, best).double() - ref.double()
    room = bound.gather(-1, best) + bound
    return ((lead > room) | (torch.arange(ref.shape[-1]) == best)).all(-1)
