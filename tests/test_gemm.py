"""core/model/linear.py: every weight format computes x W^T, and a row's result never depends on the batch
(bit for bit, one and two threads), on the engine's own kernels, oneDNN's prepacked product or
PyTorch's plain one; the Q4_1 and Q8_0 packings stand for the same weights."""

import pytest
import torch

from bounds import INT8_MAX, INT16_MAX, U_BF16, format_roundings, fp32_dot_bound, rounded_to
from kernel_paths import NATIVE, PATHS, cpu_flags, kernel_path, use_path  # noqa: F401 (kernel_path: a fixture)
from core.config import WeightFormat
from core.errors import InvalidParameter
from core.model.linear import (PREPACKED_MIN_ROWS, PackedLinear, PackedQ8_0, Product, dequantize_q4_1, f32_kernel, linear_q4,
                       pack_q4_1, pack_q4_1_native, pack_q8_0_native, pad_rows, prepacking_available, products_here, q4_kernel,
                       q4_kernel_isa, quantize_q4_1, quantize_q8_0)


# oneDNN packs bfloat16 weights only where the CPU converts to bfloat16 natively
BF16_PACKS = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
NO_BF16_PACKING = pytest.mark.skipif(not BF16_PACKS, reason="oneDNN packs no bfloat16 weights on this CPU")
NO_Q4_KERNEL = pytest.mark.skipif(not q4_kernel_isa(), reason="the Q4_1 kernel needs AVX-512 VNNI or AVX2")
NO_F32_KERNEL = pytest.mark.skipif(f32_kernel() is None, reason="the fp32 kernel needs AVX2 and FMA")
NO_Q8_KERNEL = pytest.mark.skipif(not (q4_kernel() and q4_kernel().q8_matmul_available()),
                                  reason="the Q8_0 kernel needs AVX2")

OWN, ONEDNN, PLAIN = Product.OWN, Product.ONEDNN, Product.PLAIN


def own(fmt: str, mark) -> list:
    """The engine's kernel for `fmt` on each kernel path this CPU offers (kernel_paths.PATHS)."""
    return [pytest.param(fmt, OWN, path, marks=mark, id=f"{fmt}-own-{path}") for path in PATHS]


# (format, product, kernel path): every product each format can take, the engine's on every path
PRODUCTS = (own("fp32", NO_F32_KERNEL) + [("fp32", ONEDNN, NATIVE), ("fp32", PLAIN, NATIVE)]
            + own("bf16", NO_F32_KERNEL) + [pytest.param("bf16", ONEDNN, NATIVE, marks=NO_BF16_PACKING),
                                           ("bf16", PLAIN, NATIVE)]
            + own("q4_1", NO_Q4_KERNEL) + [("q4_1", PLAIN, NATIVE)]
            + own("q8_0", NO_Q8_KERNEL) + [("q8_0", PLAIN, NATIVE)])


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_pad_rows_appends_zero_rows_to_whole_panels():
    x = torch.ones(5, 3)
    assert pad_rows(x, 4).shape == (8, 3) and torch.equal(pad_rows(x, 4)[5:], torch.zeros(3, 3))
    assert pad_rows(x[:4], 4) is not None and pad_rows(x[:4], 4).shape == (4, 3)
    assert pad_rows(x[:1], 2).shape == (2, 3)


def test_prepacking_is_available_here():
    """The CPU build of PyTorch that the set-up installs has oneDNN: a silent fallback to the
    plain products would hide a slower engine. bf16 packs where the CPU has the instructions."""
    assert prepacking_available()
    assert prepacking_available(torch.bfloat16) == BF16_PACKS
    assert BF16_PACKS == ("avx512bw" in cpu_flags() or "avx_ne_convert" in cpu_flags())


def test_each_format_takes_the_fastest_product_here():
    """fp32 on the engine's kernel where the CPU has AVX2 and FMA, then oneDNN's; bf16 on oneDNN's
    where it packs bfloat16 (AVX512-BF16 dot products), else the engine's kernel."""
    own = {"avx2", "fma"} <= cpu_flags()
    assert (f32_kernel() is not None) == own
    assert products_here("fp32", 64) == ([OWN] if own else []) + [ONEDNN, PLAIN]
    assert products_here("bf16", 64) == ([ONEDNN] if BF16_PACKS else []) + ([OWN] if own else []) + [PLAIN]
    assert products_here("fp32", 40)[0] is ONEDNN          # not whole 16-column panels
    assert PackedLinear("fp32", torch.ones(16, 8)).product is products_here("fp32", 16)[0]
    with pytest.raises(InvalidParameter, match="product"):
        PackedLinear("q4_1", torch.ones(16, 32), product=ONEDNN)


def test_q8_0_takes_the_q8_0_kernel_or_the_int4_halves():
    """The 8-bit format: the engine's Q8_0 kernel where it runs (AVX2, whole 16-column panels), a byte
    a weight plus an fp16 scale per 32; else the two 4-bit halves on PyTorch's int4 kernel."""
    kernel = bool(q4_kernel() and q4_kernel().q8_matmul_available())
    assert products_here("q8_0", 64) == ([OWN] if kernel else []) + [PLAIN]
    assert products_here("q8_0", 40) == [PLAIN]
    layer = PackedLinear("q8_0", torch.randn(96, 64))
    assert layer.product is (OWN if kernel else PLAIN) and layer.min_rows == 1
    if kernel:
        assert layer.nbytes == 96 * 64 + 96 * 2 * 2
    assert len(PackedLinear("q8_0", torch.randn(96, 64), product=PLAIN).tensors) == 4
    with pytest.raises(InvalidParameter, match="product"):
        PackedLinear("q8_0", torch.ones(16, 32), product=ONEDNN)


def test_the_q4_1_kernel_is_built_for_this_cpu():
    """q4_1 runs the engine's own kernel, for the best instruction set this CPU has."""
    flags = cpu_flags()
    expected = ("avx512vnni" if {"avx512_vnni", "avx512bw"} <= flags else
                "avx2" if {"avx2", "fma", "f16c"} <= flags else "")
    assert q4_kernel_isa() == expected
    assert (q4_kernel() is not None) == bool(expected)
    assert (PackedLinear("q4_1", torch.ones(16, 32)).product is OWN) == bool(expected)


def format_operands(fmt: str, product: Product, x: torch.Tensor, w: torch.Tensor):
    """(activations, weights, |weights| for the rounding bound, output unit roundoff, extra) that a
    format's product multiplies, in float64: fp32 as they are; bf16 both rounded to bfloat16 and the result too; q4_1 the Q4_1 weights
    d*q + m (exact in float64) with the activations as each kernel rounds them: to 8-bit integers
    per group of 32 (the engine's kernel, AVX-512 VNNI or AVX2: at most max|group| / 254 off each,
    so at most that times |w| per term: `extra`, (N, M)), or to bfloat16 (PyTorch's int4 kernel,
    whose scale d and zero m + 8d are bfloat16 and whose result is bfloat16; its dequantized
    weight is taken as rounded to bfloat16 too, one more u_bf16 * |x||w| below, whether or not it is).
    The Q4_1 kernels sum x*q per group, then scale by d and add m * sum(x): their fp32 roundings
    are bounded with |d*q| + |m| in place of |w| (m can cancel d*q in w, not in the roundings)."""
    if fmt == "fp32":
        return x.double(), w.double(), w.double(), 0.0, 0.0
    if fmt == "bf16":
        return rounded_to(x, torch.bfloat16), rounded_to(w, torch.bfloat16), rounded_to(w, torch.bfloat16), U_BF16, 0.0
    if fmt == "q8_0":
        return q8_0_operands(product, x, w)
    q, d, m = quantize_q4_1(w)
    groups = lambda t: t.double().repeat_interleave(32, 1)
    if product is OWN:
        wq, wabs = q.double() * groups(d) + groups(m), q.double() * groups(d) + groups(m).abs()
        step = (x.reshape(x.shape[0], -1, 32).abs().amax(-1) / (2 * INT8_MAX)).repeat_interleave(32, 1).double()
        return x.double(), wq, wabs, 0.0, step @ wq.abs().T
    scale, zero = d.to(torch.bfloat16).double(), (m + 8 * d).to(torch.bfloat16).double()
    wq, wabs = (q.double() - 8) * groups(scale) + groups(zero), (q.double() - 8).abs() * groups(scale) + groups(zero).abs()
    xs = rounded_to(x, torch.bfloat16)
    return xs, wq, wabs, U_BF16, U_BF16 * (xs.abs() @ wq.abs().T)


def q8_0_top() -> int:
    """The largest integer the Q8_0 kernel rounds activations to on the kernel path in use:
    127 with AVX-512 VNNI (8 bits), 32767 with AVX2 (16 bits): csrc/q8_matmul.cpp."""
    return INT8_MAX if q4_kernel_isa() == "avx512vnni" else INT16_MAX


def q8_0_operands(product: Product, x: torch.Tensor, w: torch.Tensor):
    """format_operands for q8_0: the Q8_0 weights d*q (exact in float64). The engine's kernel rounds
    the activations per group of 32 to 8-bit integers (AVX-512 VNNI) or 16-bit integers (AVX2):
    at most max|group| / (2 * top) off each (q8_0_top; `extra`), and sums exactly per group, then in fp32. The fallback splits q = 16*hi + lo (hi = q >> 4, lo = q & 15) into two
    PyTorch int4 products, whose scales bf16(16d) and bf16(d) make the weights it stands for
    (q >> 4) * bf16(16d) + (q & 15) * bf16(d), and rounds the activations, each half's result and
    their sum to bfloat16: each half's rounding (u_bf16 * |half|) and the dequantized weights'
    (u_bf16 * |x||w|, as q4_1's) go in `extra`, the sum's is the output rounding."""
    q, d = quantize_q8_0(w)
    groups = lambda t: t.double().repeat_interleave(32, 1)
    if product is OWN:
        wq = q.double() * groups(d)
        step = (x.reshape(x.shape[0], -1, 32).abs().amax(-1) / (2 * q8_0_top())).repeat_interleave(32, 1).double()
        return x.double(), wq, wq, 0.0, step @ wq.abs().T
    qi = q.to(torch.int32)
    hi = (qi >> 4).double() * groups(rounded_to(16 * d, torch.bfloat16))
    lo = (qi & 15).double() * groups(rounded_to(d, torch.bfloat16))
    xs = rounded_to(x, torch.bfloat16)
    wabs = hi.abs() + lo.abs()
    extra = U_BF16 * (xs.abs() @ wabs.T) + U_BF16 * ((xs @ hi.T).abs() + (xs @ lo.T).abs())
    return xs, hi + lo, wabs, U_BF16, extra


@pytest.mark.parametrize("fmt,product,path", PRODUCTS)
def test_every_format_computes_x_wt(fmt, product, path, monkeypatch):
    use_path(path, monkeypatch)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) / 8
    x = torch.randn(7, 64, generator=g)
    layer = PackedLinear(fmt, w, product=product)
    y = layer(x)
    assert y.shape == (7, 96) and layer.product is product
    assert y.dtype == (torch.float32 if fmt == "fp32" or (fmt in ("q4_1", "q8_0") and product is OWN) else torch.bfloat16)
    # Derived bound (tests/bounds.py): the product computes xs @ ws.T, the activations and weights
    # as the format holds them, summed in fp32 in any order (gamma_n * |xs| @ |ws|.T, Higham 3.5),
    # the result rounded to its dtype once (u_out * |result|). The gap between xs @ ws.T and
    # x @ w.T is the format's own rounding, computed exactly from these tensors.
    xs, ws, wabs, u_out, extra = format_operands(fmt, product, x, w)
    exact, stands_for = x.double() @ w.double().T, xs @ ws.T
    summed = fp32_dot_bound(xs, wabs, extra_roundings=2) + extra   # |fp32 sum - xs @ ws.T|, at most
    arith = summed + u_out * (stands_for.abs() + summed)     # then one rounding to the output dtype
    assert ((y.double() - exact).abs() <= (stands_for - exact).abs() + arith).all()


@pytest.mark.parametrize("fmt,product,path", PRODUCTS)
@pytest.mark.parametrize("shape", [(576, 960), (576, 3072), (1536, 576), (64, 192), (128, 64), (64, 272)])
def test_rows_are_batch_invariant_in_every_format(threads, fmt, product, path, shape, monkeypatch):
    """SmolLM2's and the tiny model's shapes, and 17 panels of 16 outputs (one row takes four
    panels at a time in the engine's fp32 kernel, two rows two, the last on its own; more rows
    tiles of up to five); for one row oneDNN's prepacked product takes another kernel at an input
    of 1,536 (hence PREPACKED_MIN_ROWS)."""
    use_path(path, monkeypatch)
    cols, out = shape
    g = torch.Generator().manual_seed(1)
    layer = PackedLinear(fmt, torch.randn(out, cols, generator=g) / cols ** 0.5, product=product)
    x = torch.randn(70, cols, generator=g)
    full = layer(x)
    for n in range(1, 70):
        assert torch.equal(layer(x[:n]), full[:n]), f"{n} rows"
        assert torch.equal(layer(x[n - 1:n].clone())[0], full[n - 1]), f"row {n - 1} alone"


def test_packed_weights_keep_their_size_and_pad_only_for_oneDNN():
    w = torch.randn(96, 64)
    for fmt, size in [("fp32", 4)] + ([("bf16", 2)] if BF16_PACKS else []):
        layer = PackedLinear(fmt, w, product=ONEDNN)
        assert layer.nbytes == 96 * 64 * size and layer.min_rows == PREPACKED_MIN_ROWS
    assert PackedLinear("fp32", w, product=PLAIN).min_rows == 4
    assert PackedLinear("fp32", w, product=PLAIN).tensors[0] is w     # plain fp32: no copy


@NO_F32_KERNEL
@pytest.mark.parametrize("fmt,size", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("rows,cols", [(3, 48), (7, 300)])
def test_the_fp32_kernel_sums_each_output_in_one_fma_chain(fmt, size, rows, cols, kernel_path):
    """f32_matmul: y[i][j] = fma(x[k], w[k], ...) over k in order from 0, in fp32 (the bf16 weights
    widened exactly; bf16 rounds the activations and the result to bfloat16). Checked against
    that chain computed in float64 with a rounding to fp32 after every multiply-add (a fused
    multiply-add rounds once, and a float64 product of two fp32 values is exact). 300 columns
    cross the many-row tiles' slices of k (SLICE_K = 128) twice and end in a partial one; 7 rows
    are a tile of 5 and one of 2."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(32, cols, generator=g)
    x = torch.randn(rows, cols, generator=g)
    layer = PackedLinear(fmt, w, product=OWN)
    assert layer.nbytes == 32 * cols * size and layer.min_rows == 1
    xs = x.to(layer.dtype).double()
    ws = w.to(layer.dtype).double()
    acc = torch.zeros(rows, 32, dtype=torch.float64)
    for k in range(cols):
        acc = (acc + xs[:, k:k + 1] * ws[:, k]).float().double()
    assert torch.equal(layer(x), acc.float().to(layer(x).dtype))
    with pytest.raises(RuntimeError, match=f"packed for {cols}"):
        layer.f32.f32_matmul(torch.randn(2, 64), *layer.tensors)


def test_q4_1_round_trips_its_own_dequantized_weights():
    """Re-quantizing a Q4_1 matrix finds the same blocks: the engine packs the GGUF file's own
    4-bit weights from their fp32 form (checked on SmolLM2 in test_parity.py)."""
    g = torch.Generator().manual_seed(2)
    q, d, m = quantize_q4_1(torch.randn(40, 128, generator=g))
    w = dequantize_q4_1(q, d, m)
    q2, d2, m2 = quantize_q4_1(w)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)
    assert int(q.max()) == 15 and int(q.min()) == 0


def test_q4_1_refuses_rows_that_are_not_whole_groups():
    from core.errors import InvalidParameter
    with pytest.raises(InvalidParameter) as err:
        PackedLinear("q4_1", torch.ones(8, 40))
    assert err.value.param == "weight_format"


def test_packed_q4_1_multiplies_by_the_dequantized_weights():
    g = torch.Generator().manual_seed(3)
    q, d, m = quantize_q4_1(torch.randn(64, 96, generator=g))
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    # the kernel's scale and zero are bfloat16: compare with the weights they stand for
    packed, sz = pack_q4_1(q, d, m)
    scale, zero = sz[..., 0].float().t(), sz[..., 1].float().t()          # (out, in/32)
    w = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    y = linear_q4(x, packed, sz).double()
    ref = x.double() @ w.double().T
    # the result rounded to bfloat16 (u_bf16 |y|), fp32 sums (gamma_n), and the dequantized weight
    # rounded to bfloat16 inside the kernel if it is (u_bf16 |x||w|): tests/bounds.py
    sums = fp32_dot_bound(x, w.abs() + U_BF16 * w.abs(), extra_roundings=2) + U_BF16 * (x.double().abs() @ w.double().abs().T)
    assert ((y - ref).abs() <= sums + U_BF16 * (ref.abs() + sums)).all()
    assert (w - dequantize_q4_1(q, d, m)).abs().max().item() < 0.02 * float(d.max()) * 16


@NO_Q4_KERNEL
def test_the_q4_1_kernel_computes_the_q4_1_weights(kernel_path):
    """q4_matmul: the activations times w = d*q + m (q exact, d and m fp16 as in the GGUF file), to
    fp32 rounding, with the activations rounded as the kernel rounds them: to 8-bit integers per
    group of 32, at most 1/254 of the group's largest off (AVX-512 VNNI and AVX2 alike)."""
    g = torch.Generator().manual_seed(3)
    q, d, m = quantize_q4_1(torch.randn(64, 96, generator=g))
    x = torch.randn(5, 96, generator=g)
    layer = PackedLinear("q4_1", torch.empty(64, 96), q4_blocks=(q, d, m), product=OWN)
    assert layer.nbytes == 64 * 96 // 2 + 64 * 96 // 32 * 2 * 2
    groups = lambda t: t.double().repeat_interleave(32, 1)
    w = q.double() * groups(d) + groups(m)                       # exact: d*q has 15 bits, then one add in float64
    # fp32 roundings of the per-group sums, the scale by d and the add of m * sum(x): gamma_{n+2}
    # with |d*q| + |m| per weight (tests/bounds.py), whatever order or vector width sums them
    wabs = q.double() * groups(d) + groups(m).abs()
    ref = x.double() @ w.T
    bound = (x.reshape(5, 3, 32).abs().amax(-1) / (2 * INT8_MAX)).repeat_interleave(32, 1).double() @ w.abs().T
    assert ((layer(x).double() - ref).abs() <= bound + fp32_dot_bound(x, wabs, extra_roundings=2)).all()
    assert (layer(x).double() - ref).abs().max().item() > 0      # rounded, not exact
    # and exactly llama.cpp's arithmetic: per group, the exact integer sum of the rounded
    # activations times q, then (d * s) * S + y and (s * sum of xi) * m + that, in fp32
    xg = x.reshape(5, 3, 32)
    s = xg.abs().amax(-1) / INT8_MAX                                             # (5, 3) fp32
    xi = torch.round(xg * (INT8_MAX / xg.abs().amax(-1, keepdim=True))).clamp(-INT8_MAX, INT8_MAX)
    S = torch.einsum("rgk,ngk->rng", xi.double(), q.reshape(64, 3, 32).double())  # exact integers
    x_sum = (s * xi.sum(-1)).float()                                             # (5, 3)
    dh, mh = d.half().float(), m.half().float()                                  # (64, 3)
    y = torch.zeros(5, 64)
    for g in range(3):
        acc = ((dh[:, g] * s[:, g:g + 1]).double() * S[:, :, g] + y.double()).float()         # one FMA
        y = (mh[:, g].double() * x_sum[:, g:g + 1].double() + acc.double()).float()          # one FMA
    assert torch.equal(layer(x), y)


@NO_Q4_KERNEL
def test_the_q4_1_kernel_rounds_activations_to_nearest_even(kernel_path):
    """The activations' rounding (int8_rows.h's round_group, vectorized per instruction set) on
    halves, near-halves and the clamp: with a group's largest |x| 127 the scale is 1, and weights
    d = 1, m = 0, q = 1 at column j's own k read each rounded integer back exactly."""
    x = torch.tensor([[127.0, 2.5, -2.5, 3.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5, 1.4999999, -0.50000006,
                       64.5, -64.5, 0.0, -0.0] + [float(v) + 0.5 for v in range(-8, 8)]])
    q = torch.eye(32, dtype=torch.uint8)
    d, m = torch.ones(32, 1), torch.zeros(32, 1)
    layer = PackedLinear("q4_1", torch.empty(32, 32), q4_blocks=(q, d, m), product=OWN)
    assert torch.equal(layer(x), torch.round(x).clamp(-INT8_MAX, INT8_MAX))   # torch.round: ties to even


def test_each_q4_1_layout_puts_every_q_where_its_kernel_reads_it():
    """pack_q4_1_native, read back by the rule its docstring states (one layout for both instruction
    sets): every q at its place, once."""
    g = torch.Generator().manual_seed(5)
    N, K = 32, 64
    q = torch.randint(0, 16, (N, K), generator=g)
    d, m = torch.rand(N, K // 32, generator=g), torch.rand(N, K // 32, generator=g)
    n = torch.arange(N)[:, None].expand(N, K)
    k = torch.arange(K)[None, :].expand(N, K)
    panel, col = n // 16, n % 16
    for isa in ("avx2", "avx512vnni"):
        nibbles, dm = pack_q4_1_native(q, d, m, isa=isa)
        assert nibbles.shape == (N // 16, K // 4, 32) and nibbles.dtype == torch.uint8
        flat = nibbles.view(N // 16, -1).long()
        # octet k // 8, byte 4 * col + k % 4, the high nibble for k % 8 >= 4
        byte = (k // 8) * 64 + 4 * col + k % 4
        shift = 4 * ((k % 8) // 4)
        assert torch.equal((flat[panel, byte] >> shift) & 15, q), isa
        assert len(set((panel * 10**6 + byte * 8 + shift).flatten().tolist())) == N * K   # no place twice
        assert torch.equal(dm[panel, k // 32, 0, col].float(), d.half().float()[n, k // 32])
        assert torch.equal(dm[panel, k // 32, 1, col].float(), m.half().float()[n, k // 32])
    with pytest.raises(InvalidParameter, match="isa"):
        pack_q4_1_native(q, d, m, isa="neon")


@NO_Q4_KERNEL
def test_the_q4_1_kernel_checks_its_inputs():
    layer = PackedLinear("q4_1", torch.randn(32, 64), product=OWN)
    with pytest.raises(RuntimeError, match="packed for 64"):
        layer.q4.q4_matmul(torch.randn(2, 96), *layer.tensors)


def test_q8_0_round_trips_its_own_dequantized_weights():
    """Re-quantizing a Q8_0 matrix finds the same blocks: the engine packs the GGUF file's 8-bit
    embedding from its fp32 form."""
    g = torch.Generator().manual_seed(4)
    q, d = quantize_q8_0(torch.randn(48, 128, generator=g))
    w = q.float() * d.repeat_interleave(32, 1)
    q2, d2 = quantize_q8_0(w)
    assert torch.equal(q2, q) and torch.equal(d2, d)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127


def test_the_q8_0_kernel_is_built_where_the_q4_1_kernel_uses_avx2():
    flags = cpu_flags()
    assert PackedQ8_0(torch.ones(32, 64)).prepacked == ({"avx2", "fma", "f16c"} <= flags)


@pytest.mark.parametrize("product", [pytest.param(OWN, marks=NO_Q8_KERNEL), PLAIN])
def test_q8_0_multiplies_by_the_dequantized_weights(product, kernel_path):
    """The kernel: the activations, rounded per group of 32 to 8-bit (AVX-512 VNNI) or 16-bit
    integers (AVX2), at most half a step (q8_0_top) off, times w = d*q, to fp32 rounding. The fallback (two 4-bit products,
    16d*hi + d*lo, PyTorch's int4 kernel) rounds the activations and its output to bfloat16."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(256, 96, generator=g)
    head = PackedQ8_0(weight, product=product)
    assert head.prepacked == (product is OWN)
    q, d = quantize_q8_0(weight)
    w = (q.float() * d.repeat_interleave(32, 1)).double()
    x = torch.randn(5, 96, generator=g)
    y = head(x).double()
    ref = x.double() @ w.T
    if head.prepacked:
        assert head.nbytes == 256 * 96 + 256 * 3 * 2
        bound = (x.reshape(5, 3, 32).abs().amax(-1) / (2 * q8_0_top())).repeat_interleave(32, 1).double() @ w.abs().T
        # plus the fp32 roundings of the group sums and their scaling by d (tests/bounds.py)
        assert ((y - ref).abs() <= bound + fp32_dot_bound(x, w, extra_roundings=2)).all()
        assert (y - ref).abs().max().item() > 0                         # rounded, not exact
    else:
        assert (y - ref).abs().max().item() < 0.02 * ref.abs().max().item()


@pytest.mark.parametrize("product", [pytest.param(OWN, marks=NO_Q8_KERNEL), PLAIN])
@pytest.mark.parametrize("shape", [(576, 49152 // 16), (64, 272)])
def test_q8_0_rows_are_batch_invariant(threads, product, shape, kernel_path):
    """SmolLM2's head's input size (with a sixteenth of its outputs) and 17 panels of 16 outputs,
    a panel at a time, for one row as for tiles of several (up to four with AVX2, eight with VNNI)."""
    cols, out = shape
    g = torch.Generator().manual_seed(5)
    head = PackedQ8_0(torch.randn(out, cols, generator=g) / cols ** 0.5, product=product)
    x = torch.randn(70, cols, generator=g)
    full = head(x)
    for n in range(1, 70):
        assert torch.equal(head(x[:n]), full[:n]), f"{n} rows"
        assert torch.equal(head(x[n - 1:n].clone())[0], full[n - 1]), f"row {n - 1} alone"


def test_each_q8_0_layout_puts_every_q_where_its_kernel_reads_it():
    """pack_q8_0_native, read back by the rule its docstring states for each instruction set: every
    q at its place, once (the VNNI one offset by 128, an unsigned byte)."""
    g = torch.Generator().manual_seed(7)
    N, K = 32, 64
    q = torch.randint(-127, 128, (N, K), generator=g).to(torch.int8)
    d = torch.rand(N, K // 32, generator=g)
    n = torch.arange(N)[:, None].expand(N, K)
    k = torch.arange(K)[None, :].expand(N, K)
    panel, col = n // 16, n % 16
    for isa in ("avx2", "avx512vnni"):
        qp, dp = pack_q8_0_native(q, d, isa=isa)
        assert qp.shape == (N // 16, K // 2, 32) and qp.dtype == torch.int8
        flat = qp.view(N // 16, -1)
        if isa == "avx2":    # unit k // 2, byte 2 * col + k % 2
            byte, got = (k // 2) * 32 + 2 * col + k % 2, flat.long()
        else:                # quad k // 4, byte 4 * col + k % 4, as q + 128 unsigned
            byte, got = (k // 4) * 64 + 4 * col + k % 4, flat.view(torch.uint8).long() - 128
        assert torch.equal(got[panel, byte], q.long()), isa
        assert len(set((panel * 10**6 + byte).flatten().tolist())) == N * K
        assert torch.equal(dp[panel, k // 32, col].float(), d.half().float()[n, k // 32])
    with pytest.raises(InvalidParameter, match="isa"):
        pack_q8_0_native(q, d, isa="neon")


@NO_Q8_KERNEL
def test_the_q8_0_kernel_checks_its_inputs():
    head = PackedQ8_0(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="packed for 64"):
        head.q8.q8_matmul(torch.randn(2, 96), *head.tensors)


def test_q8_0_takes_its_own_kernel_or_the_plain_halves_only():
    with pytest.raises(InvalidParameter, match="product"):
        PackedQ8_0(torch.ones(32, 64), product="onednn")
    assert not PackedQ8_0(torch.ones(32, 64), product="plain").prepacked


@pytest.mark.parametrize("fmt,product,path", PRODUCTS)
def test_a_product_says_how_it_rounds_its_activations(fmt, product, path, monkeypatch):
    """activation_rounding (what the pages say beside a format) is what the bounds here take the
    product to do: the 8-bit or 16-bit step of q8_0_top for the engine's Q8_0 kernel, 8-bit
    integers for its Q4_1 kernel on either instruction set, bf16 for PyTorch's int4 kernel and bf16
    weights, nothing for fp32 (bounds.format_roundings, whose x_kind the redraws use)."""
    use_path(path, monkeypatch)
    layer = PackedLinear(fmt, torch.randn(96, 64) / 8, product=product)
    if fmt == "fp32":
        want = "none"
    elif fmt == "q8_0":
        want = {INT8_MAX: "int8", INT16_MAX: "int16"}[q8_0_top()] if product is OWN else "bf16"
    else:
        want = format_roundings(fmt, q4_kernel_isa() if product is OWN else "")[1]
    assert layer.activation_rounding == want
