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

Nothing here reads a measured number: every bound is computed from the tensors of the test.
"""

import math

import torch

U32 = 2.0 ** -24        # fp32 unit roundoff: |fl(x) - x| <= u |x| for round-to-nearest
U_BF16 = 2.0 ** -8      # bfloat16 unit roundoff (8 significant bits)

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
SILU_ROUNDINGS = 8   # silu(g) = g / (1 + exp(-g)) in fp32: exp within 2 ulps (Cephes' expf, libm), 3 more ops; doubled


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n successive roundings
    (a sum or dot product of n terms, any order, with or without FMA). Needs n u < 1."""
    if n * u >= 1:
        raise ValueError(f"gamma: n * u = {n * u} >= 1, no bound")
    return n * u / (1 - n * u)


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


def llama_f64(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The last block's residual stream (T, C) and the logits (T, V) of core.model.model.Transformer's function on one sequence, in float64: the same
    fp32 weights and the same constants (its RoPE tables, as fp32 values), with every operation in
    float64 (unit roundoff 2^-53, so within ~1e-12 relative of exact for this depth). A reference
    for fp32 computations of the same model, written out here so it shares no code with core/."""
    cfg = model.config
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    T, H, Hkv, D = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = torch.arange(T)
    cos, sin = model.rotary.cos[pos].double()[:, None], model.rotary.sin[pos].double()[:, None]   # (T, 1, D)

    def norm(x, w):   # RMSNorm
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rotate(x):    # rotate half, with the model's tables: sin holds (-sin, sin)
        half = D // 2
        return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin

    x = sd["embed_tokens.weight"][torch.tensor(ids)]                     # (T, C)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        qkv = norm(x, sd[p + "attn_norm.weight"]) @ sd[p + "attn.qkv_proj.weight"].T
        q = rotate(qkv[:, :H * D].view(T, H, D))
        k = rotate(qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D))
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # (T, H, D): query head h reads KV h // group
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)   # (H, T, T)
        y = torch.einsum("hqk,khd->qhd", probs, v).reshape(T, H * D)
        x = x + y @ sd[p + "attn.o_proj.weight"].T
        gate, up = (norm(x, sd[p + "mlp_norm.weight"]) @ sd[p + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
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


def attention_f32_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |fl32(causal attention) - exact| for q (T, H, D), k, v (T, Hkv, D),
    query head h reading KV head h // (H / Hkv), scores scaled by 1/sqrt(D): (T, H, D) float64.
    Scores: err_s <= gamma_{D+1} |q||k| / sqrt(D) (the dot product and the scale). Softmax: a
    score error moves p_j by at most p_j (|err_s_j| + sum_i p_i |err_s_i|) <= 2 p_j max_i err_s_i,
    and its own roundings (max, exp, sum of T, divide) by (gamma_T + 6u) p_j. Output: sum_j p_j v_j,
    whose roundings add gamma_T sum_j p_j |v_j|. Any order of the sums (SDPA, the engine's kernel,
    AVX2 or AVX-512). To first order; doubled for the rest."""
    T, H, D = q.shape
    group = H // k.shape[1]
    qd = q.double()
    kd, vd = (t.double().repeat_interleave(group, dim=1) for t in (k, v))   # (T, H, D)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = torch.einsum("qhd,khd->hqk", qd, kd) / math.sqrt(D)
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)                 # (H, T, T)
    err_s = gamma(D + 1) * torch.einsum("qhd,khd->hqk", qd.abs(), kd.abs()) / math.sqrt(D)
    worst = err_s.masked_fill(~mask, 0).amax(-1, keepdim=True)              # (H, T, 1)
    rel_p = 2 * worst + gamma(T) + 6 * U32                                   # (H, T, 1)
    pv = torch.einsum("hqk,khd->qhd", p, vd.abs())                           # sum_j p_j |v_j|
    return 2 * (rel_p.permute(1, 0, 2) * pv + gamma(T) * pv)


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
