"""Widget `quantization` (section 20): the engine's four weight formats side by side, measured.

Sane values whatever the machine: fp32 agrees with itself (top-5 agreement 1, KL 0), every share is
a share, the bytes shrink with the format, every position has its five candidates in every format.
On the real model, each format's held-out perplexity lies within a stated bound of fp32's.
"""

import math

import pytest

from conftest import drain, figure_value, on_a_phone, shoot_widget, wait_ready

QUANT = '[data-widget="quantization"]'
TEXT = "The capital of France is Paris, and the capital of Italy is"
FORMATS = ("fp32", "bf16", "q8_0", "q4_1")
KEYS = ("weight_bytes", "decode_tokens_per_s", "top5_agreement", "kl", "perplexity")
FIGURES = ("weight_bytes_fp32", "weight_bytes_bf16", "weight_bytes_q8_0", "weight_bytes_q4_1",
           "decode_tokens_per_s_fp32", "decode_tokens_per_s_bf16", "decode_tokens_per_s_q8_0", "decode_tokens_per_s_q4_1",
           "top5_agreement_fp32", "top5_agreement_bf16", "top5_agreement_q8_0", "top5_agreement_q4_1",
           "kl_fp32", "kl_bf16", "kl_q8_0", "kl_q4_1",
           "perplexity_fp32", "perplexity_bf16", "perplexity_q8_0", "perplexity_q4_1")   # the contract

# Held-out perplexity of each format against fp32's, |ppl_F / ppl_fp32 - 1| at most (the real model's
# test). The bound, from the arithmetic: a format's logits are fp32's plus a perturbation, which
# raises the expected negative log-likelihood of text drawn from fp32's distribution by the KL
# (fp32 || F) per token, a systematic shift, and moves each token's by about sqrt(2 KL), either
# sign, about sqrt(2 KL / 2040) averaged over 2,040 held-out tokens. Every format's mean KL per
# token is below KL_MAX: measured on 2026-12-04 (Zen 4, `python -m bench`'s quantization table,
# 2,048 positions), bf16 3.0e-4, q8_0 3.8e-3 and q4_1 2.7e-3 with 8-bit activations (AVX-512
# VNNI; 7.3e-5 and 1.3e-3 before, with bfloat16 and 16-bit activations), perplexities fp32 14.947,
# q8_0 14.977 (+0.20%), q4_1 15.004 (+0.38%). The bound is KL_MAX plus 5 times the noise: a format
# that moved the logits systematically (a wrong scale, a wrong layout) breaks it by far.
KL_MAX = 4e-3
PERPLEXITY_BOUND = {f: KL_MAX + 5 * math.sqrt(2 * KL_MAX / 2040) for f in ("bf16", "q8_0", "q4_1")}
PERPLEXITY_BOUND_REASONS = {
    "bf16": "weights and activations rounded to 8 significant bits (2^-9 relative each)",
    "q8_0": "each weight re-quantized from the file's 4-bit grid to 8 bits per group of 32, at most "
            "max|w|/254 off: a new error the 4-bit grid did not have (hence q8_0's larger KL than q4_1's), "
            "and the activations rounded to 8-bit (AVX-512 VNNI) or 16-bit integers per group of 32",
    "q4_1": "the file's own format: the weights are exactly fp32's, so only the activations' rounding "
            "(8-bit integers per group of 32, llama.cpp's), attention's operands rounded to bfloat16 "
            "(2^-9 relative each) and the LM head's Q8_0 outside the 64 candidates recomputed in fp32 remain",
}


def check_reply(r, n_tokens: int, serving: str) -> None:
    assert r["type"] == "quantization", r
    assert [f["format"] for f in r["formats"]] == list(FORMATS)
    assert r["serving_format"] == serving
    assert len(r["tokens"]) == n_tokens
    assert r["top5_agreement_fp32"] == 1.0 and r["kl_fp32"] == 0.0
    b = [r[f"weight_bytes_{f}"] for f in FORMATS]
    assert b[0] > b[1] > b[2] > b[3] > 0, b                       # fp32 > bf16 > q8_0 > q4_1
    for f in FORMATS:
        assert 0.0 <= r[f"top5_agreement_{f}"] <= 1.0
        assert r[f"kl_{f}"] >= 0.0 and math.isfinite(r[f"kl_{f}"])
        assert r[f"decode_tokens_per_s_{f}"] > 0
        assert r[f"perplexity_{f}"] > 1.0 and math.isfinite(r[f"perplexity_{f}"])
    from core.model.linear import q4_kernel_isa
    for row in r["formats"]:                   # attention rounds its operands for q4_1 on our kernel only
        own_q4 = row["format"] == "q4_1" and row["product"] == "own" and q4_kernel_isa() != ""
        assert row["attention_operands"] == ("bf16" if own_q4 else "fp32"), row["format"]
        assert len(row["top"]) == n_tokens and all(len(c) == 5 for c in row["top"])
        assert all(c[0]["prob"] >= c[-1]["prob"] for c in row["top"])
        assert len(row["top5_same"]) == n_tokens
        assert row["top5_agreement"] == pytest.approx(sum(row["top5_same"]) / n_tokens)
    fp32 = r["formats"][0]
    assert all(fp32["top5_same"])
    assert r["held_out"]["pieces"] >= 1 and r["held_out"]["predicted_tokens"] > 0


def test_quantization_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["quantization"].messages
    assert m.type == "quantization" and m.job
    assert m.fields == {"text", "run"}


def test_quantization_refuses_bad_input_naming_the_field(ws):
    for fields, param in [
        ({}, "text"),
        ({"text": ""}, "text"),
        ({"text": 5}, "text"),
        ({"text": "word " * 100}, "text"),                    # over the server's max_inspect_tokens
        ({"text": TEXT, "run": -1}, "run"),
        ({"text": TEXT, "run": "1"}, "run"),
    ]:
        err = ws.error({"type": "quantization", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
        assert param in err["message"]


@pytest.mark.slow   # every weight format's held-out perplexity
def test_four_formats_on_the_tiny_model(ws):
    n = len(ws.call("tokenize", text=TEXT)["tokens"])
    r = ws.job("quantization", timeout=600, text=TEXT)
    check_reply(r, n, "q4_1")


@pytest.mark.slow   # every weight format's held-out perplexity
def test_the_job_leaves_the_serving_engine_alone_and_keeps_perplexities(tiny_loaded):
    """Each format on its own sibling; the held-out perplexities are computed once per model."""
    from app.jobs import Progress
    from app.widgets.quantization import _PERPLEXITY, quantization_job
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", weight_format="bf16", num_kv_blocks=8), tiny_loaded)
    ids = tiny_loaded.tokenizer.encode(TEXT)
    items, r = drain(quantization_job(engine, ids, 0))
    progress = [i for i in items if isinstance(i, Progress)]
    assert progress and all(p.done <= p.total for p in progress)
    assert [p.done for p in progress] == sorted(p.done for p in progress)
    check_reply({"type": "quantization", **r}, len(ids), "bf16")
    assert set(_PERPLEXITY[engine.view.model]) == set(FORMATS)
    items_again, again = drain(quantization_job(engine, ids, 1))
    assert len(items_again) < len(items)                          # the held-out pieces are not run again
    for f in FORMATS:
        assert again[f"perplexity_{f}"] == r[f"perplexity_{f}"]
        assert again[f"top5_agreement_{f}"] == r[f"top5_agreement_{f}"] and again[f"kl_{f}"] == r[f"kl_{f}"]
    assert engine.view.stats()["kv"]["used_blocks"] == 0


@pytest.mark.real_model
def test_each_formats_perplexity_stays_within_its_bound_of_fp32(real_ws):
    r = real_ws.job("quantization", timeout=900, text=TEXT)
    n = len(real_ws.call("tokenize", text=TEXT)["tokens"])
    check_reply(r, n, r["serving_format"])
    fp32 = r["perplexity_fp32"]
    for f, bound in PERPLEXITY_BOUND.items():
        assert abs(r[f"perplexity_{f}"] / fp32 - 1) <= bound, (f, r[f"perplexity_{f}"], fp32, PERPLEXITY_BOUND_REASONS[f])


@pytest.mark.browser
@pytest.mark.real_model
def test_quantization_page_is_ready_with_every_figure_badged_and_keyed(pg, real_ws, artifacts_dir):
    query = "?text=The+capital+of+France+is+Paris%2C+and+the+capital+of+Italy+is&position=3"
    shoot_widget(pg, "quantization", artifacts_dir, query, ready_timeout=900_000)
    page = pg.page
    pg.goto(f"/embed/quantization{query}")
    wait_ready(page, QUANT, 900_000)
    r = real_ws.job("quantization", timeout=900, text=TEXT)             # the page's job, from the cache
    assert set(FIGURES) == {f"{key}_{f}" for key in KEYS for f in FORMATS}
    for name in FIGURES:
        assert figure_value(page, name) == pytest.approx(r[name], rel=1e-9), name
        badged = page.locator(f'{QUANT} figure:has([data-figure="{name}"]) .badge')
        assert badged.count() >= 1, f"{name} has no badge"
    assert figure_value(page, "top5_agreement_fp32") == 1 and figure_value(page, "kl_fp32") == 0
    assert page.locator(f"{QUANT} .quant-column").count() == 4
    assert page.locator(f"{QUANT} .quant-tokens .quant-chosen").get_attribute("data-index") == "3"
    assert r["serving_format"] in page.text_content(f"{QUANT} .quant-serving")
    page.locator(f'{QUANT} .quant-tokens .tok[data-index="1"]').click()
    assert page.locator(f"{QUANT} .quant-tokens .quant-chosen").get_attribute("data-index") == "1"
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_quantization_on_the_walkthrough_at_phone_width(pg, artifacts_dir):
    snippet = on_a_phone(pg, "quantization", "?quantization.position=2", artifacts_dir, 900_000)
    assert "/embed/quantization?" in snippet and "position=2" in snippet
    pg.assert_clean()
