"""Widget `positions` (section 4): RoPE on real queries and keys, checked against transformers."""

import math

import pytest
import torch

from bounds import OTHER_KERNELS_ERROR_RATIO, U32, gamma, llama_f64, rope_table_error, ulps
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
        # the same float64 expressions as the widget's, and JSON carries a float exactly: equal
        assert hand["frequency"] == theta ** (-2 * i / D)
        for name in ("near", "far"):
            h = hand[name]
            assert h["angle"] == h["position"] * hand["frequency"]
            # a rotation keeps the length: the fp32 tables' (cos, sin) has norm within 2 * 2u of 1
            # (rope_table_error at angle 0's scale), each rotated component is within gamma_2 (|x c| +
            # |x' s|) <= gamma_2 |pair| (so sqrt(2) gamma_2 in norm), and `length`, an fp32 norm of two
            # squares, within gamma_3; doubled for second order
            assert math.hypot(*h["vector"]) == pytest.approx(
                hand["length"], rel=2 * (4 * U32 + math.sqrt(2) * gamma(2) + gamma(3)), abs=0)
            if hand["length"] > 1e-3:      # a hand long enough to read an angle off (not a tolerance)
                miss = math.remainder(h["measured"] - h["angle"], 2 * math.pi)
                # the table's angle is off by rope_table_error(position) (its cos and sin too), the
                # rotation moves the hand by sqrt(2) gamma_2 of its length, radians at unit length;
                # atan2 in float64 adds ~1e-16; doubled
                assert abs(miss) < 2 * (rope_table_error(h["position"]) + math.sqrt(2) * gamma(2)), (i, name, miss)


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
def rotated_pair_bound(x: torch.Tensor, position: int) -> torch.Tensor:
    """Bound on |ours - transformers'| for one head vector x (D,) rotated to `position`, elementwise:
    each table within rope_table_error of exact, so the two within twice it, on |x_i| + |x_i'| (the
    pair's other half); each rotation's own rounding gamma_2 (|x_i| + |x_i'|). Doubled."""
    half = x.shape[0] // 2
    pair = x.double().abs() + torch.cat([x[half:], x[:half]]).double().abs()
    return 2 * (2 * rope_table_error(position) + 2 * gamma(2)) * pair


def score_bound(q: torch.Tensor, k: torch.Tensor, q_pos: int, k_pos: int) -> float:
    """Bound on |q rotated . k rotated / sqrt(D)|'s difference between two fp32 computations with
    tables each within rope_table_error of exact: each rotated vector off by sqrt(2) * 2 e(pos) of
    its norm, the rotation by sqrt(2) gamma_2, the dot product by gamma_D sum |a b| <= gamma_D |q| |k|,
    both computations' roundings counted. Doubled."""
    nq, nk = float(q.double().norm()), float(k.double().norm())
    rot = math.sqrt(2) * (2 * rope_table_error(q_pos) + 2 * rope_table_error(k_pos) + 4 * gamma(2))
    return 2 * (rot + 2 * gamma(q.shape[0] + 1)) * nq * nk / math.sqrt(q.shape[0])


@pytest.mark.real_model
def test_rope_vectors_and_scores_match_transformers(real_ws, hf_reference, smollm_loaded):
    from core.model.model import Transformer

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
    D = q.shape[0]
    assert D & (D - 1) == 0                                        # rope_table_error's 2i/D exact
    # ours and transformers' are fp32 computations of the same function: against a float64 run of the
    # same weights, ours (this vector) within OTHER_KERNELS_ERROR_RATIO times transformers' largest error over
    # the layer's q and k (tests/bounds.py: against_f64), plus 4 ulps of their scale
    taps = {}
    llama_f64(Transformer.from_state_dict(smollm_loaded.config, smollm_loaded.state_dict, packed=False), ids, taps=taps)
    H, Hkv = q_all.shape[1], k_all.shape[1]
    T = len(ids)
    exact_q, exact_k = taps[layer][:, :H * D].view(T, H, D), taps[layer][:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    for ours, hf_all, exact, at in ((q, q_all, exact_q, (query, head)), (k, k_all, exact_k, (key, kv_head))):
        err_hf = float((hf_all.double() - exact).abs().max())
        bound = OTHER_KERNELS_ERROR_RATIO * err_hf + ulps(exact, 4)
        assert float((ours.double() - exact[at]).abs().max()) <= bound, (at, bound)
        assert float((ours.double() - hf_all[at].double()).abs().max()) <= bound + err_hf

    # the engine's rotation at the real positions is transformers' rotation of the same vectors
    q_rot, k_rot = hf_rotate(hf_model, q, k, query, key)
    assert ((torch.tensor(r["q_rotated"]).double() - q_rot.double()).abs() <= rotated_pair_bound(q, query)).all()
    assert ((torch.tensor(r["k_rotated"]).double() - k_rot.double()).abs() <= rotated_pair_bound(k, key)).all()
    # and the score at the real positions is the logit transformers' attention computes: the two
    # scores of the same rotation (score_bound), plus what q and k's own difference from transformers'
    # moves it, |dq| |k| + |q| |dk| + |dq| |dk| over sqrt(D)
    q_hf_rot, k_hf_rot = hf_rotate(hf_model, q_hf, k_hf, query, key)
    hf_logit = float(q_hf_rot @ k_hf_rot) / math.sqrt(D)
    dq, dk = float((q - q_hf).double().norm()), float((k - k_hf).double().norm())
    moved = (dq * float(k.double().norm()) + float(q.double().norm()) * dk + dq * dk) / math.sqrt(D)
    assert abs(r["real_score"] - hf_logit) <= score_bound(q, k, query, key) + moved

    # the offset table, recomputed with transformers' RoPE: each cell within score_bound
    scores = torch.tensor(r["scores"])                              # (offsets, starts)
    for i, offset in enumerate(r["offsets"]):
        for j, p in enumerate(r["starts"]):
            qr, kr = hf_rotate(hf_model, q, k, p + offset, p)
            assert abs(float(qr @ kr) / math.sqrt(D) - scores[i, j]) <= score_bound(q, k, p + offset, p)


@pytest.mark.real_model
def test_score_depends_on_offset_not_position(real_ws):
    r = real_ws.call("rope", text=TEXT, layer=5, head=0, query=10, key=3)
    scores = torch.tensor(r["scores"])                              # (offsets, starts)
    spread = scores.max(dim=1).values - scores.min(dim=1).values
    # the same fp32 values (JSON carries them exactly) through the same fp32 operations: equal
    assert torch.equal(spread, torch.tensor(r["spread"]))
    assert r["max_spread"] == float(spread.max())
    # constant along p, up to rounding: every cell of a row has the same exact value, and each is
    # within half score_bound of it (score_bound counts two computations' roundings)
    q, k = torch.tensor(r["q_raw"]), torch.tensor(r["k_raw"])
    last = max(r["starts"]) + max(r["offsets"])
    assert r["max_spread"] <= score_bound(q, k, last, last)
    # the widget divides in float64, this in fp32: one more rounding, u relative
    assert r["max_spread_rel"] == pytest.approx(float(spread.max() / scores.abs().max()), rel=2 * U32, abs=0)
    means = scores.mean(dim=1)
    assert float(means.max() - means.min()) > 100 * r["max_spread"]  # ... but not along the offset
    assert len(set(round(float(m), 3) for m in means)) > len(r["offsets"]) // 2
    assert r["offset_range"] == float(means.max() - means.min())    # the same fp32 operations on the same values


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
    # the page shows the reply's numbers (data-value: a JS number's shortest repr, exact); the
    # same request over the socket gives the vectors the derived bounds need
    r = real_ws.call("rope", text="Paris is the capital of France and its largest city.", layer=2, head=5, query=9, key=5)
    q, k = torch.tensor(r["q_raw"]), torch.tensor(r["k_raw"])
    last = max(r["starts"]) + max(r["offsets"])
    assert figure_value(page, "max_spread_rel") == r["max_spread_rel"]
    assert 0 <= figure_value(page, "max_spread") <= score_bound(q, k, last, last)   # see test_score_depends_on_offset_not_position
    assert figure_value(page, "max_spread") >= 0
    assert figure_value(page, "offset_range") > 100 * figure_value(page, "max_spread")
    assert abs(figure_value(page, "real_score")) > 0
    # the row of the real offset (4 tokens apart here) is the real score, wherever the pair sits
    # the same exact value (offset 4) at other positions: two fp32 computations, within score_bound
    assert abs(figure_value(page, "score_offset_4") - figure_value(page, "real_score")) <= score_bound(q, k, last, last)
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
