"""Widget `block` (section 5): the stack of blocks measured on a text, checked against transformers."""

import math

import pytest
import torch

from conftest import drain, figure_value, on_a_phone, shoot_widget, wait_ready

BLOCK = '[data-widget="block"]'
TEXT = "The old lighthouse keeper climbed the stairs every night to light the lamp."


def test_block_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["block"].messages
    assert m.type == "layers" and m.job and m.fields == {"text"}


def test_layers_refuses_bad_input_naming_the_field(ws):
    for fields in [{}, {"text": ""}, {"text": 42}, {"text": "word " * 200}]:
        err = ws.error({"type": "layers", "id": "bad", **fields}, "bad")
        assert err["param"] == "text", (fields, err)
        assert "text" in err["message"]
    err = ws.error({"type": "layers", "id": "bad", "text": TEXT, "layer": 1}, "bad")   # not a field of layers
    assert err["param"] == "layer"
    # the connection is still usable
    r = ws.call("layers", text=TEXT)
    assert r["type"] == "layers", r
    L, T = ws.hello["num_layers"], len(r["tokens"])
    assert r["num_layers"] == L
    for key in ("residual_norm", "attn_update_norm", "mlp_update_norm", "attention_entropy"):
        assert len(r[key]) == L and all(len(row) == T for row in r[key]), key
    assert len(r["head_entropy"]) == L and all(len(row) == ws.hello["num_heads"] for row in r["head_entropy"])
    assert len(r["embedding_norm"]) == T
    assert r["max_entropy_layer"] == max(range(L), key=lambda l: r["mean_entropy"][l])


def check_entropy(r):
    """Token t sees t + 1 tokens: its attention entropy is in [0, ln(t + 1)], so 0 for the first."""
    for row in r["attention_entropy"]:
        assert abs(row[0]) < 1e-5
        for t, h in enumerate(row):
            assert -1e-6 <= h <= math.log(t + 1) + 1e-5, (t, h)


def test_entropy_is_bounded_by_what_a_token_sees(ws):
    check_entropy(ws.call("layers", text=TEXT))


def hf_residuals(hf_model, ids):
    """transformers' residual stream after each decoder layer (L, T, C), and each MLP's output."""
    layers = hf_model.model.layers
    seen = {"mlp": {}}

    def keep_last(module, args, out):
        seen["last"] = out[0] if isinstance(out, tuple) else out

    def keep_mlp(i):
        return lambda module, args, out: seen["mlp"].__setitem__(i, out)

    hooks = [layers[-1].register_forward_hook(keep_last)]
    hooks += [layer.mlp.register_forward_hook(keep_mlp(i)) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    L = len(layers)
    # hidden_states[0] is the embedding, hidden_states[l + 1] the stream after layer l, except the
    # last, which transformers gives after the final RMSNorm: the last layer's own output is the hook's
    residual = [out.hidden_states[l + 1][0] for l in range(L - 1)] + [seen["last"][0]]
    mlp = [seen["mlp"][l][0] for l in range(L)]
    return out.hidden_states[0][0], torch.stack(residual), torch.stack(mlp)


@pytest.mark.real_model
def test_norms_match_transformers(real_ws, hf_reference):
    hf_model, _ = hf_reference
    r = real_ws.call("layers", text=TEXT)
    assert r["type"] == "layers", r
    ids = [t["id"] for t in r["tokens"]]
    embedding, residual, mlp = hf_residuals(hf_model, ids)
    assert r["num_layers"] == hf_model.config.num_hidden_layers
    assert torch.allclose(torch.tensor(r["embedding_norm"]), embedding.norm(dim=-1), rtol=1e-3)
    assert torch.allclose(torch.tensor(r["residual_norm"]), residual.norm(dim=-1), rtol=1e-3)
    assert torch.allclose(torch.tensor(r["mlp_update_norm"]), mlp.norm(dim=-1), rtol=1e-3)
    # the last layer's residual is not transformers' last hidden state, which is normalized
    final = torch.tensor(r["residual_norm"][-1])
    assert not torch.allclose(final, hf_model.model.norm(residual[-1]).norm(dim=-1), rtol=1e-2)
    check_entropy(r)
    # attention entropy from transformers' own attention weights (eager attention returns them)
    weights = hf_attentions(hf_model, ids)                                # (L, H, T, T)
    h = -(weights * weights.clamp_min(1e-30).log()).sum(-1)               # (L, H, T)
    assert torch.allclose(torch.tensor(r["attention_entropy"]), h.mean(dim=1), atol=1e-3)
    assert torch.allclose(torch.tensor(r["head_entropy"]), h.mean(dim=2), atol=1e-3)


def hf_attentions(hf_model, ids):
    previous = hf_model.config._attn_implementation
    hf_model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = hf_model(torch.tensor([ids]), output_attentions=True)
    finally:
        hf_model.set_attn_implementation(previous)
    return torch.stack([a[0] for a in out.attentions])


@pytest.mark.browser
@pytest.mark.real_model
def test_block_page_takes_options_from_the_url(pg, real_ws, artifacts_dir):
    query = "?text=Water+boils+at+one+hundred+degrees.&token=3&metric=attention_entropy"
    shoot_widget(pg, "block", artifacts_dir, query)
    page = pg.page
    pg.goto(f"/embed/block{query}")
    wait_ready(page, BLOCK)
    assert page.input_value(f'{BLOCK} select[name="token"]') == "3"
    assert page.input_value(f'{BLOCK} select[name="metric"]') == "attention_entropy"
    r = real_ws.call("layers", text="Water boils at one hundred degrees.")
    L = real_ws.hello["num_layers"]
    assert figure_value(page, "num_layers") == L
    assert figure_value(page, "final_residual_norm") == pytest.approx(r["residual_norm"][L - 1][3], rel=1e-6)
    assert figure_value(page, "embedding_norm") == pytest.approx(r["embedding_norm"][3], rel=1e-6)
    assert figure_value(page, "max_entropy_layer") == r["max_entropy_layer"]
    assert page.locator(f"{BLOCK} .stack .row").count() == L + 2          # header, embedding, blocks
    # the GQA drawing comes from the model's head counts
    assert page.locator(f"{BLOCK} .gqa circle").count() == real_ws.hello["num_heads"]
    assert page.locator(f"{BLOCK} .gqa rect").count() == real_ws.hello["num_kv_heads"]
    # following another token redraws its figures
    page.click(f'{BLOCK} .block-tokens .tok[data-index="0"]')
    assert figure_value(page, "final_residual_norm") == pytest.approx(r["residual_norm"][L - 1][0], rel=1e-6)
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_block_on_the_walkthrough_at_phone_width(pg, artifacts_dir):
    snippet = on_a_phone(pg, "block", "?block.token=2", artifacts_dir)
    assert "/embed/block?" in snippet and "token=2" in snippet
    pg.assert_clean()


def test_the_job_runs_in_slices_with_progress_per_layer(tiny_loaded):
    from types import SimpleNamespace

    from app.jobs import Progress
    from app.widgets.block import layers_job
    from core.model.model import Transformer

    engine = SimpleNamespace(view=SimpleNamespace(   # what the job reads: the engine's view
        reference_model=Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict),
        tokenizer=tiny_loaded.tokenizer))
    ids = tiny_loaded.tokenizer.encode(TEXT)
    items, result = drain(layers_job(engine, ids))
    L = tiny_loaded.config.num_layers
    progress = [i for i in items if isinstance(i, Progress)]
    assert [(p.done, p.total, p.note) for p in progress] == [(l + 1, L, f"layer {l + 1} of {L}") for l in range(L)]
    assert len(items) > len(progress)                  # the slices between layers pause too
    assert result["num_layers"] == L and len(result["residual_norm"][0]) == len(ids)


@pytest.mark.browser
@pytest.mark.real_model
def test_a_token_the_text_lacks_falls_back_to_the_last(pg):
    page = pg.page
    pg.goto("/embed/block?text=Hello+there+friend&token=999&metric=nonsense")
    wait_ready(page, BLOCK)
    last = page.locator(f'{BLOCK} select[name="token"] option').count() - 1
    assert page.input_value(f'{BLOCK} select[name="token"]') == str(last)
    assert page.input_value(f'{BLOCK} select[name="metric"]') == "residual_norm"
    assert figure_value(page, "final_residual_norm") > 0
    pg.assert_clean()
