"""Widget `phases` (section 8): prefill and decode timed on a sibling engine, with the roofline.

No test asserts a speed (the machine is shared): they check the structure of the measurement and
the relations that hold by construction (chunks sum to the prompt, one decode step per token, the
roofline figures follow from the measured ones and from the model's real parameter count).
"""

import pytest

from bounds import U64, decimal_half, f64_rel, gamma
from conftest import drain, figure_value, lm_head_bytes_per_weight_q4_1, on_a_phone, shoot_widget, wait_ready

PH = '[data-widget="phases"]'


def test_phases_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["phases"].messages
    assert m.type == "phases" and m.job
    assert m.fields == {"max_prompt", "decode_tokens", "run"}


def test_phases_refuses_bad_input_naming_the_field(ws):
    for fields, param in [
        ({"max_prompt": 17}, "max_prompt"),
        ({"max_prompt": "64"}, "max_prompt"),
        ({"max_prompt": 64.0}, "max_prompt"),
        ({"max_prompt": 1 << 20}, "max_prompt"),
        ({"decode_tokens": 0}, "decode_tokens"),
        ({"decode_tokens": 129}, "decode_tokens"),
        ({"decode_tokens": 1.5}, "decode_tokens"),
        ({"run": -1}, "run"),
        ({"run": "again"}, "run"),
    ]:
        err = ws.error({"type": "phases", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
        assert param in err["message"]
    # the connection is still usable
    r = ws.job("phases", max_prompt=32, decode_tokens=2)
    assert r["type"] == "phases", r


def check_structure(r, max_prompt: int, decode_tokens: int) -> None:
    lengths = [p["prompt_tokens"] for p in r["prefill"]]
    assert lengths == [n for n in (16, 32, 64, 128, 256, 512, 1024, 2048) if n <= max_prompt]
    chunk = r["chunk_tokens"]
    for p in r["prefill"]:
        n = p["prompt_tokens"]
        # chunked prefill: the steps' tokens add up to the prompt, none over the chunk
        assert sum(s["tokens"] for s in p["steps"]) == n
        assert len(p["steps"]) == -(-n // chunk) and all(0 < s["tokens"] <= chunk for s in p["steps"])
        # ms() rounds each step and the prompt's total (the float64 sum of the seconds, x 1000) to 3 places:
        # one half-unit each; the float64 sums of k positive terms there and here, within gamma_{k + 2}
        k = len(p["steps"])
        assert p["ms"] == pytest.approx(sum(s["ms"] for s in p["steps"]), rel=0,
                                        abs=decimal_half(3) * (k + 1) + 2 * gamma(k + 2, U64) * p["ms"])
        assert p["ms"] > 0
    # one decode step per generated token after the first, each attending one token further
    assert [d["index"] for d in r["decode"]] == list(range(1, decode_tokens + 1))
    assert [d["context"] for d in r["decode"]] == [max_prompt + i for i in range(1, decode_tokens + 1)]
    assert all(d["ms"] > 0 for d in r["decode"])
    ms = sorted(d["ms"] for d in r["decode"])
    assert ms[0] <= r["decode_step_ms"] <= ms[-1]
    longest = r["prefill"][-1]
    # n / (ms / 1000) there, n / ms x 1000 here: two float64 roundings each
    assert r["prefill_tokens_per_s"] == pytest.approx(longest["prompt_tokens"] / longest["ms"] * 1000, rel=f64_rel(2), abs=0)
    m = r["machine"]
    assert m["threads"] >= 1 and m["cpu_count"] >= 1 and m["processor"] and m["measured_at"].startswith("20")
    # the roofline figures follow from the measured ones
    bw, flop_s = r["memory_bandwidth_gb_s"] * 1e9, r["matmul_gflop_s"] * 1e9
    assert bw > 0 and flop_s > 0
    # the same float64 formulas, from the rates the server had and here from its GB/s and GFLOP/s (each
    # divided by 1e9 there and multiplied back here: two roundings more per rate): no cancellation, so
    # within f64_rel(the larger count of roundings) of each other
    assert r["decode_floor_ms"] == pytest.approx(r["weight_bytes"] / bw * 1000, rel=f64_rel(4), abs=0)
    assert r["prefill_ceiling_tokens_per_s"] == pytest.approx(flop_s / r["flops_per_token"], rel=f64_rel(3), abs=0)
    assert r["machine_balance"] == pytest.approx(flop_s / bw, rel=f64_rel(5), abs=0)
    assert r["prefill_intensity"] == pytest.approx(chunk * r["decode_intensity"], rel=f64_rel(2), abs=0)


def decode_weight_bytes(cfg: dict) -> int:
    """The weight bytes a decode step reads, from the model's shape and the serving format: each
    linear layer's out x in weights at the format's bytes (q4_1: half a byte, and a bf16 scale and
    zero for every 32), and the tied LM head's V x C (q4_1: Q8_0, a byte a weight and an fp16
    scale for every 32, or two 4-bit halves where the Q8_0 kernel does not run)."""
    C, I, D, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"], cfg["num_layers"]
    H, Hkv, V = cfg["num_heads"], cfg["num_kv_heads"], cfg["vocab_size"]
    weights = L * (C * (H + 2 * Hkv) * D + H * D * C + C * 2 * I + I * C)
    per_weight = {"fp32": 4, "bf16": 2, "q4_1": 0.5 + 4 / 32}[cfg["weight_format"]]
    head = V * C * {"fp32": 4, "bf16": 2, "q4_1": lm_head_bytes_per_weight_q4_1()}[cfg["weight_format"]]
    return round(weights * per_weight + head)


def test_phases_measures_each_prompt_and_each_decode_step(ws):
    r = ws.job("phases", max_prompt=32, decode_tokens=3)
    assert r["type"] == "phases", r
    assert (r["max_prompt"], r["decode_tokens"], r["run"]) == (32, 3, 0)
    check_structure(r, 32, 3)
    cfg = ws.hello
    assert r["weight_format"] == cfg["weight_format"] == "q4_1"          # the server's default
    assert r["weight_bytes"] == decode_weight_bytes(cfg)
    assert r["flops_per_token"] == 2 * (r["num_params"] - cfg["vocab_size"] * cfg["hidden_size"])
    # cached by its inputs: the same answer, not a second measurement; a new run measures again
    cached = ws.job("phases", max_prompt=32, decode_tokens=3)
    assert {k: v for k, v in cached.items() if k != "id"} == {k: v for k, v in r.items() if k != "id"}
    again = ws.job("phases", max_prompt=32, decode_tokens=3, run=1)
    assert again["run"] == 1
    check_structure(again, 32, 3)


def test_the_job_runs_one_engine_step_per_slice(tiny_loaded):
    from app.jobs import Progress
    from app.widgets.phases import CHUNK_TOKENS, PREFILL_TRIES, TRIES, phases_job
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8), tiny_loaded)
    gen = phases_job(engine, max_prompt=128, decode_tokens=4, remeasure=0)
    items, r = drain(gen)
    progress = [i for i in items if isinstance(i, Progress)]
    # one slice per engine step: the warm-up, each of 16..128 PREFILL_TRIES times in chunks of
    # CHUNK_TOKENS, the 4 decode steps; then the bandwidth and matmul tries
    steps = 1 + PREFILL_TRIES * sum(-(-n // CHUNK_TOKENS) for n in (16, 32, 64, 128)) + 4
    assert len(items) == 1 + steps + 2 * TRIES
    assert progress[-1].done == progress[-1].total
    check_structure(r, 128, 4)
    assert engine.view.stats()["kv"]["used_blocks"] == 0            # the serving engine was never touched


@pytest.mark.real_model
def test_phases_on_the_real_model(real_ws, hf_reference):
    hf_model, _ = hf_reference
    r = real_ws.job("phases", max_prompt=256, decode_tokens=4)
    assert r["type"] == "phases", r
    check_structure(r, 256, 4)
    # the weights counted are the model's real parameters: transformers' count from the same GGUF
    assert r["num_params"] == sum(p.numel() for p in hf_model.parameters())
    assert r["weight_bytes"] == decode_weight_bytes(real_ws.hello)
    # the sweep's ends are 16 times apart in work (how much longer that takes is the page's to show;
    # a test asserts no time)
    first, last = r["prefill"][0], r["prefill"][-1]
    assert last["prompt_tokens"] == 16 * first["prompt_tokens"]


@pytest.mark.browser
@pytest.mark.real_model
def test_phases_page_takes_options_from_the_url(pg, real_ws, artifacts_dir):
    query = "?max_prompt=64&decode_tokens=4&question=What+is+two+plus+two%3F"
    shoot_widget(pg, "phases", artifacts_dir, query, ready_timeout=180_000)
    page = pg.page
    pg.goto(f"/embed/phases{query}")
    wait_ready(page, PH, 180_000)
    assert page.input_value(f'{PH} select[name="max_prompt"]') == "64"
    assert page.input_value(f'{PH} input[name="decode_tokens"]') == "4"
    assert page.input_value(f'{PH} input[name="question"]') == "What is two plus two?"
    r = real_ws.job("phases", max_prompt=64, decode_tokens=4)           # the page's job, from the cache
    for key in ("prefill_tokens_per_s", "decode_step_ms", "memory_bandwidth_gb_s", "matmul_gflop_s",
                "decode_floor_ms", "prefill_ceiling_tokens_per_s"):       # the reply's numbers: exact
        assert figure_value(page, key) == r[key], key
    assert figure_value(page, "threads") == r["machine"]["threads"]
    assert str(r["machine"]["cpu_count"]) in page.text_content(f"{PH} .phases-machine")
    # the reader's own request: its TTFT, TPOT and end to end, and a star on each chart
    page.click(f'{PH} button:has-text("Send and time it")')
    page.wait_for_selector(f'{PH} [data-figure="request_e2e_ms"][data-value]', timeout=120_000)
    ttft, tpot, e2e = (figure_value(page, k) for k in ("request_ttft_ms", "request_tpot_ms", "request_e2e_ms"))
    assert 0 < ttft <= e2e and 0 < tpot < e2e
    assert page.locator(f"{PH} .phases-chart").nth(0).locator("text=your request (TTFT)").count() == 1
    page.set_viewport_size({"width": 1280, "height": 1400})
    page.screenshot(path=str(artifacts_dir / "phases-with-request-1280.png"), full_page=True)
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_phases_on_the_walkthrough_at_phone_width(pg, artifacts_dir):
    snippet = on_a_phone(pg, "phases", "?phases.max_prompt=32&phases.decode_tokens=3", artifacts_dir, 180_000)
    assert "/embed/phases?" in snippet and "max_prompt=32" in snippet and "decode_tokens=3" in snippet
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_the_chats_last_answer_joins_the_phases_charts(pg):
    """On the walkthrough, the chat's finished answer (announced through lib/events.js) is the
    reader's request on the phases widget, even though that widget mounts after it."""
    page = pg.page
    page.set_viewport_size({"width": 1280, "height": 800})
    pg.goto("/?chat.message=Say+hello.&chat.max_tokens=6&phases.max_prompt=16&phases.decode_tokens=2")
    chat = '[data-widget="chat"]'
    page.locator(chat).scroll_into_view_if_needed()
    wait_ready(page, chat)
    page.click(f'{chat} button:text-is("Send")')
    page.wait_for_function("""() => !document.querySelector('[data-widget="chat"] .msg-assistant.streaming')
                              && document.querySelector('[data-widget="chat"] [data-figure="tpot_ms"][data-value]')""",
                           timeout=120_000)
    chat_ttft, chat_tpot = figure_value(page, "ttft_ms"), figure_value(page, "tpot_ms")
    page.locator(PH).scroll_into_view_if_needed()
    wait_ready(page, PH, 180_000)
    assert figure_value(page, "request_ttft_ms") == chat_ttft
    assert figure_value(page, "request_tpot_ms") == chat_tpot
    assert figure_value(page, "request_e2e_ms") >= chat_ttft
    assert "Your last chat answer" in page.text_content(f"{PH} .figure:has([data-figure='request_ttft_ms'])")
    pg.assert_clean()
