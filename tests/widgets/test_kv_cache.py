"""Widget `kv-cache` (section 9): N tokens with the KV cache and without it.

The outputs must be the same tokens both ways (greedy), and the work counted from the engine's
own step records must be the triangle N P + N (N - 1) / 2 without the cache and P + N - 1 with it.
"""

import pytest
from conftest import drain, figure_value, on_a_phone, shoot_widget, wait_ready
from greedy_steps import check_engine_is_the_model

KV = '[data-widget="kv-cache"]'
PROMPT = "The capital of France is"


def triangle(P: int, N: int) -> int:
    """Tokens through the layers when step n (1..N) recomputes the prompt and the n - 1 before it."""
    return sum(P + n - 1 for n in range(1, N + 1))


def check_counts(r, P: int, N: int) -> None:
    assert (r["prompt_tokens"], r["max_tokens"]) == (P, N)
    with_steps = [s["tokens"] for s in r["with_cache"]["steps"]]
    without_steps = [s["tokens"] for s in r["without_cache"]["steps"]]
    assert with_steps == [P] + [1] * (N - 1)                          # the flat line
    assert without_steps == [P + n for n in range(N)]                 # the growing triangle
    assert r["tokens_computed_without_cache"] == triangle(P, N) == sum(without_steps)
    assert r["tokens_computed_with_cache"] == P + N - 1 == sum(with_steps)
    # app/widgets/kv_cache.py's summary() sums the same numbers in the same order and divides them: exact
    assert r["with_cache_ms"] == sum(s["ms"] for s in r["with_cache"]["steps"])
    assert r["without_cache_ms"] == sum(s["ms"] for s in r["without_cache"]["steps"])
    assert r["speedup"] == r["without_cache_ms"] / r["with_cache_ms"]
    m = r["machine"]
    assert m["threads"] >= 1 and m["cpu_count"] >= 1 and m["measured_at"].startswith("20")


def test_kv_cache_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["kv-cache"].messages
    assert m.type == "kv_cache" and m.job
    assert m.fields == {"text", "max_tokens", "run"}


def test_kv_cache_refuses_bad_input_naming_the_field(ws):
    for fields, param in [
        ({}, "text"),
        ({"text": ""}, "text"),
        ({"text": 5}, "text"),
        ({"text": "word " * 100}, "text"),                    # over the server's max_inspect_tokens
        ({"text": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"text": PROMPT, "max_tokens": 65}, "max_tokens"),
        ({"text": PROMPT, "max_tokens": "8"}, "max_tokens"),
        ({"text": PROMPT, "run": -1}, "run"),
    ]:
        err = ws.error({"type": "kv_cache", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
        assert param in err["message"]
    # the connection is still usable
    r = ws.job("kv_cache", text=PROMPT, max_tokens=2)
    assert r["type"] == "kv_cache", r


def test_a_prompt_over_the_comparisons_bound_names_text(tiny_loaded):
    """128 tokens at most, even where the server's max_inspect_tokens allows more."""
    from types import SimpleNamespace

    from app.widgets.kv_cache import MAX_PROMPT_TOKENS, kv_cache
    from core.errors import InvalidParameter

    call = SimpleNamespace(msg={"text": "word " * 300}, tokenizer=tiny_loaded.tokenizer,
                           config=SimpleNamespace(max_inspect_tokens=1024), job=lambda *a: None)
    with pytest.raises(InvalidParameter) as info:
        kv_cache(call)
    assert info.value.param == "text" and str(MAX_PROMPT_TOKENS) in str(info.value)


def test_with_and_without_the_cache_give_the_same_tokens_tiny(ws):
    P = len(ws.call("tokenize", text=PROMPT)["tokens"])
    N = 12
    r = ws.job("kv_cache", text=PROMPT, max_tokens=N)
    assert r["type"] == "kv_cache", r
    assert len(r["with_cache"]["token_ids"]) == N
    assert r["with_cache"]["token_ids"] == r["without_cache"]["token_ids"] and r["same"] is True
    assert r["with_cache"]["text"] == r["without_cache"]["text"]
    check_counts(r, P, N)
    assert [t["id"] for t in r["prompt"]] == [t["id"] for t in ws.call("tokenize", text=PROMPT)["tokens"]]


@pytest.mark.real_model
def test_with_and_without_the_cache_give_the_engines_and_the_models_tokens(real_ws, hf_reference, logit_bounds,
                                                                         smollm_served, smollm):
    """The same tokens both ways (exact), the serving engine's own greedy tokens (exact), and
    transformers' wherever its choice is clear of the format's bound; our engine in fp32 gives
    transformers' on the same prompt (tests/greedy_steps.py)."""
    hf_model, hf_tok = hf_reference
    N = 8
    r = real_ws.job("kv_cache", text=PROMPT, max_tokens=N)
    assert r["type"] == "kv_cache", r
    ids = [t["id"] for t in r["prompt"]]
    assert ids == hf_tok(PROMPT, add_special_tokens=False)["input_ids"]
    check_counts(r, len(ids), N)
    assert r["with_cache"]["token_ids"] == r["without_cache"]["token_ids"] and r["same"] is True
    check_engine_is_the_model(hf_model, logit_bounds, smollm_served, smollm, [ids], [r["with_cache"]["token_ids"]])


@pytest.mark.browser
@pytest.mark.real_model
def test_kv_cache_page_takes_options_from_the_url(pg, real_ws, artifacts_dir):
    query = "?text=Water+boils+at&max_tokens=6"
    shoot_widget(pg, "kv-cache", artifacts_dir, query, ready_timeout=180_000)
    page = pg.page
    pg.goto(f"/embed/kv-cache{query}")
    wait_ready(page, KV, 180_000)
    assert page.input_value(f'{KV} input[name="text"]') == "Water boils at"
    assert page.input_value(f'{KV} input[name="max_tokens"]') == "6"
    r = real_ws.job("kv_cache", text="Water boils at", max_tokens=6)     # the page's job, from the cache
    P = r["prompt_tokens"]
    assert figure_value(page, "tokens_computed_without_cache") == triangle(P, 6)
    assert figure_value(page, "tokens_computed_with_cache") == P + 6 - 1
    # the figures are the reply's own numbers (data-value: String() of the JSON's float64, read back exactly)
    assert figure_value(page, "speedup") == r["speedup"]
    assert figure_value(page, "with_cache_ms") == r["with_cache_ms"]
    assert figure_value(page, "without_cache_ms") == r["without_cache_ms"]
    assert page.locator(f"{KV} .kv-tokens").nth(0).locator(".tok").count() == 6
    assert page.locator(f"{KV} .kv-differs").count() == 0
    assert "Identical" in page.text_content(f"{KV} .kv-verdict")
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_kv_cache_on_the_walkthrough_at_phone_width(pg, artifacts_dir):
    snippet = on_a_phone(pg, "kv-cache", "?kv-cache.max_tokens=5", artifacts_dir, 180_000)
    assert "/embed/kv-cache?" in snippet and "max_tokens=5" in snippet
    pg.assert_clean()


def test_the_job_runs_one_engine_step_per_slice_and_counts_each_generation_step(tiny_loaded):
    """A prompt longer than a prefill chunk: its prefills take several engine steps (slices), yet
    each generation step's work is still P + n - 1 tokens without the cache and P, 1, 1 ... with it."""
    from app.jobs import Progress
    from app.widgets.kv_cache import CHUNK_TOKENS, compare_job
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8), tiny_loaded)
    ids = tiny_loaded.tokenizer.encode("one two three four five six seven eight nine ten " * 4)[:CHUNK_TOKENS + 8]
    P, N = len(ids), 5
    gen = compare_job(engine, ids, N, 0)
    items, r = drain(gen)

    def chunks(n: int) -> int:
        return -(-n // CHUNK_TOKENS)
    assert len(items) == 1 + chunks(P) + N - 1 + sum(chunks(P + i) for i in range(N))
    progress = [i for i in items if isinstance(i, Progress)]
    assert progress[-1].done == progress[-1].total == len(items)
    check_counts(r, P, N)
    assert r["same"] is True
    assert engine.view.stats()["kv"]["used_blocks"] == 0            # the serving engine was never touched
