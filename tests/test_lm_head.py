"""csrc/lm_head.cpp: the LM head's candidates. In each row the k largest approximate logits (ties to
the earlier token) are replaced by exact fp32 logits against the embedding, the rest left as they
were; a row's result never depends on the other rows or the threads, on every kernel path; and
Transformer.logits takes it where the engine's kernels are in use."""

import pytest
import torch

from bounds import fp32_dot_bound
from kernel_paths import kernel_path  # noqa: F401 (a fixture)
from core.kernels import loader

ext = loader.extension()
pytestmark = pytest.mark.skipif(ext is None, reason="the engine's extension is not built here")


def problem(N: int, V: int, C: int, seed: int = 0):
    """Approximate logits (the exact ones plus noise), the embedding and the hidden rows."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, C, generator=g) * 0.05
    hidden = torch.randn(N, C, generator=g)
    approx = (hidden.double() @ emb.double().T).float() + 1e-3 * torch.randn(N, V, generator=g)
    return approx, emb, hidden


def rescored(approx, emb, hidden, k):
    out = approx.clone()
    loader.extension().rescore_top(out, emb, hidden, k)
    return out


def expected_set(approx: torch.Tensor, k: int) -> torch.Tensor:
    """(N, V) bool: each row's k largest, ties to the earlier token (a stable sort, descending)."""
    order = torch.sort(approx, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(approx, dtype=torch.bool).scatter_(-1, order, True)


@pytest.mark.parametrize("N,V,C,k", [(1, 49152, 576, 64), (5, 1000, 64, 7), (3, 50, 32, 64), (2, 70, 16, 1)])
def test_the_k_largest_become_exact_and_the_rest_stay(N, V, C, k, kernel_path):
    approx, emb, hidden = problem(N, V, C)
    got = rescored(approx, emb, hidden, k)
    chosen = expected_set(approx, min(k, V))
    assert torch.equal(got[~chosen], approx[~chosen])
    exact = hidden.double() @ emb.double().T
    # one fp32 dot product of C terms each: Higham's bound for any order of the sum
    bound = fp32_dot_bound(hidden, emb)
    err = (got.double() - exact).abs()
    assert bool((err[chosen] <= bound[chosen]).all())
    assert int(chosen.sum()) == N * min(k, V)


def test_ties_go_to_the_earlier_token(kernel_path):
    V, C, k = 300, 32, 10
    approx = torch.zeros(2, V)
    approx[1, 200:] = 1.0                        # row 1: a hundred equal best, then equal rest
    emb, hidden = torch.ones(V, C), torch.full((2, C), 0.5)
    got = rescored(approx, emb, hidden, k)
    assert got[0].nonzero().flatten().tolist() == list(range(k))           # all equal: the first k
    assert got[1].eq(16.0).nonzero().flatten().tolist() == list(range(200, 200 + k))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_gives_the_same_bits_alone_or_among_others(threads, kernel_path):
    approx, emb, hidden = problem(9, 4099, 96, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = rescored(approx, emb, hidden, 64)
        for r in range(9):
            alone = rescored(approx[r:r + 1], emb, hidden[r:r + 1].contiguous(), 64)
            assert torch.equal(alone[0], together[r])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("change,names", [
    (dict(k=-1), "k must be >= 0"),
    (dict(emb=torch.zeros(99, 64)), "one row per logit"),
    (dict(hidden=torch.zeros(2, 64)), "hidden (N, C)"),
    (dict(logits=torch.zeros(3, 100, dtype=torch.float64)), "logits (N, V)"),
])
def test_bad_inputs_are_refused_with_what_is_wrong(change, names):
    args = dict(logits=torch.zeros(3, 100), emb=torch.zeros(100, 64), hidden=torch.zeros(3, 64), k=4) | change
    with pytest.raises(RuntimeError, match=names.replace("(", r"\(").replace(")", r"\)")):
        ext.rescore_top(**args)


def test_k_zero_leaves_the_logits_alone():
    approx, emb, hidden = problem(2, 100, 16)
    assert torch.equal(rescored(approx, emb, hidden, 0), approx)


def test_the_model_picks_its_candidates_with_the_kernel(tiny_loaded):
    """Transformer.logits in q8_0: with the engine's kernels (use_kernels) the candidates come from
    rescore_top, without them from torch's top-k, gather and sum: the same logits outside the
    candidates, and each candidate within twice a dot product's bound of the other's."""
    from core.model.model import Transformer
    model = Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict, "q8_0")
    hidden = torch.randn(4, tiny_loaded.config.hidden_size)
    plain = model.logits(hidden)
    model.use_kernels(loader.kernels(tiny_loaded.config))
    assert model.head_kernel is loader.extension()
    fused = model.logits(hidden)
    approx = model.lm_head(hidden).float()
    chosen = expected_set(approx, model.lm_head_candidates)
    assert torch.equal(fused[~chosen], approx[~chosen]) and torch.equal(plain[~chosen], approx[~chosen])
    exact = hidden.double() @ model.embed_tokens.weight.double().T
    bound = fp32_dot_bound(hidden, model.embed_tokens.weight)
    assert bool(((fused.double() - exact).abs()[chosen] <= bound[chosen]).all())
    assert bool(((plain.double() - exact).abs()[chosen] <= bound[chosen]).all())
