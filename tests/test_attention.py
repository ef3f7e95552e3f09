"""attention.py: the batch-invariant linear, grouped-query attention, the paged KV cache, and the
property the engine rests on: a sequence's logits are bit-identical whatever else is in the
step (other sequences of other lengths, decodes beside prefill chunks, a prompt cut in chunks).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from bounds import attention_bf16_bound, attention_f32_bound, fp32_dot_bound, gamma, softmax_sum_bound
from kernel_paths import kernel_path  # noqa: F401 (a fixture: every kernel path this CPU offers)
from core import SamplingParams
from core.model.attention import MIN_KEYS, PagedBatch, attend, build_group, causal_attention, min_query_rows, paged_attention
from core.model.kv_cache import KVCache
from core.model.linear import MIN_GEMM_ROWS, linear


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Run under a given number of torch threads (MKL splits rows differently), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# -- linear ------------------------------------------------------------------------------------

def test_linear_computes_x_wt():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g)
    for n in (1, 3, 4, 7, 33):
        x = torch.randn(n, 32, generator=g)
        y = linear(x, w)
        assert y.shape == (n, 48)
        assert ((y.double() - x.double() @ w.double().T).abs() <= fp32_dot_bound(x, w)).all()   # gamma_n (tests/bounds.py)


@pytest.mark.parametrize("shape", [(64, 192), (576, 1728), (1536, 576)])
def test_linear_rows_are_batch_invariant(threads, shape):
    cols, out = shape
    g = torch.Generator().manual_seed(1)
    w = torch.randn(out, cols, generator=g)
    x = torch.randn(70, cols, generator=g)
    full = linear(x, w)
    for n in range(1, 70):
        assert torch.equal(linear(x[:n], w), full[:n]), f"{n} rows"
        assert torch.equal(linear(x[n - 1:n], w)[0], full[n - 1]), f"row {n - 1} alone"


def test_min_query_rows_fills_whole_panels():
    for heads, kv_heads in [(9, 3), (4, 2), (8, 8), (8, 1), (12, 4), (6, 2), (32, 8)]:
        rows = min_query_rows(heads, kv_heads)
        group = heads // kv_heads
        assert rows >= 1
        assert (group * rows) % MIN_GEMM_ROWS == 0


def test_build_group_pads_queries_and_masks_causally():
    bs = 4
    # sequence 0: 3 new tokens at positions 5..7 (packed at 0..2); sequence 1: 1 token at 2 (packed 3)
    group = build_group([(0, 3, 5, [7, 2]), (3, 1, 2, [4])], bs, min_rows=4)
    assert group.token_index.shape == (2, 4)
    assert group.query_mask.tolist() == [[True, True, True, False], [True, False, False, False]]
    assert group.token_index[0, :3].tolist() == [0, 1, 2] and group.token_index[1, 0] == 3
    K = group.mask.shape[-1]
    assert K >= MIN_KEYS and K % bs == 0                  # at least MIN_KEYS key slots
    assert group.block_tables.shape == (2, K // bs)
    assert group.block_tables[:, :2].tolist() == [[7, 2], [4, 0]]
    assert torch.all(group.block_tables[:, 2:] == 0)     # padding points at block 0 ...
    assert group.mask[0, 0].tolist() == [k <= 5 for k in range(K)]
    assert group.mask[0, 2].tolist() == [k <= 7 for k in range(K)]
    assert group.mask[1, 0].tolist() == [k <= 2 for k in range(K)]   # ... and is never attended
    wide = build_group([(0, 1, 40, list(range(11)))], bs, min_rows=2)
    assert wide.block_tables.shape == (1, 11) and wide.token_index.shape == (1, 2)


# -- attention ---------------------------------------------------------------------------------

def reference_attention(q, k, v):
    """torch's scaled_dot_product_attention with K and V repeated per query group."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    y = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return y.transpose(0, 1)


def test_causal_attention_matches_sdpa():
    g = torch.Generator().manual_seed(2)
    T, H, Hkv, D = 11, 6, 2, 16
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    y, weights = causal_attention(q, k, v)
    assert y.shape == (T, H, D) and weights.shape == (H, T, T)
    # both within attention_f32_bound of the exact attention (tests/bounds.py), so within twice it of each other
    assert ((y.double() - reference_attention(q, k, v).double()).abs() <= 2 * attention_f32_bound(q, k, v)).all()
    assert ((weights.sum(-1).double() - 1).abs() <= softmax_sum_bound(T)).all()
    assert torch.all(weights.triu(diagonal=1) == 0)
    # head h reads KV head h // (H // Hkv): its first row attends only to token 0, weight 1
    assert torch.all(weights[:, 0, 0] == 1)
    scores = (q[:, 0] @ k[:, 0].T) / math.sqrt(D)
    expected = torch.softmax(scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), -1)
    # the same softmax on scores from another product: each weight within the scores' rounding
    # (2 max err_s relative) and the softmax's own (softmax_sum_bound covers gamma_T + 5u) of exact
    err_s = gamma(D + 1) * (q[:, 0].abs() @ k[:, 0].abs().T).double().max() / math.sqrt(D)
    assert ((weights[0].double() - expected.double()).abs() <= 2 * (2 * err_s + softmax_sum_bound(T))).all()


def test_attend_masks_whole_rows_per_sequence():
    g = torch.Generator().manual_seed(3)
    S, Q, H, Hkv, D, K = 2, 3, 4, 2, 8, 5
    q, k, v = torch.randn(S, Q, H, D, generator=g), torch.randn(S, K, Hkv, D, generator=g), torch.randn(S, K, Hkv, D, generator=g)
    mask = torch.zeros(S, Q, K, dtype=torch.bool)
    mask[:, :, 0] = True                     # every query sees only key 0: y = v[0] of its KV head
    y, probs = attend(q, k, v, mask)
    assert torch.allclose(probs[..., 0], torch.ones(S, H, Q))
    for h in range(H):
        assert torch.allclose(y[:, :, h], v[:, 0, h // (H // Hkv)][:, None].expand(S, Q, D))


def kernel_or_torch(name):
    """The C++ kernel (core/kernels/loader.py builds it; test_native checks that it is built here), or None:
    attention.py's torch path."""
    from core.kernels import loader
    from core.model import native_decoder
    return loader.extension() if name == "kernel" else None


def paged_batch(cache, tables, chunks, kernel):
    """A PagedBatch for chunks [(seq, first position, n)] as ModelRunner.prepare makes it."""
    bs = cache.block_size
    slots, token_seq, positions, groups_in = [], [], [], {"decode": [], "prefill": []}
    t = 0
    for row, (s, start, n) in enumerate(chunks):
        pos = torch.arange(start, start + n)
        slots.append(torch.tensor(tables[s])[pos // bs] * bs + pos % bs)
        token_seq += [row] * n
        positions.append(pos)
        groups_in["decode" if n == 1 else "prefill"].append((t, n, start, tables[s]))
        t += n
    nb = max(len(tables[s]) for s, _, _ in chunks)
    block_tables = torch.tensor([tables[s] + [0] * (nb - len(tables[s])) for s, _, _ in chunks])
    groups = [] if kernel else [build_group(v, bs, 2) for v in groups_in.values() if v]
    return PagedBatch(cache, torch.cat(slots), block_tables, torch.tensor(token_seq), torch.cat(positions),
                      kernel, groups)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("bs", [4, 16])
def test_paged_attention_matches_contiguous_attention(path, bs, kernel_path):
    """Two sequences in scattered blocks, prefilled in chunks and decoded, against plain causal
    attention over each whole sequence."""
    g = torch.Generator().manual_seed(4)
    H, Hkv, D = 4, 2, 16
    cache = KVCache(1, 8, bs, Hkv, D)
    lens = [10, 6] if bs == 4 else [40, 20]
    tables = [[5, 1, 7], [2, 6]]
    qs = [torch.randn(n, H, D, generator=g) for n in lens]
    ks = [torch.randn(n, Hkv, D, generator=g) for n in lens]
    vs = [torch.randn(n, Hkv, D, generator=g) for n in lens]
    outputs = [[], []]

    def step(chunks):  # chunks: (seq, start, n)
        batch = paged_batch(cache, tables, chunks, kernel_or_torch(path))
        q = torch.cat([qs[s][a:a + n] for s, a, n in chunks])
        k = torch.cat([ks[s][a:a + n] for s, a, n in chunks])
        v = torch.cat([vs[s][a:a + n] for s, a, n in chunks])
        y = paged_attention(q, k, v, 0, batch)
        t = 0
        for s, _, n in chunks:
            outputs[s].append(y[t:t + n])
            t += n

    first = 7 if bs == 4 else 30
    step([(0, 0, first), (1, 0, 3)])
    step([(0, first, lens[0] - first - 1), (1, 3, lens[1] - 3)])
    step([(0, lens[0] - 1, 1)])
    for s in range(2):
        got = torch.cat(outputs[s])
        bound = 2 * attention_f32_bound(qs[s], ks[s], vs[s])        # each within it of exact (tests/bounds.py)
        assert ((got.double() - reference_attention(qs[s], ks[s], vs[s]).double()).abs() <= bound).all()
        keys, values = cache.token_major(0)
        assert torch.equal(keys[tables[s]].flatten(0, 1)[: lens[s]], ks[s])  # each token's K and V sit
        assert torch.equal(values[tables[s]].flatten(0, 1)[: lens[s]], vs[s])  # in its sequence's blocks


@pytest.mark.parametrize("bs", [4, 16])
def test_the_kernels_bf16_operands_stay_within_their_bound(bs, kernel_path):
    """The kernel's bf16 mode (q4_1's attention) on two sequences in scattered blocks, prefilled in
    chunks and decoded: within the derived bound (tests/bounds.py) of exact attention on the
    operands rounded to bfloat16, and not the fp32 mode's result (the mode rounds). The bound needs
    no run to set it, on AVX-512 BF16 (VDPBF16PS) and on the fp32 chains other CPUs take alike."""
    kernel = kernel_or_torch("kernel")
    g = torch.Generator().manual_seed(14)
    H, Hkv, D = 9, 3, 64
    lens = [70, 33]
    tables = [[5, 1, 7, 3, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35],
              [2, 6, 4, 8, 10, 12, 14, 16, 18]]
    cache = KVCache(1, 40, bs, Hkv, D)
    qs = [3 * torch.randn(n, H, D, generator=g) for n in lens]
    ks = [torch.randn(n, Hkv, D, generator=g) for n in lens]
    vs = [torch.randn(n, Hkv, D, generator=g) for n in lens]
    outputs, fp32 = [[], []], [[], []]
    for chunks in ([(0, 0, 37), (1, 0, 5)], [(0, 37, 32), (1, 5, 27)], [(0, 69, 1), (1, 32, 1)]):
        q = torch.cat([qs[s][a:a + n] for s, a, n in chunks])
        k = torch.cat([ks[s][a:a + n] for s, a, n in chunks])
        v = torch.cat([vs[s][a:a + n] for s, a, n in chunks])
        batch = paged_batch(cache, tables, chunks, kernel)
        y = paged_attention(q, k, v, 0, batch, bf16=True)
        y32 = paged_attention(q, k, v, 0, batch)
        t = 0
        for s, _, n in chunks:
            outputs[s].append(y[t:t + n])
            fp32[s].append(y32[t:t + n])
            t += n
    for s in range(2):
        got = torch.cat(outputs[s])
        exact, bound = attention_bf16_bound(qs[s], ks[s], vs[s])
        assert ((got.double() - exact).abs() <= bound).all()
        assert not torch.equal(got, torch.cat(fp32[s]))


def test_causal_attention_rounds_the_kernels_bf16_operands():
    """The torch emulation of bf16 operands (Transformer.score, the widgets) is within the same
    derived bound of exact attention on the rounded operands, and rounds (not the fp32 result)."""
    g = torch.Generator().manual_seed(15)
    T, H, Hkv, D = 40, 9, 3, 64
    q, k, v = 3 * torch.randn(T, H, D, generator=g), torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    y, probs = causal_attention(q, k, v, bf16=True)
    exact, bound = attention_bf16_bound(q, k, v)
    assert ((y.double() - exact).abs() <= bound).all()
    assert not torch.equal(y, causal_attention(q, k, v)[0])
    assert torch.allclose(probs.sum(-1), torch.ones(H, T), rtol=0, atol=softmax_sum_bound(T))


def test_the_torch_path_refuses_bf16_operands():
    """bf16 operands are the C++ kernel's: the torch path says so rather than compute fp32."""
    cache = KVCache(1, 4, 16, 1, 16)
    batch = paged_batch(cache, [[0]], [(0, 0, 2)], None)
    with pytest.raises(ValueError, match="bf16"):
        paged_attention(torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), 0, batch, bf16=True)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-pool"])
@pytest.mark.parametrize("heads", [(9, 3), (4, 1)], ids=["GQA", "MQA"])
@pytest.mark.parametrize("bs", [1, 4, 16, 32])
def test_the_kernel_computes_each_row_on_its_own(threads, bs, heads, mode, kernel_path):
    """The C++ kernel's promise (csrc/paged_attention.cpp): a token's output has the same bits
    whatever else is computed with it: its sequence's other queries, other sequences, threads.
    The late decodes run on both threads: one work item per KV head (GQA), or one per query head
    where there are fewer KV heads than threads (MQA). Every mode: fp32 operands, bf16 (whose
    work items are longer runs of tokens, and whose value pairs end at odd keys) on an fp32 pool,
    and bf16 on a bfloat16 pool (kv_cache_dtype bf16), whose slots pair up (an even block size)."""
    if mode == "bf16-pool" and bs % 2:
        pytest.skip("a bfloat16 pool keeps its values in pairs of slots: blocks of an even size")
    kernel = kernel_or_torch("kernel")
    g = torch.Generator().manual_seed(6)
    (H, Hkv), D, n = heads, 64, 300
    bf16 = mode != "fp32"
    cache = KVCache(1, 2 * (-(-n // bs)) + 2, bs, Hkv, D, "bf16" if mode == "bf16-pool" else "fp32")
    tables = [list(range(1, 1 + -(-n // bs))), list(range(1 + -(-n // bs), 1 + 2 * -(-n // bs)))]
    q = torch.randn(2 * n, H, D, generator=g)
    k, v = torch.randn(2 * n, Hkv, D, generator=g), torch.randn(2 * n, Hkv, D, generator=g)
    whole = paged_batch(cache, tables, [(0, 0, n), (1, 0, n)], kernel)
    full = paged_attention(q, k, v, 0, whole, bf16)                     # both sequences in one step
    for t in (0, 1, 15, 16, 17, 40, 150, n - 1):
        for s in (0, 1):
            alone = paged_batch(cache, tables, [(s, t, 1)], kernel)
            row = s * n + t
            y = paged_attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], 0, alone, bf16)
            assert torch.equal(y[0], full[row]), f"token {t} of sequence {s} alone"
        piece = paged_batch(cache, tables, [(1, t, 3), (0, t, 1)] if t + 3 <= n else [(0, t, 1)], kernel)
        rows = [n + t, n + t + 1, n + t + 2, t] if t + 3 <= n else [t]
        y = paged_attention(q[rows], k[rows], v[rows], 0, piece, bf16)
        assert torch.equal(y, full[rows]), f"tokens at {t} in a small step"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_kernel_refuses_blocks_outside_the_pool(threads, bf16):
    """A bad block table is an error that names it, not a read outside the pool, on one thread or
    from inside the parallel region (a long prefill; with bf16 operands, also from the step's
    conversion of a long chunk's keys and values, before the work items)."""
    kernel = kernel_or_torch("kernel")
    cache = KVCache(1, 4, 16, 1, 16)
    for n in (1, 600):                                           # 600: 2e5 query-key pairs, in parallel
        q = torch.zeros(n, 1, 16)
        tables = torch.tensor([[0, 1, 2] + [9] * 61])            # block 9 does not exist
        with pytest.raises(RuntimeError, match="block 9 is outside the pool"):
            kernel.paged_attention(q, cache.k[0], cache.v[0], tables, torch.zeros(n, dtype=torch.long),
                                   torch.arange(n) + 48, 0, 0, bf16)
    with pytest.raises(RuntimeError, match="beyond the block table"):
        kernel.paged_attention(torch.zeros(1, 1, 16), cache.k[0], cache.v[0], torch.tensor([[0]]),
                               torch.tensor([0]), torch.tensor([16]))


@pytest.mark.parametrize("window", [0, 20], ids=["full", "window"])
@pytest.mark.parametrize("bs", [4, 16, 32])
def test_a_bf16_pool_gives_the_bits_of_bf16_operands_on_an_fp32_pool(threads, bs, window, kernel_path):
    """kv_cache_dtype bf16 (kv_cache.py): keys and values rounded once as they are written into a
    bfloat16 pool, then read as they are, give the bits that bf16 operands give on an fp32 pool,
    which rounds them at every read: two sequences prefilled in chunks, then decoded (partial key
    tiles, odd value pairs, blocks of 16 keys or not, with and without an eviction window)."""
    kernel = kernel_or_torch("kernel")
    g = torch.Generator().manual_seed(8)
    H, Hkv, D = 9, 3, 64
    blocks = 2 * (-(-200 // bs)) + 1
    pools = {dt: KVCache(1, blocks, bs, Hkv, D, dt) for dt in ("fp32", "bf16")}
    tables = [list(range(1, 1 + -(-200 // bs))), list(range(1 + -(-200 // bs), blocks))]
    steps = [[(0, 0, 100), (1, 0, 37)], [(0, 100, 57), (1, 37, 1)], [(0, 157, 1), (1, 38, 1)], [(1, 39, 9)]]
    for chunks in steps:
        T = sum(n for _, _, n in chunks)
        q = torch.randn(T, H, D, generator=g)
        k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
        pos = torch.cat([torch.arange(a, a + n) for _, a, n in chunks])
        seq = torch.cat([torch.full((n,), row) for row, (_, _, n) in enumerate(chunks)])
        table = torch.tensor([tables[s] for s, _, _ in chunks])
        slots = torch.cat([torch.tensor(tables[s])[torch.arange(a, a + n) // bs] * bs + torch.arange(a, a + n) % bs
                           for s, a, n in chunks])
        out = {}
        for dt, cache in pools.items():
            kernel.write_kv(cache.k[0], cache.v[0], slots, k, v)
            out[dt] = kernel.paged_attention(q, cache.k[0], cache.v[0], table, seq, pos, 2 if window else 0, window,
                                             True)
        assert torch.equal(out["bf16"], out["fp32"]), chunks
    for half, full in zip(pools["bf16"].token_major(0), pools["fp32"].token_major(0)):
        assert torch.equal(half, full.bfloat16())                       # written rounded to nearest even
    assert pools["bf16"].nbytes * 2 == pools["fp32"].nbytes


def test_the_kernel_refuses_pools_it_cannot_read():
    """A bfloat16 pool holds bf16 operands only; the two pools are of one dtype."""
    kernel = kernel_or_torch("kernel")
    half, full = KVCache(1, 2, 16, 1, 16, "bf16"), KVCache(1, 2, 16, 1, 16)
    args = (torch.zeros(1, 1, 16), torch.tensor([[0]]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="bf16=True"):
        kernel.paged_attention(args[0], half.k[0], half.v[0], *args[1:], 0, 0, False)
    with pytest.raises(RuntimeError, match="both alike"):
        kernel.paged_attention(args[0], half.k[0], full.v[0], *args[1:], 0, 0, True)
    with pytest.raises(RuntimeError, match="both alike"):
        kernel.write_kv(half.k[0], full.v[0], torch.tensor([0]), torch.zeros(1, 1, 16), torch.zeros(1, 1, 16))


def test_a_bf16_pool_keeps_the_pairs_vdpbf16ps_multiplies():
    """kv_cache.py's layout, element by element against the token-major view: keys in pairs of
    dimensions, values in pairs of neighbouring slots, the first of a pair in the low half."""
    kernel = kernel_or_torch("kernel")
    g = torch.Generator().manual_seed(3)
    bs, Hkv, D = 4, 2, 32
    cache = KVCache(1, 3, bs, Hkv, D, "bf16")
    assert cache.k.shape == (1, 3, Hkv, D // 2, bs, 2) and cache.v.shape == (1, 3, Hkv, bs // 2, D, 2)
    k, v = torch.randn(12, Hkv, D, generator=g), torch.randn(12, Hkv, D, generator=g)
    kernel.write_kv(cache.k[0], cache.v[0], torch.arange(12), k, v)
    for slot in range(12):
        b, j = divmod(slot, bs)
        for h in range(Hkv):
            for d in range(D):
                assert cache.k[0, b, h, d // 2, j, d % 2] == k[slot, h, d].bfloat16()
                assert cache.v[0, b, h, j // 2, d, j % 2] == v[slot, h, d].bfloat16()
    words = cache.k[0].view(torch.int32).squeeze(-1)                            # (blocks, Hkv, D/2, bs): a word a pair
    first = cache.k[0, ..., 0].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(words & 0xFFFF, first)                                   # the first of a pair: the low half
    keys, values = cache.token_major(0)
    assert torch.equal(keys.reshape(12, Hkv, D), k.bfloat16()) and torch.equal(values.reshape(12, Hkv, D), v.bfloat16())
    # a sequence that ends at the first slot of a pair reads none of the second, whatever it holds
    # (an earlier sequence's NaN): the kernel pairs its last value with zero, as from an fp32 pool
    q = torch.randn(1, 2 * Hkv, D, generator=g)
    table, seq = torch.tensor([[1]]), torch.tensor([0])
    kernel.write_kv(cache.k[0], cache.v[0], torch.tensor([4]), k[:1], v[:1])
    clean = kernel.paged_attention(q, cache.k[0], cache.v[0], table, seq, torch.tensor([0]), 0, 0, True)
    cache.v[0, 1, :, 0, :, 1] = float("nan")
    assert torch.equal(kernel.paged_attention(q, cache.k[0], cache.v[0], table, seq, torch.tensor([0]), 0, 0, True),
                       clean) and not clean.isnan().any()


def test_a_pool_is_fp32_or_bf16():
    from core.errors import InvalidParameter
    from core.model.kv_cache import kv_dtype
    assert KVCache(2, 3, 16, 1, 16, "bf16").k.dtype == torch.bfloat16
    with pytest.raises(InvalidParameter, match="block_size"):
        KVCache(1, 1, 3, 1, 16, "bf16")                              # slots pair up in a bf16 pool
    assert kv_dtype("auto", "bf16", block_size=3).value == "fp32"   # so auto keeps fp32 there
    with pytest.raises(InvalidParameter, match="kv_cache_dtype"):
        kv_dtype("bf16", "bf16", block_size=5)
    assert KVCache(2, 3, 16, 1, 16).bytes_per_value == 4 and KVCache(2, 3, 16, 1, 16, "bf16").bytes_per_value == 2
    with pytest.raises(InvalidParameter, match="dtype"):
        KVCache(1, 1, 16, 1, 16, "auto")
    assert kv_dtype("auto", "bf16").value == "bf16" and kv_dtype("auto", "fp32").value == "fp32"
    assert kv_dtype("fp32", "bf16").value == "fp32" and kv_dtype("bf16", "bf16").value == "bf16"
    with pytest.raises(InvalidParameter, match="kv_cache_dtype"):
        kv_dtype("bf16", "fp32")


# -- batch invariance through the whole model -----------------------------------------------------

def run_step(engine, work):
    """One forward over [(seq, n tokens)], as LLMEngine.step does it; -> {request_id: logits}."""
    for seq, n in work:
        engine.block_manager.allocate(seq, n)
    step = engine.runner.prepare(work)
    logits = engine.runner.run(step)
    for seq, n in work:
        seq.num_computed_tokens += n
    return {s.request_id: row for s, row in zip(step.sample_seqs, logits)}


def invariance_cases(engine, target_ids):
    """The logits after target_ids, computed in several ways. The last token of target_ids is
    computed by a decode in some cases and inside a prefill chunk in others."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(5)

    def seq(ids, rid):
        return engine.make_sequence(list(ids), SamplingParams(temperature=0.0), request_id=rid)

    def other(n, rid):
        return seq(torch.randint(3, vocab, (n,), generator=g).tolist(), rid)

    L = len(target_ids)
    results = {}

    # 1. the whole prompt alone, one chunk
    t = seq(target_ids, "t1")
    results["alone, one chunk"] = run_step(engine, [(t, L)])["t1"]

    # 2. prompt minus one alone, then a decode alone
    t = seq(target_ids[:-1], "t2")
    run_step(engine, [(t, L - 1)])
    t.token_ids.append(target_ids[-1])
    results["alone, decode"] = run_step(engine, [(t, 1)])["t2"]

    # 3. packed with a longer and a shorter prompt, all prefilled in one step
    t = seq(target_ids, "t3")
    results["packed prefill"] = run_step(engine, [(other(L + 9, "o1"), L + 9), (t, L), (other(3, "o2"), 3)])["t3"]

    # 4. chunks of 5 beside other prefill chunks, then a decode beside other decodes and a chunk
    t = seq(target_ids[:-1], "t4")
    o3, o4, o5 = other(3 * L, "o3"), other(2, "o4"), other(L + 5, "o5")
    run_step(engine, [(o4, 2)])
    o4.token_ids.append(7)
    done = 0
    while done < L - 1:
        n = min(5, L - 1 - done)
        run_step(engine, [(o3, 6), (t, n), (o4, 1)])
        o4.token_ids.append(7)
        done += n
    t.token_ids.append(target_ids[-1])
    results["chunks, then decode in a mixed step"] = run_step(engine, [(o5, 8), (o4, 1), (t, 1), (o3, 4)])["t4"]
    o4.token_ids.append(7)

    # 5. the last token inside a prefill chunk that begins mid-prompt, beside a decode
    t = seq(target_ids, "t5")
    run_step(engine, [(t, L - 4)])
    results["last chunk beside a decode"] = run_step(engine, [(o4, 1), (t, 4)])["t5"]
    return results


def assert_bit_identical(results):
    names = list(results)
    first = results[names[0]]
    for name in names[1:]:
        diff = (results[name] - first).abs().max().item()
        assert torch.equal(results[name], first), f"{name!r} differs from {names[0]!r} by {diff:.3g}"


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q4_1"])
def test_logits_are_bit_identical_in_any_batch_tiny(make_tiny_engine, threads, fmt):
    engine = make_tiny_engine(block_size=4, enable_prefix_caching=False, weight_format=fmt, share_cpu=False)
    target = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again.")
    assert len(target) > 10
    assert_bit_identical(invariance_cases(engine, target))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q4_1"])
def test_logits_are_bit_identical_with_one_or_two_threads(make_tiny_engine, fmt):
    """The engine changes its thread count while it serves (cpu_share.py), so a request must get
    the same bits whichever count a step ran with."""
    target = make_tiny_engine().tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again.")
    before = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 2):
            engine = make_tiny_engine(block_size=4, enable_prefix_caching=False, weight_format=fmt,
                                      share_cpu=False, num_threads=n)
            assert torch.get_num_threads() == n
            for case, logits in invariance_cases(engine, target).items():
                results[f"{case}, {n} thread(s)"] = logits
    finally:
        torch.set_num_threads(before)
    assert_bit_identical(results)


@pytest.mark.real_model
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q4_1"])
def test_logits_are_bit_identical_in_any_batch_smollm(make_smollm, fmt):
    engine = make_smollm(block_size=4, enable_prefix_caching=False, weight_format=fmt).engine
    target = engine.tokenizer.encode("Paged attention keeps the keys and values of every request in blocks.")
    assert len(target) > 10
    assert_bit_identical(invariance_cases(engine, target))


def test_plan_groups_keeps_a_long_context_apart():
    """One decode with a long context must not pad thirty short decodes to its length."""
    from core.model.attention import plan_groups
    bs = 16
    short = [(i, 1, 20, [i]) for i in range(31)]              # 1 query, 1 block each
    long = [(31, 1, 7000, list(range(100, 100 + 438)))]       # 1 query, 438 blocks
    groups = plan_groups(short + long, bs, min_rows=2)
    assert sorted(len(g) for g in groups) == [1, 31]
    assert [g for g in groups if len(g) == 1][0] == long


def test_plan_groups_separates_a_long_prefill_from_small_ones():
    from core.model.attention import plan_groups
    bs = 16
    prefill = [(0, 344, 6656, list(range(438)))]
    tiny = [(344 + 2 * i, 2, 0, [500 + i]) for i in range(40)]
    groups = plan_groups(prefill + tiny, bs, min_rows=2)
    assert prefill in groups
    assert sum(len(g) for g in groups) == 41 and len(groups) <= 3


def test_plan_groups_keeps_similar_sequences_together():
    from core.model.attention import plan_groups
    seqs = [(i, 1, 30 + i, [i, i + 100]) for i in range(64)]   # 64 decodes of two blocks each
    assert plan_groups(seqs, 16, min_rows=2) == [sorted(seqs, key=lambda s: (s[1] > 1, len(s[3]), s[1]))]
