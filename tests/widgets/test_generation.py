"""Widget `generation`: next_token on the serving engine (tiny model), parity with transformers on
the real model (probabilities, greedy steps), KV blocks given back, and the stepper's page."""

import math
import urllib.parse

import pytest
import torch

from bounds import U32, softmax_sum_bound
from conftest import figure_value, get_json, healthz, shoot_widget, wait_for, wait_ready
from greedy_steps import check_engine_is_the_model

GEN = '[data-widget="generation"]'
PROMPT = "The capital of France is"
LONG_PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def reshape(logits, temperature, top_k=0, top_p=1.0):
    """The widget's live reshaping (generation.js), computed here independently."""
    z = torch.tensor(logits, dtype=torch.float64) / temperature
    if top_k:
        z[top_k:] = -math.inf
    p = z.softmax(-1)
    if top_p < 1:
        before = p.cumsum(-1) - p
        keep = before < top_p
        keep[0] = True
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return p.tolist()


# ---- the message, on the tiny model ------------------------------------------------------------

def test_greedy_steps_follow_the_chat_path_and_the_kv_grows_by_one(ws, live_server):
    stream = ws.generate(prompt=LONG_PROMPT, max_tokens=4, temperature=0)
    expected = stream.token_ids
    block = live_server.runtime.info["block_size"]
    tokens, kv = [], None
    for i, token in enumerate(expected):
        r = ws.call("next_token", prompt=LONG_PROMPT, tokens=tokens, top=5)
        assert r["type"] == "next_token", r
        assert r["chosen"]["id"] == token == r["candidates"][0]["id"] and r["chosen"]["rank"] == 0
        assert r["phase"] == ("prefill" if i == 0 else "decode") and r["step"] == i
        if kv is not None:
            assert r["kv_cache_tokens"] == kv + 1, "one more token of KV per step"
        kv = r["kv_cache_tokens"]
        assert kv == len(r["prompt"]) + len(tokens)
        assert r["num_cached_tokens"] + r["num_computed_tokens"] == kv
        if i > 0:  # the full blocks the last step computed come from the prefix cache
            assert r["num_cached_tokens"] == block * ((kv - 1) // block) > 0
            assert 1 <= r["num_computed_tokens"] <= block
        probs = [c["prob"] for c in r["candidates"]]
        assert probs == sorted(probs, reverse=True) and len(probs) == 5
        # the widget's own float64 expression on the same floats, in the same order: equal (max: rounding can pass 1)
        assert r["tail_prob"] == max(0.0, 1.0 - sum(probs))
        top = r["candidates"][0]
        for c in r["candidates"][1:]:  # prob is the softmax of logit: ratios follow logit differences
            # fp32 softmax of the same logits: the sum (and its reciprocal) is common to both and
            # cancels; each keeps the exp's rounding (2u), the final product's (u) and x - max's
            # (u |x - max|, top being the max); the reply rounds each logit to 5 places; doubled
            d = abs(c["logit"] - top["logit"])
            tol = 2 * (2 * 3 * U32 + U32 * (d + 1e-5)) + 2 * 0.5e-5
            assert math.log(c["prob"] / top["prob"]) == pytest.approx(c["logit"] - top["logit"], abs=tol)
        tokens.append(r["chosen"]["id"])
    wait_for(lambda: healthz(live_server)["kv"]["free_blocks"] == healthz(live_server)["kv"]["total_blocks"],
             what="every KV block back in the pool")


def test_seeded_steps_repeat_and_each_step_draws_afresh(ws):
    fields = dict(prompt=PROMPT, top=20, temperature=1.5, top_p=0.98, seed=11)
    a = ws.call("next_token", **fields)
    b = ws.call("next_token", **fields)
    assert a["chosen"]["id"] == b["chosen"]["id"] and a["seed"] == 11
    step = ws.call("next_token", tokens=[a["chosen"]["id"]], **fields)
    assert step["seed"] == 12, "step n draws with seed + n"
    finals = [c["final_prob"] for c in a["candidates"]]
    # a part of an fp32 softmax's weights: at most their sum, within softmax_sum_bound(V) of 1
    assert 0 < sum(finals) <= 1 + softmax_sum_bound(ws.hello["vocab_size"]) and a["chosen"]["final_prob"] > 0
    greedy = ws.call("next_token", prompt=PROMPT, top=3)
    assert greedy["temperature"] == 0 and greedy["chosen"]["final_prob"] == 1.0


def test_a_chat_message_goes_through_the_template(ws, live_server):
    r = ws.call("next_token", messages=[{"role": "user", "content": "Hi"}], top=2)
    ids = live_server.runtime.engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert [t["id"] for t in r["prompt"]] == ids and r["kv_cache_tokens"] == len(ids)


@pytest.mark.parametrize("fields,param", [
    ({"prompt": PROMPT, "tokens": "7"}, "tokens"),
    ({"prompt": PROMPT, "tokens": [49152]}, "tokens"),
    ({"prompt": PROMPT, "tokens": [1.5]}, "tokens"),
    ({"prompt": PROMPT, "tokens": [1] * 65}, "tokens"),          # over max_tokens_limit (64)
    ({"prompt": PROMPT, "top": 0}, "top"),
    ({"prompt": PROMPT, "top": 21}, "top"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "top_k": -2}, "top_k"),
    ({"prompt": PROMPT, "seed": -1}, "seed"),
    ({"prompt": PROMPT, "seed": "a"}, "seed"),
    ({"prompt": ""}, "prompt"),
    ({}, "messages"),
    ({"prompt": PROMPT, "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"prompt": PROMPT, "max_tokens": 3}, "max_tokens"),         # not a field of next_token
])
def test_bad_next_token_messages_name_the_field(ws, fields, param):
    err = ws.error({"type": "next_token", "id": "n1", **fields}, "n1")
    assert err["code"] == "invalid_request" and err["param"] == param, err
    assert ws.call("next_token", prompt=PROMPT, top=1)["type"] == "next_token", "the connection stays usable"


# ---- the real model: parity with transformers ----------------------------------------------------

@pytest.mark.real_model
def test_next_token_is_the_serving_engines_and_near_transformers(real_ws, hf_reference, logit_bounds, smollm_served,
                                                                 smollm, server):
    """The widget's numbers are the serving engine's own (the same computation in-process, to the
    rounding of the reply), and within the weight format's derived bound of transformers fp32
    (tests/bounds.py: LogitBounds.bound); greedy steps are the serving engine's own greedy tokens,
    and transformers' wherever its choice is clear of twice that bound (tests/greedy_steps.py)."""
    from core import SamplingParams
    from core.model.linear import q4_kernel_isa

    fmt = real_ws.hello["weight_format"]
    config = smollm_served.engine.config
    assert fmt == config.weight_format.value == "q4_1", "the server serves q4_1"
    bound = logit_bounds.bound(fmt, q4_kernel_isa(), config.lm_head_candidates)
    model, tokenizer = hf_reference
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].double()     # (V,)
    r = real_ws.call("next_token", prompt=PROMPT, top=20)
    assert r["type"] == "next_token", r
    assert [t["id"] for t in r["prompt"]] == ids

    (mine,) = smollm_served.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, top_candidates=20))
    expected = mine.candidates[-1][:20]
    assert [c["id"] for c in r["candidates"]] == [c.token_id for c in expected]
    for c, e in zip(r["candidates"], expected):
        assert c["prob"] == e.prob and c["logit"] == round(e.logit, 5), (c, e)
        assert abs(c["logit"] - float(logits[c["id"]])) < bound, (fmt, c, bound)

    tokens, kv = [], []
    for _ in range(3):
        step = real_ws.call("next_token", prompt=PROMPT, tokens=tokens, top=5)
        tokens.append(step["chosen"]["id"])
        kv.append(step["kv_cache_tokens"])
    check_engine_is_the_model(model, logit_bounds, smollm_served, smollm, [ids], [tokens])
    assert kv == [len(ids), len(ids) + 1, len(ids) + 2]
    kv_pool = get_json(server.base + "/healthz")["kv"]
    assert kv_pool["free_blocks"] == kv_pool["total_blocks"], "every KV block came back"


# ---- the page --------------------------------------------------------------------------------

def frames_sent(page):
    """Counts the next_token messages the page sends (to show reshaping needs no model pass)."""
    sent = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(payload)
                                          if '"next_token"' in str(payload) else None))
    return sent


def set_range(page, name, value):
    page.evaluate(f"""() => {{ const n = document.querySelector('{GEN} input[name="{name}"]');
        n.value = "{value}"; n.dispatchEvent(new Event("input", {{ bubbles: true }})); }}""")


@pytest.mark.browser
@pytest.mark.real_model
@pytest.mark.fresh_page   # frames_sent's listener is its own
def test_page_steps_on_the_engine_and_reshapes_live(pg, artifacts_dir, real_ws, server):
    page = pg.page
    sent = frames_sent(page)
    pg.goto("/embed/generation?" + urllib.parse.urlencode({"prompt": LONG_PROMPT, "top": 8}))
    wait_ready(page, GEN)
    assert page.get_attribute(f"{GEN} .gen-phase", "data-phase") == "prefill"
    ref = real_ws.call("next_token", prompt=LONG_PROMPT, top=8)
    # the same request computed again (batch-invariant: the same bits), shown as a JS number's
    # shortest repr (exact): equal
    assert figure_value(page, "top_prob") == ref["candidates"][0]["prob"]
    assert figure_value(page, "chosen_prob") == ref["chosen"]["prob"]
    assert figure_value(page, "tail_prob") == ref["tail_prob"]
    kv0 = figure_value(page, "kv_cache_tokens")
    assert kv0 == ref["kv_cache_tokens"] and figure_value(page, "step_ms") > 0
    for i in (1, 2):
        page.click(f"{GEN} .gen-step")
        page.wait_for_function(f"""() => document.querySelector('{GEN} [data-figure="kv_cache_tokens"]').dataset.value === "{int(kv0) + i}" """)
        assert page.get_attribute(f"{GEN} .gen-phase", "data-phase") == "decode"
        kv = figure_value(page, "kv_cache_tokens")
        cached, computed = figure_value(page, "num_cached_tokens"), figure_value(page, "num_computed_tokens")
        assert cached + computed == kv and cached > 0 and 1 <= computed <= 16
    steps = len(sent)
    # temperature, top-k and top-p reshape the shown bars at once, without another model pass
    logits = page.evaluate(f"""() => document.querySelector('{GEN} .gen-chart').data[0].text
        .map((t) => Number(t.split("logit ")[1]))""")
    set_range(page, "temperature", "1.5")
    shaped = page.evaluate(f"() => document.querySelector('{GEN} .gen-chart').data[1].x")
    # the hover text rounds logits to 3 places (h = 5e-4 off the page's); at temperature t a softmax
    # weight moves by a factor within e^(+-2h/t), and a renormalization over top-p's kept tokens by as
    # much again: |shaped - reshape| <= p (e^(4h/t) - 1) <= e^(4h/t) - 1 (float64 on both sides)
    shape_tol = math.expm1(4 * 0.5e-3 / 1.5)
    assert shaped == pytest.approx(reshape(logits, 1.5), abs=shape_tol)
    page.fill(f'{GEN} input[name="top_k"]', "3")
    set_range(page, "top_p", "0.6")
    shaped = page.evaluate(f"() => document.querySelector('{GEN} .gen-chart').data[1].x")
    assert shaped == pytest.approx(reshape(logits, 1.5, 3, 0.6), abs=shape_tol)
    assert sum(1 for p in shaped if p > 0) <= 3
    page.wait_for_timeout(300)
    assert len(sent) == steps, "reshaping sent nothing to the server"
    page.screenshot(path=str(artifacts_dir / "generation-stepped-1280.png"), full_page=True)
    kv_pool = get_json(server.base + "/healthz")["kv"]
    assert kv_pool["free_blocks"] == kv_pool["total_blocks"], "every KV block came back"
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_page_takes_its_options_from_the_url(pg, artifacts_dir):
    query = "?" + urllib.parse.urlencode({"prompt": "Name a colour.", "chat": 1, "temperature": 0.7, "top_k": 5,
                                         "top_p": 0.9, "seed": 3, "top": 5})
    shoot_widget(pg, "generation", artifacts_dir, query)
    page = pg.page
    pg.goto("/embed/generation" + query)
    wait_ready(page, GEN)
    assert page.input_value(f"{GEN} textarea") == "Name a colour."
    assert page.is_checked(f'{GEN} input[name="chat"]')
    assert page.input_value(f'{GEN} input[name="temperature"]') == "0.7"
    assert page.input_value(f'{GEN} input[name="top_k"]') == "5"
    assert page.input_value(f'{GEN} input[name="top_p"]') == "0.9"
    assert page.input_value(f'{GEN} input[name="seed"]') == "3"
    assert page.evaluate(f"() => document.querySelector('{GEN} .gen-chart').data[0].x.length") == 5
    assert "with seed 3" in page.inner_text(f"{GEN} .gen-chosen")
    assert "<|im_start|>" in page.inner_text(f"{GEN} .gen-sequence")
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_section_on_the_walkthrough_and_its_embed_snippet(pg, artifacts_dir):
    page = pg.page
    pg.goto("/#generation")
    section = page.locator("#generation")
    section.scroll_into_view_if_needed()
    wait_ready(page, GEN)
    set_range(page, "temperature", "0.8")
    page.wait_for_function("() => document.querySelector('#generation .snippet').textContent.includes('temperature=0.8')")
    section.screenshot(path=str(artifacts_dir / "generation-section-1280.png"))
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(600)
    section.screenshot(path=str(artifacts_dir / "generation-section-390.png"))
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px at 390 px"
    pg.assert_clean()
