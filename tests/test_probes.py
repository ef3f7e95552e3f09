"""core/probes.py: probes see what the forward pass computes, and change nothing."""

import pytest
import torch

from core import probes
from core.model import Transformer


@pytest.fixture(scope="module")
def tiny_model(tiny_loaded):
    return Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict)


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
    assert all(not block.attn.qkv_proj._forward_hooks for block in tiny_model.layers)  # hooks removed
    assert records[0].attention is None
    w = records[1].attention
    assert w.shape == (cfg.num_heads, T, T)
    assert torch.allclose(w.sum(-1), torch.ones(cfg.num_heads, T), atol=1e-5)
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
    assert torch.allclose(records[-1].residual, x.norm(dim=-1), rtol=1e-6)
    # the residual grows by exactly the two updates, so the norms obey the triangle inequality
    for prev, r in zip(records, records[1:]):
        assert torch.all(r.residual <= prev.residual + r.attn_update + r.mlp_update + 1e-4)


def test_entropy_of_first_row_is_zero(tiny_model, ids):
    w = probes.run(tiny_model, ids, attention=True)[0].attention
    h = probes.entropy(w)                                            # (H, T)
    assert torch.all(h[:, 0].abs() < 1e-5)                           # token 0 sees only itself
    assert torch.all(h >= -1e-6)
    assert torch.all(h[:, -1] <= torch.log(torch.tensor(float(len(ids)))) + 1e-5)


def test_layers_is_lazy(tiny_model, ids):
    gen = probes.layers(tiny_model, ids)
    first = next(gen)
    assert first.layer == 0
    gen.close()
    assert all(not block.attn.qkv_proj._forward_hooks for block in tiny_model.layers)


def test_slices_pause_between_pieces_of_work(tiny_model, ids, monkeypatch):
    monkeypatch.setattr(probes, "MLP_ROWS", 4)                       # 12 tokens: 3 MLP slices
    items = list(probes.slices(tiny_model, ids, attention={0}))
    records = [i for i in items if i is not None]
    assert len(records) == tiny_model.config.num_layers
    T = len(ids)
    mlp_slices = -(-T // 4)
    # each layer: its q/k/v projection, its attention (with the weights when asked), its MLP slices
    assert len(items) - len(records) == 2 * (1 + 1 + mlp_slices)
    assert torch.allclose(records[-1].residual, probes.run(tiny_model, ids)[-1].residual, rtol=1e-5)


def test_long_texts_are_sliced_by_query_rows_and_equal_one_pass(tiny_model, monkeypatch):
    """Attention in slices of query rows gives the block's own forward, weights included."""
    ids = list(range(100, 150))                                     # 50 tokens
    whole = probes.run(tiny_model, ids, attention=True)
    monkeypatch.setattr(probes, "ATTENTION_ROWS", 8)               # 7 slices of queries
    items = list(probes.slices(tiny_model, ids, attention=True))
    records = [i for i in items if i is not None]
    assert len(items) - len(records) == tiny_model.config.num_layers * (7 + 7 + 1)
    for a, b in zip(whole, records):
        assert torch.allclose(a.attention, b.attention, atol=1e-6)
        assert torch.allclose(a.residual, b.residual, rtol=1e-5)
    x = tiny_model.embed_tokens(torch.tensor(ids))
    with torch.inference_mode():
        for block in tiny_model.layers:
            x = block(x, torch.arange(len(ids)), tiny_model.rotary)
    assert torch.allclose(records[-1].residual, x.norm(dim=-1), rtol=1e-5)
