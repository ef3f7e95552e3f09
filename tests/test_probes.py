"""core/inspect/probes.py: hooks see what the forward pass computes, and change nothing."""

import math

import pytest
import torch

from bounds import SPLIT_SUM_ERROR_RATIO, U32, entropy_bound, gamma, llama_f64, softmax_sum_bound, ulps
from core.inspect import probes
from core.model.model import Transformer


@pytest.fixture(scope="module")
def tiny_model(tiny_loaded):
    return Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict)


def whole_stream(model, ids: list[int]) -> torch.Tensor:
    """The last block's residual (T, C), the model's own blocks on the whole sequence."""
    x = model.embed_tokens(torch.tensor(ids))
    with torch.inference_mode():
        for block in model.layers:
            x = block(x, torch.arange(len(ids)), model.rotary)
    return x


def attention_weight_bound(record) -> float:
    """How far one fp32 softmax of a layer's scores can be from exact, from the q and k the probe
    recorded: the scores' dot products (gamma_{D+1} |q||k| / sqrt(D)) move each weight by at most
    2 max err_s (a weight is at most 1), the softmax's own roundings by softmax_sum_bound."""
    q, k = record.q.double(), record.k.double().repeat_interleave(record.q.shape[1] // record.k.shape[1], dim=1)
    D = q.shape[-1]
    err_s = gamma(D + 1) * torch.einsum("qhd,khd->hqk", q.abs(), k.abs()).max() / math.sqrt(D)
    return float(2 * err_s) + softmax_sum_bound(q.shape[0])


@pytest.fixture(scope="module")
def ids(tiny_loaded):
    return tiny_loaded.tokenizer.encode("The cat sat on the mat because it was tired.")


def test_records_every_layer_and_changes_nothing(tiny_model, ids):
    cfg = tiny_model.config
    T = len(ids)
    before = tiny_model.score(ids)
    records = probes.run(tiny_model, ids, attention={1})
    assert torch.equal(before, tiny_model.score(ids))              # probing changes nothing
    assert [r.layer for r in records] == list(range(cfg.num_layers))
    assert records[0].attention is None
    w = records[1].attention
    assert w.shape == (cfg.num_heads, T, T)
    assert torch.allclose(w.sum(-1), torch.ones(cfg.num_heads, T), rtol=0, atol=softmax_sum_bound(T))
    assert torch.all(w.triu(diagonal=1) == 0)
    r = records[0]
    assert r.q.shape == (T, cfg.num_heads, cfg.head_dim) and r.k.shape == (T, cfg.num_kv_heads, cfg.head_dim)
    assert torch.allclose(r.q[0], r.q_raw[0])                        # position 0: no rotation
    assert not torch.allclose(r.q[3], r.q_raw[3])


def test_residual_norm_is_the_hidden_state_norm(tiny_model, ids):
    """The last block's residual, normalized by the final RMSNorm, is what score() reads."""
    records = probes.run(tiny_model, ids)
    x = tiny_model.embed_tokens(torch.tensor(ids))
    with torch.inference_mode():
        for block in tiny_model.layers:
            x = block(x, torch.arange(len(ids)), tiny_model.rotary)
    # both are fp32 computations of one residual stream (rows batched otherwise): each row within
    # SPLIT_SUM_ERROR_RATIO times the forward's own error against float64 (plus 4 ulps), and
    # | |a| - |b| | <= |a - b| (tests/bounds.py)
    exact, _ = llama_f64(tiny_model, ids)
    err_fwd = (x.double() - exact).norm(dim=-1)
    tol = (SPLIT_SUM_ERROR_RATIO + 1) * err_fwd + ulps(exact, 4)
    assert ((records[-1].residual.double() - x.norm(dim=-1).double()).abs() <= tol).all()
    # the residual grows by exactly the two updates, so the norms obey the triangle inequality, up to
    # the two adds' roundings (2u of the new residual) and the four norms' own (gamma_{C+1} each)
    C = tiny_model.config.hidden_size
    for prev, r in zip(records, records[1:]):
        total = prev.residual + r.attn_update + r.mlp_update
        assert torch.all(r.residual <= total + 2 * (2 * U32 + 4 * gamma(C + 1)) * total)


def test_entropy_of_first_row_is_zero(tiny_model, ids):
    w = probes.run(tiny_model, ids, attention=True)[0].attention
    h = probes.entropy(w)                                            # (H, T)
    tol = entropy_bound(len(ids))                                    # fp32 rounding (tests/bounds.py)
    assert torch.all(h[:, 0].abs() <= tol)                           # token 0 sees only itself
    assert torch.all(h >= -tol)
    assert torch.all(h[:, -1] <= math.log(len(ids)) + tol)


def test_layers_is_lazy(tiny_model, ids):
    gen = probes.layers(tiny_model, ids)
    assert next(gen).layer == 0
    gen.close()


def test_entropy_is_kept_without_the_weights(tiny_model, ids):
    with_weights = probes.run(tiny_model, ids, attention=True)
    without = probes.run(tiny_model, ids)
    for a, b in zip(with_weights, without):
        assert b.attention is None
        assert torch.allclose(a.entropy, probes.entropy(a.attention), rtol=0, atol=2 * entropy_bound(a.attention.shape[-1]))
        assert torch.equal(a.entropy, b.entropy)      # the same slices, the same code, kept weights or not: bit for bit


def test_slices_pause_between_pieces_of_work(tiny_model, ids, monkeypatch):
    monkeypatch.setattr(probes, "ATTENTION_CELLS", 4 * tiny_model.config.num_heads * len(ids))  # 4 rows a slice
    monkeypatch.setattr(probes, "ROWS", 5)
    items = list(probes.slices(tiny_model, ids, attention={0}))
    records = [i for i in items if i is not None]
    assert len(records) == tiny_model.config.num_layers
    T = len(ids)
    per_layer = -(-T // 5) + -(-T // 4) + 2 * -(-T // 5)  # q/k/v, attention, output projection, MLP chunks
    assert len(items) == per_layer * tiny_model.config.num_layers
    whole = probes.run(tiny_model, ids, attention={0})
    # the same rows cut into other slices: fp32 evaluations of one function (tests/bounds.py)
    exact, _ = llama_f64(tiny_model, ids)
    err = (SPLIT_SUM_ERROR_RATIO * (whole_stream(tiny_model, ids).double() - exact).norm(dim=-1).max()
           + ulps(exact, 4))
    assert torch.allclose(records[-1].residual.double(), whole[-1].residual.double(), rtol=0, atol=float(2 * err))
    assert torch.allclose(records[0].attention, whole[0].attention, rtol=0, atol=2 * attention_weight_bound(whole[0]))


def test_a_slice_puts_at_most_rows_tokens_through_the_linear_layers(tiny_model, monkeypatch):
    """However long the text, one slice sends at most ROWS tokens through the q/k/v projection,
    the output projection and the MLP together: the longest pause a probe puts between two
    serving steps does not grow with the text."""
    monkeypatch.setattr(probes, "ROWS", 4)
    rows_now = [0]
    largest = [0]

    def count(module, args):
        rows_now[0] += args[0].shape[0]
        largest[0] = max(largest[0], rows_now[0])

    hooks = []
    for block in tiny_model.layers:
        for module in (block.attn.qkv_proj, block.attn.o_proj, block.mlp):
            hooks.append(module.register_forward_pre_hook(count))
    try:
        pauses = 0
        for _ in probes.slices(tiny_model, list(range(1, 23))):   # 22 tokens: 6 chunks of at most 4
            rows_now[0] = 0
            pauses += 1
    finally:
        for hook in hooks:
            hook.remove()
    assert largest[0] == 4
    assert pauses >= 3 * 6 * tiny_model.config.num_layers     # each linear layer in 6 slices


@pytest.mark.parametrize("fmt", ["bf16"])
def test_probes_follow_the_forward_in_other_weight_formats(tiny_loaded, ids, fmt):
    model = Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict, fmt)
    records = probes.run(model, ids, attention={0})
    x = model.embed_tokens(torch.tensor(ids))
    with torch.inference_mode():
        for block in model.layers:
            x = block(x, torch.arange(len(ids)), model.rotary)
    assert records[-1].residual.dtype == torch.float32
    # two evaluations of the same bf16 arithmetic, rows batched otherwise: the probe's error against
    # float64 at most SPLIT_SUM_ERROR_RATIO times the forward's own, so within (k + 1) times it
    exact, _ = llama_f64(model, ids)
    err_fwd = (x.double() - exact).norm(dim=-1)
    tol = (SPLIT_SUM_ERROR_RATIO + 1) * err_fwd + ulps(exact, 4)
    assert ((records[-1].residual.double() - x.float().norm(dim=-1).double()).abs() <= tol).all()
    ones = torch.ones(tiny_loaded.config.num_heads, len(ids))
    assert torch.allclose(records[0].attention.sum(-1), ones, rtol=0, atol=softmax_sum_bound(len(ids)))
