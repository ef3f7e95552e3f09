"""Widget `block` (section 5): the stack of blocks measured on a text, checked against transformers."""

import math

import pytest
import torch

from bounds import OTHER_KERNELS_ERROR_RATIO, entropy_bound, gamma, llama_f64
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


ROUNDING = 5e-7     # the reply's numbers are rounded to 6 decimals (app/widgets/base.py: rounded)


def entropy_tolerance(n: int, heads: int) -> float:
    """How far the reply's attention entropy of a token seeing n keys, averaged over `heads` heads,
    may lie from the exact entropy of the fp32 weights' exact values: each head's within
    entropy_bound(n) (tests/bounds.py), the mean (a sum of `heads` values <= ln n, a divide)
    gamma_{heads+1} ln n more, and the rounding to 6 decimals."""
    return entropy_bound(n) + gamma(heads + 1) * math.log(max(n, 2)) + ROUNDING


def check_entropy(r):
    """Token t sees t + 1 tokens: its attention entropy is in [0, ln(t + 1)], so 0 for the first
    (one key: a weight of exactly 1), up to entropy_tolerance."""
    heads = len(r["head_entropy"][0])
    for row in r["attention_entropy"]:
        assert abs(row[0]) <= entropy_tolerance(1, heads)
        for t, h in enumerate(row):
            tol = entropy_tolerance(t + 1, heads)
            assert -tol <= h <= math.log(t + 1) + tol, (t, h)


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


def check_against_f64(ours: torch.Tensor, hf: torch.Tensor, exact: torch.Tensor, own: torch.Tensor) -> None:
    """ours, hf, exact (L, ...): a per-layer figure from the widget, from transformers and from a
    float64 run of the same weights. Both fp32 computations of the same function: ours within
    OTHER_KERNELS_ERROR_RATIO times transformers' largest error in that layer (tests/bounds.py:
    against_f64), plus `own` (the figure's own last roundings, elementwise); and so within that
    plus transformers' error of transformers'."""
    err_hf = (hf.double() - exact).abs().flatten(1).amax(1)                 # (L,)
    err_hf = err_hf.view(-1, *[1] * (exact.dim() - 1))
    bound = OTHER_KERNELS_ERROR_RATIO * err_hf + own
    assert ((ours.double() - exact).abs() <= bound).all(), float(((ours.double() - exact).abs() - bound).max())
    assert ((ours.double() - hf.double()).abs() <= bound + err_hf).all()


@pytest.mark.real_model
def test_norms_match_transformers(real_ws, hf_reference, smollm_loaded):
    from core.model.model import Transformer

    hf_model, _ = hf_reference
    r = real_ws.call("layers", text=TEXT)
    assert r["type"] == "layers", r
    ids = [t["id"] for t in r["tokens"]]
    embedding, residual, mlp = hf_residuals(hf_model, ids)
    L, T, C = residual.shape
    assert r["num_layers"] == hf_model.config.num_hidden_layers
    # the same embedding rows (both dequantize the file's), each norm an fp32 sum of C squares and
    # a sqrt (gamma_{C+2} relative, gamma_{C+1} / 2 + u), and the reply's rounding
    ours_emb, hf_emb = torch.tensor(r["embedding_norm"]).double(), embedding.norm(dim=-1).double()
    assert ((ours_emb - hf_emb).abs() <= 2 * gamma(C + 2) * hf_emb + ROUNDING).all()
    taps = {}
    llama_f64(Transformer.from_state_dict(smollm_loaded.config, smollm_loaded.state_dict, packed=False), ids, taps=taps)
    # a norm moves by at most the vector's error (|  |a| - |b|  | <= |a - b|); its own fp32 roundings
    # add gamma_{C+2} of it and 4 ulps, and the reply rounds to 6 decimals
    for key, hf, tap in (("residual_norm", residual, "residual"), ("mlp_update_norm", mlp, "mlp")):
        exact = torch.stack([taps[(tap, l)] for l in range(L)])                     # (L, T, C)
        err_hf = (hf.double() - exact).norm(dim=-1).amax(-1)                         # (L,) the vectors' error
        exact_norm = exact.norm(dim=-1)                                              # (L, T)
        own = (2 * gamma(C + 2) + 4 * 2.0 ** -23) * exact_norm + ROUNDING
        bound = OTHER_KERNELS_ERROR_RATIO * err_hf[:, None] + own              # (L, T), against_f64's
        ours = torch.tensor(r[key]).double()
        assert ((ours - exact_norm).abs() <= bound).all(), key
        # and so from transformers' norms: plus their vectors' error and their norms' own roundings
        assert ((ours - hf.norm(dim=-1).double()).abs() <= bound + err_hf[:, None] + own).all(), key
    # the last layer's residual is not transformers' last hidden state, which is normalized: its
    # norm is about sqrt(C) times the final norm's weights, nowhere near; 1e-2 only separates them
    final = torch.tensor(r["residual_norm"][-1])
    assert not torch.allclose(final, hf_model.model.norm(residual[-1]).norm(dim=-1), rtol=1e-2)
    check_entropy(r)
    # attention entropy from transformers' own attention weights (eager attention returns them),
    # against the entropy of the float64 run's weights
    weights = hf_attentions(hf_model, ids)                                # (L, H, T, T)
    h = -(weights * weights.clamp_min(1e-30).log()).sum(-1)               # (L, H, T)
    p = torch.stack([taps[("probs", l)] for l in range(L)])               # (L, H, T, T) float64
    h_exact = -(p * p.clamp_min(1e-300).log()).sum(-1)                    # (L, H, T)
    H = h.shape[1]
    check_against_f64(torch.tensor(r["attention_entropy"]), h.mean(dim=1), h_exact.mean(dim=1),
                      entropy_tolerance(T, H))
    check_against_f64(torch.tensor(r["head_entropy"]), h.mean(dim=2), h_exact.mean(dim=2),
                      entropy_bound(T) + gamma(T + 1) * math.log(T) + ROUNDING)


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
    # the page shows the same request's reply (same inputs, same computation: the same bits), its
    # data-value a JS number's shortest repr (exact): equal
    assert figure_value(page, "final_residual_norm") == r["residual_norm"][L - 1][3]
    assert figure_value(page, "embedding_norm") == r["embedding_norm"][3]
    assert figure_value(page, "max_entropy_layer") == r["max_entropy_layer"]
    assert page.locator(f"{BLOCK} .stack .row").count() == L + 2          # header, embedding, blocks
    # the GQA drawing comes from the model's head counts
    assert page.locator(f"{BLOCK} .gqa circle").count() == real_ws.hello["num_heads"]
    assert page.locator(f"{BLOCK} .gqa rect").count() == real_ws.hello["num_kv_heads"]
    # following another token redraws its figures
    page.click(f'{BLOCK} .block-tokens .tok[data-index="0"]')
    assert figure_value(page, "final_residual_norm") == r["residual_norm"][L - 1][0]
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
