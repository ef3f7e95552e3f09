"""Widget `positions` (section 4): RoPE on real queries and keys, checked against transformers."""

import math

import pytest
import torch

from conftest import drain, figure_value, on_a_phone, shoot_widget, wait_ready

POS = '[data-widget="positions"]'
TEXT = "The cat sat on the mat because it was tired after the long walk."


def test_positions_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["positions"].messages
    assert m.type == "rope" and m.job
    assert m.fields == {"text", "layer", "head", "query", "key"}


def test_rope_refuses_bad_input_naming_the_field(ws):
    cfg = ws.hello
    for fields, param in [
        ({}, "text"),
        ({"text": ""}, "text"),
        ({"text": "word " * 200}, "text"),                      # over max_inspect_tokens
        ({"text": TEXT, "layer": cfg["num_layers"]}, "layer"),
        ({"text": TEXT, "layer": "1"}, "layer"),
        ({"text": TEXT, "head": cfg["num_heads"]}, "head"),
        ({"text": TEXT, "head": -1}, "head"),
        ({"text": TEXT, "query": 999}, "query"),
        ({"text": TEXT, "key": 1.5}, "key"),
        ({"text": TEXT, "query": 2, "key": 3}, "key"),          # a key after its query
    ]:
        err = ws.error({"type": "rope", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
        assert param in err["message"]
    # the connection is still usable
    reply = ws.call("rope", text=TEXT, layer=1, head=2, query=5, key=1)
    assert reply["type"] == "rope", reply
    assert (reply["layer"], reply["head"], reply["query"], reply["key"]) == (1, 2, 5, 1)
    group = cfg["num_heads"] // cfg["num_kv_heads"]
    assert reply["kv_head"] == 2 // group
    assert len(reply["q_raw"]) == cfg["head_dim"] and len(reply["clock"]["pairs"]) == cfg["head_dim"] // 2


def test_rope_defaults_to_the_last_token_against_the_one_before(ws):
    reply = ws.call("rope", text=TEXT)
    assert reply["query"] == len(reply["tokens"]) - 1 and reply["key"] == reply["query"] - 1
    assert ws.call("rope", text=TEXT, query=0)["key"] == 0
    assert reply["layer"] == 0 and reply["head"] == 0


def test_clock_angles_follow_the_formula(ws):
    """Each pair's measured turn equals position x theta^(-2i/D), modulo a full turn."""
    r = ws.call("rope", text=TEXT, layer=1, head=1, query=4)
    D, theta = r["head_dim"], r["theta"]
    for hand in r["clock"]["pairs"]:
        i = hand["pair"]
        assert hand["frequency"] == pytest.approx(theta ** (-2 * i / D), rel=1e-12)
        for name in ("near", "far"):
            h = hand[name]
            assert h["angle"] == pytest.approx(h["position"] * hand["frequency"], rel=1e-12)
            assert math.hypot(*h["vector"]) == pytest.approx(hand["length"], rel=1e-4, abs=1e-6)  # a rotation
            if hand["length"] > 1e-3:
                miss = math.remainder(h["measured"] - h["angle"], 2 * math.pi)
                assert abs(miss) < 2e-3, (i, name, miss)


def hf_qk(hf_model, ids, layer):
    """transformers' q_proj and k_proj outputs at `layer`, reshaped to heads: (T, H, D), (T, Hkv, D)."""
    cfg = hf_model.config
    D = cfg.hidden_size // cfg.num_attention_heads
    seen = {}
    attn = hf_model.model.layers[layer].self_attn
    hooks = [attn.q_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out)),
             attn.k_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out))]
    try:
        with torch.no_grad():
            hf_model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    T = len(ids)
    return seen["q"][0].view(T, -1, D), seen["k"][0].view(T, -1, D)


def hf_rotate(hf_model, q, k, q_pos, k_pos):
    """transformers' own RoPE (rotary_emb + apply_rotary_pos_emb) on head vectors (D,) at positions."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = q[None, None, None]                                          # (1, 1, 1, D)
    cos_q, sin_q = hf_model.model.rotary_emb(x, torch.tensor([[q_pos]]))
    cos_k, sin_k = hf_model.model.rotary_emb(x, torch.tensor([[k_pos]]))
    q_rot, _ = apply_rotary_pos_emb(x, x, cos_q, sin_q)
    _, k_rot = apply_rotary_pos_emb(k[None, None, None], k[None, None, None], cos_k, sin_k)
    return q_rot.reshape(-1), k_rot.reshape(-1)


@pytest.mark.real_model
def test_rope_vectors_and_scores_match_transformers(real_ws, hf_reference):
    hf_model, _ = hf_reference
    layer, head, query, key = 3, 4, 12, 2
    r = real_ws.call("rope", text=TEXT, layer=layer, head=head, query=query, key=key)
    assert r["type"] == "rope", r
    ids = [t["id"] for t in r["tokens"]]
    q_all, k_all = hf_qk(hf_model, ids, layer)
    kv_head = head // (hf_model.config.num_attention_heads // hf_model.config.num_key_value_heads)
    assert r["kv_head"] == kv_head
    q_hf, k_hf = q_all[query, head], k_all[key, kv_head]
    q, k = torch.tensor(r["q_raw"]), torch.tensor(r["k_raw"])
    assert torch.allclose(q, q_hf, rtol=1e-4, atol=1e-4), (q - q_hf).abs().max()
    assert torch.allclose(k, k_hf, rtol=1e-4, atol=1e-4), (k - k_hf).abs().max()

    # the engine's rotation at the real positions is transformers' rotation of the same vectors
    q_rot, k_rot = hf_rotate(hf_model, q, k, query, key)
    assert torch.allclose(torch.tensor(r["q_rotated"]), q_rot, atol=1e-5)
    assert torch.allclose(torch.tensor(r["k_rotated"]), k_rot, atol=1e-5)
    # and the score at the real positions is the logit transformers' attention computes
    q_hf_rot, k_hf_rot = hf_rotate(hf_model, q_hf, k_hf, query, key)
    hf_logit = float(q_hf_rot @ k_hf_rot) / math.sqrt(q.shape[0])
    assert r["real_score"] == pytest.approx(hf_logit, rel=1e-3)

    # the offset table, recomputed with transformers' RoPE: each cell within 1e-3 of the largest score
    scores = torch.tensor(r["scores"])                              # (offsets, starts)
    scale = scores.abs().max()
    for i, offset in enumerate(r["offsets"]):
        for j, p in enumerate(r["starts"]):
            qr, kr = hf_rotate(hf_model, q, k, p + offset, p)
            assert abs(float(qr @ kr) / math.sqrt(q.shape[0]) - scores[i, j]) < 1e-3 * scale


@pytest.mark.real_model
def test_score_depends_on_offset_not_position(real_ws):
    r = real_ws.call("rope", text=TEXT, layer=5, head=0, query=10, key=3)
    scores = torch.tensor(r["scores"])                              # (offsets, starts)
    spread = scores.max(dim=1).values - scores.min(dim=1).values
    assert torch.allclose(spread, torch.tensor(r["spread"]))
    assert r["max_spread"] == pytest.approx(float(spread.max()))
    assert r["max_spread_rel"] < 1e-3                               # constant along p, up to rounding
    assert r["max_spread_rel"] == pytest.approx(float(spread.max() / scores.abs().max()))
    means = scores.mean(dim=1)
    assert float(means.max() - means.min()) > 100 * r["max_spread"]  # ... but not along the offset
    assert len(set(round(float(m), 3) for m in means)) > len(r["offsets"]) // 2
    assert r["offset_range"] == pytest.approx(float(means.max() - means.min()), rel=1e-5)


@pytest.mark.browser
@pytest.mark.real_model
def test_positions_page_takes_options_from_the_url(pg, real_ws, artifacts_dir):
    query = "?text=Paris+is+the+capital+of+France+and+its+largest+city.&layer=2&head=5&query=9&key=5"
    shoot_widget(pg, "positions", artifacts_dir, query)
    page = pg.page
    pg.goto(f"/embed/positions{query}")
    wait_ready(page, POS)
    assert page.input_value(f'{POS} select[name="layer"]') == "2"
    assert page.input_value(f'{POS} select[name="head"]') == "5"
    assert page.input_value(f'{POS} select[name="query"]') == "9"
    assert page.input_value(f'{POS} select[name="key"]') == "5"
    assert figure_value(page, "real_offset") == 4
    assert figure_value(page, "theta") == real_ws.hello["rope_theta"]
    assert 0 <= figure_value(page, "max_spread_rel") < 1e-3
    assert figure_value(page, "max_spread") >= 0
    assert figure_value(page, "offset_range") > 100 * figure_value(page, "max_spread")
    assert abs(figure_value(page, "real_score")) > 0
    # the row of the real offset (4 tokens apart here) is the real score, wherever the pair sits
    assert figure_value(page, "score_offset_4") == pytest.approx(figure_value(page, "real_score"), rel=1e-3, abs=1e-4)
    assert page.locator(f"{POS} .clock").count() == 4
    # a new choice reruns and lands in the embed snippet's URL
    page.select_option(f'{POS} select[name="head"]', "1")
    page.wait_for_function("""() => document.querySelector('[data-widget="positions"] .progress')
                              .textContent.includes('head 1')""")
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_positions_on_the_walkthrough_carries_settings_into_the_snippet(pg, artifacts_dir):
    snippet = on_a_phone(pg, "positions", "?positions.layer=1&positions.head=2", artifacts_dir)
    assert "/embed/positions?" in snippet and "layer=1" in snippet and "head=2" in snippet
    pg.assert_clean()


def test_the_job_stops_after_the_layer_it_needs(tiny_loaded):
    from types import SimpleNamespace

    from app.jobs import Progress
    from app.widgets.positions import rope_job
    from core.model.model import Transformer

    engine = SimpleNamespace(view=SimpleNamespace(   # what the job reads: the engine's view
        reference_model=Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict),
        tokenizer=tiny_loaded.tokenizer))
    ids = tiny_loaded.tokenizer.encode(TEXT)
    for layer in range(tiny_loaded.config.num_layers):
        gen = rope_job(engine, ids, layer=layer, head=0, query=len(ids) - 1, key=0)
        items, result = drain(gen)
        progress = [i for i in items if isinstance(i, Progress)]
        assert [p.note for p in progress] == [f"layer {l + 1} of {layer + 1}" for l in range(layer)]
        assert result["layer"] == layer
    assert all(not block.attn.qkv_proj._forward_hooks for block in engine.view.reference_model.layers)  # hooks removed


@pytest.mark.browser
@pytest.mark.real_model
def test_token_indices_the_text_lacks_fall_back_to_the_defaults(pg):
    page = pg.page
    pg.goto("/embed/positions?text=Hello+there+friend&query=999&key=998")
    wait_ready(page, POS)
    last = page.locator(f'{POS} select[name="query"] option').count() - 1
    assert page.input_value(f'{POS} select[name="query"]') == str(last)
    assert page.input_value(f'{POS} select[name="key"]') == str(last - 1)
    assert figure_value(page, "real_offset") == 1
    pg.assert_clean()
