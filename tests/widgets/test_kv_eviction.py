"""Widget `kv-eviction` (section 20): perplexity of a long held-out text under a sliding window,
with and without attention sinks, against full attention, and the KV memory each keeps."""

import math

import pytest

from conftest import drain, figure_value, on_a_phone, shoot_widget, wait_ready

KVE = '[data-widget="kv-eviction"]'


def check_reply(r, windows, sinks, per_token) -> None:
    assert r["windows"] == windows and r["sinks"] == sinks
    T = r["tokens"]
    assert T > max(windows)                                             # every window evicts something
    assert r["kv_bytes_per_token"] == per_token
    assert r["kv_bytes_full"] == T * per_token
    assert r["perplexity_full"] > 1 and math.isfinite(r["perplexity_full"])
    for row in r["rows"]:
        w = row["window"]
        assert r[f"kv_bytes_window_{w}"] == row["kv_bytes"] == (sinks + w) * per_token < r["kv_bytes_full"]
        assert r[f"perplexity_window_{w}"] == row["perplexity"] > 1
        assert r[f"perplexity_window_{w}_nosink"] == row["perplexity_nosink"] > 1
        assert row["perplexity"] != r["perplexity_full"]                # the rule changed the model's reading


def test_kv_eviction_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["kv-eviction"].messages
    assert m.type == "kv_eviction" and m.job
    assert m.fields == {"windows", "sinks"}


def test_kv_eviction_refuses_bad_input_naming_the_field(ws):
    for fields, param in [
        ({"windows": []}, "windows"),
        ({"windows": [100]}, "windows"),
        ({"windows": [64, 64]}, "windows"),
        ({"windows": "64"}, "windows"),
        ({"windows": [32, 64, 128, 256, 512, 32]}, "windows"),
        ({"sinks": 0}, "sinks"),
        ({"sinks": 17}, "sinks"),
        ({"sinks": "4"}, "sinks"),
    ]:
        err = ws.error({"type": "kv_eviction", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
        assert param in err["message"]


def test_the_job_on_the_tiny_model(tiny_loaded):
    from app.jobs import Progress
    from app.widgets.kv_eviction import eviction_job
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8), tiny_loaded)
    items, r = drain(eviction_job(engine, [32, 128], 4))
    progress = [i for i in items if isinstance(i, Progress)]
    assert progress and progress[-1].total == 1 + 2 * 2
    check_reply(r, [32, 128], 4, engine.view.info()["kv_bytes_per_token"])
    assert r["engine_window"] == 0 and r["engine_sinks"] == 0

    # other sinks: the model keeps each rule's perplexity, so only the two windows with 2 sinks run
    items, again = drain(eviction_job(engine, [32, 128], 2))
    assert [i.total for i in items if isinstance(i, Progress)][-1] == 2
    check_reply(again, [32, 128], 2, engine.view.info()["kv_bytes_per_token"])
    for key in ("perplexity_full", "perplexity_window_32_nosink", "perplexity_window_128_nosink"):
        assert again[key] == r[key], key
    # and every figure is what a model that kept nothing computes
    fresh = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8), tiny_loaded)
    items, alone = drain(eviction_job(fresh, [32, 128], 2))
    assert [i.total for i in items if isinstance(i, Progress)][-1] == 1 + 2 * 2   # its own model: all five run
    assert {k: v for k, v in again.items() if k != "machine"} == {k: v for k, v in alone.items() if k != "machine"}


@pytest.mark.real_model
def test_sinks_beat_the_window_alone_on_the_real_model(real_ws):
    """StreamingLLM's finding on SmolLM2: a trained model parks attention on the first tokens, so a
    window that drops them reads the text worse than the same window with a few sinks kept."""
    r = real_ws.job("kv_eviction", timeout=900, windows=[64, 256], sinks=4)
    value_bytes = {"fp32": 4, "bf16": 2}[real_ws.hello["kv_cache_dtype"]]   # bf16 where attention is (q4_1)
    assert r["kv_cache_dtype"] == real_ws.hello["kv_cache_dtype"]
    check_reply(r, [64, 256], 4, 2 * 30 * 3 * 64 * value_bytes)
    for row in r["rows"]:
        assert row["perplexity_nosink"] > row["perplexity"] > r["perplexity_full"]


@pytest.mark.browser
@pytest.mark.real_model
def test_kv_eviction_page_is_ready_with_every_figure_keyed(pg, real_ws, artifacts_dir):
    query = "?windows=64,256&sinks=4"
    shoot_widget(pg, "kv-eviction", artifacts_dir, query, ready_timeout=900_000)
    page = pg.page
    pg.goto(f"/embed/kv-eviction{query}")
    wait_ready(page, KVE, 900_000)
    r = real_ws.job("kv_eviction", timeout=900, windows=[64, 256], sinks=4)   # the page's job, from the cache
    keys = ["perplexity_full", "kv_bytes_full"] + [f"{k}_{w}{s}" for w in (64, 256)
                                                   for k, s in (("perplexity_window", ""), ("perplexity_window", "_nosink"),
                                                                ("kv_bytes_window", ""))]
    for key in keys:
        assert figure_value(page, key) == pytest.approx(r[key], rel=1e-9), key
        assert page.locator(f'{KVE} figure:has([data-figure="{key}"]) .badge').count() >= 1, key
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_kv_eviction_on_the_walkthrough_at_phone_width(pg, artifacts_dir):
    # one of the default windows with the default sinks: runs the server keeps (kv_eviction._KEPT)
    # from the default job, so the phone's page costs no new read of the long text
    snippet = on_a_phone(pg, "kv-eviction", "?kv-eviction.windows=64", artifacts_dir, 900_000)
    assert "/embed/kv-eviction?" in snippet and "windows=64" in snippet and "256" not in snippet
    pg.assert_clean()
