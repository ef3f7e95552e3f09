"""Widget `attention`: binning, the messages on the tiny model, parity with transformers on the
real model, the size bound of a 1,000-token reply, and the page (URL options, figures, clicks)."""

import json
import math
import urllib.parse

import pytest
import torch

from app.widgets.attention import DIGITS, MAX_CELLS, bin_size_for, binned
from bounds import OTHER_KERNELS_ERROR_RATIO, U32, U64, against_f64, gamma, llama_f64, softmax_sum_bound
from conftest import figure_value, shoot_widget, wait_ready

# a reply's weights are rounded to DIGITS decimals: half a unit of the last, plus float64's own
# representation error of the rounded decimal (below 1e-15 for numbers up to 1)
SHOWN = 0.5 * 10 ** -DIGITS + 1e-15

ATTN = '[data-widget="attention"]'
SHORT = "The cat sat on the mat because it was tired."
LONG_SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank, and then it runs away."
REPLY_BOUND = 800_000  # bytes: MAX_CELLS numbers of at most ~10 characters, plus 1,024 tokens


def binned_rows_bound(T: int, b: int) -> float:
    """|row sum of binned(fp32 softmax of T keys, b) - 1|, the row summed exactly: each query's fp32
    weights sum to within softmax_sum_bound(T) of 1; a bin is a sum of b x b of them in two fp32
    stages (at most 2b roundings on each term's path, positive terms: gamma_2b relative, any order)
    and a divide (u), so the row's exact sum moves by (gamma_2b + u) (1 + softmax_sum_bound(T))."""
    return softmax_sum_bound(T) + (gamma(2 * b) + U32) * (1 + softmax_sum_bound(T))


def full(rows):
    """Ragged lower-triangle rows -> a square tensor with zeros above the diagonal."""
    n = len(rows)
    m = torch.zeros(n, n, dtype=torch.float64)
    for i, row in enumerate(rows):
        assert len(row) == i + 1, "row i carries keys 0..i"
        m[i, : i + 1] = torch.tensor(row, dtype=torch.float64)
    return m


def causal_softmax(H, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(H, T, T, generator=g) * 3
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


# ---- binning, without a model -------------------------------------------------------------------

def test_bin_size_is_the_smallest_that_fits_the_budget():
    assert bin_size_for(30, 9) == 1
    for T, heads in [(1000, 1), (1000, 9), (1024, 9), (361, 1), (362, 1)]:
        b = bin_size_for(T, heads)
        n = -(-T // b)
        assert heads * n * (n + 1) // 2 <= MAX_CELLS
        if b > 1:
            m = -(-T // (b - 1))
            assert heads * m * (m + 1) // 2 > MAX_CELLS, "a smaller bin would have fitted"
    assert bin_size_for(1000, 1) == 3 and bin_size_for(1000, 9) == 9


@pytest.mark.parametrize("T,b", [(10, 3), (12, 4), (7, 1), (100, 9)])
def test_binned_cells_are_mean_of_summed_block_weights(T, b):
    w = causal_softmax(2, T)
    out = binned(w, b)
    n = -(-T // b)
    assert out.shape == (2, n, n)
    for h in range(2):
        for I in range(n):
            queries = range(I * b, min(T, (I + 1) * b))
            for J in range(n):
                keys = slice(J * b, min(T, (J + 1) * b))
                expected = sum(float(w[h, q, keys].sum()) for q in queries) / len(queries)
                # positive fp32 terms: binned's two-stage sum (2b roundings on a term's path) and divide,
                # the b-term fp32 sums here and our float64 sum and divide (under u32 each): relative
                assert float(out[h, I, J]) == pytest.approx(expected, rel=gamma(3 * b + 3), abs=0)
    # the row's exact sum (binned_rows_bound), then the fp32 sum of its n bins (gamma_n of a sum near 1)
    tol = binned_rows_bound(T, b) + gamma(n) * (1 + binned_rows_bound(T, b))
    assert torch.allclose(out.sum(-1), torch.ones(2, n), rtol=0, atol=tol), "binned rows still sum to 1"
    assert torch.all(out.triu(diagonal=1) == 0), "blocks above the diagonal stay masked"


# ---- the messages, on the tiny model ------------------------------------------------------------

def test_head_all_is_the_models_own_weights(ws, live_server):
    from core.inspect import probes
    engine = live_server.runtime.engine
    reply = ws.call("attention", text=SHORT, layer=1, head="all")
    assert reply["type"] == "attention", reply
    ids = engine.tokenizer.encode(SHORT)
    H, Hkv = engine.model_config.num_heads, engine.model_config.num_kv_heads
    assert reply["num_tokens"] == len(ids) and [t["id"] for t in reply["tokens"]] == ids
    assert reply["heads"] == list(range(H)) and reply["bin_size"] == 1
    assert reply["kv_heads"] == [h // (H // Hkv) for h in range(H)]
    expected = probes.run(engine.view.reference_model, ids, attention={1})[1].attention.double()   # (H, T, T), fp32
    got = torch.stack([full(rows) for rows in reply["weights"]])
    assert torch.allclose(got, expected, rtol=0, atol=SHOWN)          # the same model's weights, rounded
    T = len(ids)                                                         # T rounded weights, one fp32 softmax
    assert torch.allclose(got.sum(-1), torch.ones(H, T, dtype=torch.float64), rtol=0, atol=T * SHOWN + softmax_sum_bound(T))
    assert reply["sink_weight"] == pytest.approx(expected[:, 1:, 0].mean(-1).tolist(), abs=SHOWN)
    assert reply["previous_weight"] == pytest.approx(
        expected.diagonal(offset=-1, dim1=1, dim2=2).mean(-1).tolist(), abs=SHOWN)

    one = ws.call("attention", text=SHORT, layer=1, head=2)
    assert one["heads"] == [2] and one["kv_heads"] == [2 // (H // Hkv)]
    assert one["weights"][0] == reply["weights"][2]
    row = ws.call("attention_row", text=SHORT, layer=1, head=2, query=4)
    assert row["weights"][0] == pytest.approx(expected[2, 4, :5].tolist(), abs=SHOWN)
    rows = ws.call("attention_row", text=SHORT, layer=1, head="all", query=0)
    assert rows["weights"] == [[1.0]] * H, "the first token can only look at itself"


@pytest.mark.parametrize("fields,param", [
    ({"text": SHORT, "layer": 2, "head": 0}, "layer"),          # the tiny model has layers 0 and 1
    ({"text": SHORT, "layer": -1, "head": 0}, "layer"),
    ({"text": SHORT, "layer": "1", "head": 0}, "layer"),
    ({"text": SHORT, "layer": 0, "head": 4}, "head"),           # 4 heads: 0..3
    ({"text": SHORT, "layer": 0, "head": "ALL"}, "head"),
    ({"text": SHORT, "layer": 0, "head": 1.5}, "head"),
    ({"text": SHORT, "layer": 0}, "head"),
    ({"text": "", "layer": 0, "head": 0}, "text"),
    ({"text": 42, "layer": 0, "head": 0}, "text"),
    ({"text": "word " * 80, "layer": 0, "head": 0}, "text"),   # over max_inspect_tokens (64)
    ({"layer": 0, "head": 0}, "text"),
    ({"text": SHORT, "layer": 0, "head": 0, "query": 3}, "query"),  # not a field of attention
])
def test_bad_attention_messages_name_the_field(ws, fields, param):
    err = ws.error({"type": "attention", "id": "a1", **fields}, "a1")
    assert err["code"] == "invalid_request" and err["param"] == param, err
    assert ws.call("attention", text="ok", layer=0, head=0)["type"] == "attention", "the connection stays usable"


@pytest.mark.parametrize("query", [11, -1, "2", None])
def test_bad_query_names_the_field(ws, query):
    fields = {"text": SHORT, "layer": 0, "head": 0}
    if query is not None:
        fields["query"] = query
    err = ws.error({"type": "attention_row", "id": "q1", **fields}, "q1")
    assert err["param"] == "query", err
    assert "from 0 to 10" in err["message"] or "required" in err["message"]


def test_the_layer_is_computed_once_for_every_head(ws, live_server):
    text = "Heads of one layer share one pass through the model."
    before = live_server.runtime.jobs.stats()["slices"]
    ws.call("attention", text=text, layer=1, head=0)
    first = live_server.runtime.jobs.stats()["slices"] - before
    before = live_server.runtime.jobs.stats()["slices"]
    ws.call("attention", text=text, layer=1, head=3)
    ws.call("attention_row", text=text, layer=1, head=3, query=2)
    again = live_server.runtime.jobs.stats()["slices"] - before
    assert first > 4 and again <= 4, (first, again)  # the pass is sliced; the others reuse its weights


# ---- the real model: parity with transformers, and a 1,000-token text ----------------------------

@pytest.mark.real_model
def test_head_all_matches_transformers_eager_attentions(real_ws, hf_reference, smollm_loaded):
    model, tokenizer = hf_reference
    layer = 5
    reply = real_ws.job("attention", text=SHORT, layer=layer, head="all")
    assert reply["type"] == "attention", reply
    ids = tokenizer.encode(SHORT, add_special_tokens=False)
    assert [t["id"] for t in reply["tokens"]] == ids
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")   # sdpa returns no weights
    try:
        with torch.inference_mode():
            out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    expected = out.attentions[layer][0].double()                        # (H, T, T)
    got = torch.stack([full(rows) for rows in reply["weights"]])
    assert got.shape == expected.shape == (9, len(ids), len(ids))
    # against float64 (tests/bounds.py): layer 5's attention weights of the same fp32 weights in float64;
    # transformers' eager fp32 attention and the server's fp32 reference model are each another fp32
    # computation of the same function, within OTHER_KERNELS_ERROR_RATIO times our fp32 model's error
    # plus 4 ulps of 1; the reply rounds to DIGITS places on top (SHOWN)
    from core.inspect import probes
    from core.model.model import Transformer
    ours = Transformer.from_state_dict(smollm_loaded.config, smollm_loaded.state_dict)
    taps = {}
    llama_f64(ours, ids, taps=taps)
    exact = taps[("probs", layer)]
    with torch.inference_mode():
        mine = probes.run(ours, ids, attention={layer})[layer].attention.double()
    err_hf, each, err_ours = against_f64(expected, mine, exact, OTHER_KERNELS_ERROR_RATIO)
    assert err_hf <= each, (err_hf, each, err_ours)
    assert (got - expected).abs().max() <= SHOWN + 2 * each
    T = len(ids)                                                         # T rounded weights, one fp32 softmax
    assert torch.allclose(got.sum(-1), torch.ones(9, T, dtype=torch.float64), rtol=0, atol=T * SHOWN + softmax_sum_bound(T))
    assert torch.all(got.triu(diagonal=1) == 0)
    assert reply["kv_heads"] == [h // 3 for h in range(9)]


@pytest.mark.real_model
@pytest.mark.parametrize("head,bin_size", [("all", 9), (0, 3)])
def test_a_1000_token_reply_is_bounded_and_its_rows_sum_to_one(real_ws, head, bin_size):
    text = " ".join([LONG_SENTENCE] * 50)                 # 1,000 tokens
    reply = real_ws.job("attention", text=text, layer=0, head=head)
    assert reply["type"] == "attention", reply
    tokens = reply["num_tokens"]
    assert tokens == 1000
    size = len(json.dumps(reply).encode())
    assert size < REPLY_BOUND, size
    assert reply["bin_size"] == bin_size
    n = reply["num_bins"]
    assert n == math.ceil(tokens / bin_size)
    for rows in reply["weights"]:
        m = full(rows)
        assert m.shape == (n, n)
        # each of the n numbers rounded to DIGITS places (SHOWN), the bins' own rounding, our float64 sum
        assert (m.sum(-1) - 1).abs().max() <= n * SHOWN + binned_rows_bound(tokens, bin_size) + gamma(n, U64)
        assert torch.all(m.triu(diagonal=1) == 0)
    # the exact row of the last token, from the weights the job kept
    row = real_ws.job("attention_row", text=text, layer=0, head=0, query=tokens - 1)
    # tokens numbers rounded to DIGITS places, one fp32 softmax, our float64 sum
    assert len(row["weights"][0]) == tokens and sum(row["weights"][0]) == pytest.approx(
        1.0, abs=tokens * SHOWN + softmax_sum_bound(tokens) + gamma(tokens, U64))


# ---- the page --------------------------------------------------------------------------------

@pytest.mark.browser
@pytest.mark.real_model
def test_page_takes_options_from_the_url_and_shows_real_figures(pg, artifacts_dir, real_ws):
    query = "?" + urllib.parse.urlencode({"text": SHORT, "layer": 4, "head": 7, "query": 5})
    shoot_widget(pg, "attention", artifacts_dir, query)
    page = pg.page
    pg.goto("/embed/attention" + query)
    wait_ready(page, ATTN)
    assert page.input_value(f"{ATTN} textarea") == SHORT
    assert page.input_value(f'{ATTN} select[name="layer"]') == "4"
    assert page.input_value(f'{ATTN} select[name="head"]') == "7"
    assert page.input_value(f'{ATTN} input[name="query"]') == "5"
    reply = real_ws.job("attention", text=SHORT, layer=4, head=7)
    assert figure_value(page, "num_tokens") == reply["num_tokens"]
    assert figure_value(page, "bin_size") == 1
    assert figure_value(page, "kv_head") == 2                     # head 7 reads KV head 7 // 3
    # the figures are the reply's own numbers (data-value: String() of the JSON's float64, read back exactly)
    assert figure_value(page, "sink_weight") == reply["sink_weight"][0]
    assert figure_value(page, "previous_weight") == reply["previous_weight"][0]
    assert figure_value(page, "max_weight") == max(reply["weights"][0][5])
    # clicking a token makes it the query: its row becomes the bars and the figures follow
    page.click(f'{ATTN} .attn-chips .tok[data-index="8"]')
    page.wait_for_function(f"""() => document.querySelector('{ATTN} input[name="query"]').value === "8" """)
    assert figure_value(page, "max_weight") == max(reply["weights"][0][8])
    page.wait_for_function(f"() => document.querySelector('{ATTN} .attn-row').data?.[0]?.y.length === 9")
    bars = page.evaluate(f"() => document.querySelector('{ATTN} .attn-row').data[0].y")
    assert bars == reply["weights"][0][8]                         # the reply's row, through JSON: exact
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_small_multiples_and_the_embed_snippet(pg, artifacts_dir):
    page = pg.page
    pg.goto("/?attention.head=all&attention.layer=6#attention")
    section = page.locator("#attention")
    section.scroll_into_view_if_needed()
    wait_ready(page, ATTN)
    panels = page.evaluate(f"() => document.querySelector('{ATTN} .attn-map').data.length")
    assert panels == 9, "one heatmap per head of the layer"
    snippet = page.locator("#attention .snippet")
    page.select_option(f'{ATTN} select[name="layer"]', "7")
    page.wait_for_function("() => document.querySelector('#attention .snippet').textContent.includes('layer=7')")
    assert "head=all" in snippet.text_content()
    wait_ready(page, ATTN)
    page.wait_for_function(f"""() => document.querySelector('{ATTN}').classList.contains('busy') === false""")
    section.screenshot(path=str(artifacts_dir / "attention-section-1280.png"))
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(600)
    section.screenshot(path=str(artifacts_dir / "attention-section-390.png"))
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px at 390 px"
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_a_1000_token_text_stays_usable(pg, artifacts_dir, real_ws):
    text = " ".join([LONG_SENTENCE] * 50)
    page = pg.page
    pg.goto("/embed/attention?" + urllib.parse.urlencode({"text": text, "layer": 1, "head": 2}))
    wait_ready(page, ATTN, timeout=120_000)
    tokens = int(figure_value(page, "num_tokens"))
    assert tokens == 1000
    assert figure_value(page, "bin_size") == 3
    assert page.locator(f"{ATTN} .attn-chips .tok").count() == 0, "no thousand token chips"
    # the page stays light: no element per token (the binned map is one plot), so nothing grows
    # with the text's length; and a new query fetches its exact row
    nodes = page.locator(f"{ATTN} *").count()
    assert nodes < tokens, f"{nodes} elements for {tokens} tokens"
    page.fill(f'{ATTN} input[name="query"]', "500")
    page.dispatch_event(f'{ATTN} input[name="query"]', "change")
    page.wait_for_function(f"""() => document.querySelector('{ATTN} .attn-row-title').textContent.startsWith('Token #500 ')""",
                           timeout=60_000)
    row = real_ws.job("attention_row", text=text, layer=1, head=2, query=500)["weights"][0]
    assert figure_value(page, "max_weight") == max(row)          # the job's row, as the page got it: exact
    page.screenshot(path=str(artifacts_dir / "attention-1000-tokens-1280.png"))
    pg.assert_clean()
