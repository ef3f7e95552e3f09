"""Widget `gemm` (section 12): matmul time at the model's layer shapes for 1 to 256 rows, and the
roofline. Structure and the relations that hold by construction run on the tiny model; the one
speed claim (64 rows go through at several times the rows per second of 1) runs on the real
model's shapes, each point the best of several calls, with a margin that a shared machine keeps.
"""

import pytest

from bounds import U64, f64_rel, gamma
from conftest import drain, figure_value, lm_head_bytes_per_weight_q4_1, shoot_widget, wait_ready

GM = '[data-widget="gemm"]'
NAMES = ["q/k/v", "o", "gate/up", "down", "LM head"]


def test_gemm_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["gemm"].messages
    assert m.type == "gemm" and m.job and m.fields == {"format", "max_rows", "run"}


def test_gemm_refuses_bad_input_naming_the_field(ws):
    for fields, param in [
        ({"format": "fp16"}, "format"), ({"format": 32}, "format"), ({"format": "Q4_1"}, "format"),
        ({"max_rows": 32}, "max_rows"), ({"max_rows": 100}, "max_rows"), ({"max_rows": "64"}, "max_rows"),
        ({"max_rows": 512}, "max_rows"), ({"max_rows": 64.0}, "max_rows"),
        ({"run": -1}, "run"), ({"run": "again"}, "run"),
    ]:
        err = ws.error({"type": "gemm", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
        assert param in err["message"]
    r = ws.job("gemm", timeout=180, max_rows=64)                 # the connection is still usable
    assert r["type"] == "gemm", r


def check_structure(r, cfg: dict, max_rows: int) -> None:
    rows = [1 << i for i in range(9) if 1 << i <= max_rows]
    h, q = cfg["hidden_size"], cfg["num_heads"] * cfg["head_dim"]
    kv = cfg["num_kv_heads"] * cfg["head_dim"]
    expected = [(h, q + 2 * kv), (q, h), (h, 2 * cfg["intermediate_size"]), (cfg["intermediate_size"], h),
                (h, cfg["vocab_size"])]
    assert [s["name"] for s in r["shapes"]] == NAMES
    assert [(s["k"], s["n"]) for s in r["shapes"]] == expected
    # q4_1: half a byte a weight and an fp16 scale and minimum per 32; its LM head is the Q8_0
    # embedding: a byte a weight and an fp16 scale per 32 (two 4-bit products without the kernel)
    bytes_per_weight = {"fp32": 4, "bf16": 2, "q4_1": 0.5 + 4 / 32}[r["format"]]
    head_bytes = lm_head_bytes_per_weight_q4_1()
    balance = r["peak_gflops"] / r["bandwidth_gb_s"]
    # the server's peak / bandwidth (one rounding) against the quotient of the two divided by 1e9 (three)
    assert r["machine_balance"] == pytest.approx(balance, rel=f64_rel(3), abs=0)
    for s in r["shapes"]:
        per = head_bytes if r["format"] == "q4_1" and s["name"] == "LM head" else bytes_per_weight
        assert s["weight_bytes"] == per * s["k"] * s["n"]
        pts = [p for p in r["points"] if p["shape"] == s["name"]]
        assert [p["rows"] for p in pts] == rows
        for p in pts:
            flops = 2 * p["rows"] * s["k"] * s["n"]
            assert p["ms"] > 0
            # the same seconds through at most 3 float64 roundings there (flops / s / 1e9, s x 1e6 / rows)
            # and here (s x 1000, then two more): f64_rel(3); flops and the bytes are exact integers
            assert p["gflop_s"] == pytest.approx(flops / p["ms"] / 1e6, rel=f64_rel(3), abs=0)
            # the same sum of the same numbers and one divide, as app/widgets/gemm.py's point(): bit for bit
            assert p["intensity"] == flops / (s["weight_bytes"] + 4 * p["rows"] * (s["k"] + s["n"]))
            assert p["us_per_row"] == pytest.approx(p["ms"] * 1000 / p["rows"], rel=f64_rel(3), abs=0)
            # rows / s there (one rounding), ms / 1000 and a divide here (two more)
            assert p["rows_per_s"] == pytest.approx(p["rows"] / (p["ms"] / 1000), rel=f64_rel(3), abs=0)
            # (that the roof bounds the points, the peak being timed on the points' own product, is
            # test_the_roof_is_timed_on_the_points_own_product's, on a clock no load can move)
        by = {p["rows"]: p for p in pts}
        assert s["speedup_64"] == by[64]["rows_per_s"] / by[1]["rows_per_s"]     # the same quotient: exact
        # the knee: the intensity there is the machine balance
        if s["knee_rows"] is not None:
            k = s["knee_rows"]
            intensity = 2 * k * s["k"] * s["n"] / (s["weight_bytes"] + 4 * k * (s["k"] + s["n"]))
            # exactly, intensity(knee) = B. The knee's denominator 2KN - 4B(K + N) cancels: its roundings
            # (u of each term) are u (2KN + 4B(K + N)) / that denominator relative; the knee's product and
            # divide, then here 2kKN, the bytes and the divide, ~8 more u, and the intensity moves by at
            # most the knee's relative error (d log I / d log R = W / (W + 4R(K + N)) <= 1); the balance
            # here is within f64_rel(3) of the server's
            cut = 2 * s["k"] * s["n"] - 4 * balance * (s["k"] + s["n"])
            rel = 2 * (gamma(10, U64) + U64 * (2 * s["k"] * s["n"] + 4 * balance * (s["k"] + s["n"])) / cut) + f64_rel(3)
            assert intensity == pytest.approx(balance, rel=rel, abs=0)
    assert r["knee_rows"] == r["shapes"][2]["knee_rows"] and r["knee_shape"] == "gate/up"
    m = r["machine"]
    assert m["threads"] >= 1 and m["cpu_count"] >= 1 and m["measured_at"].startswith("20")


def test_gemm_times_every_shape_at_every_row_count(ws):
    r = ws.job("gemm", timeout=180, format="bf16", max_rows=64)
    assert (r["format"], r["max_rows"], r["run"]) == ("bf16", 64, 0)
    check_structure(r, ws.hello, 64)
    cached = ws.job("gemm", timeout=180, format="bf16", max_rows=64)     # cached by its inputs; a new run measures again
    assert {k: v for k, v in cached.items() if k != "id"} == {k: v for k, v in r.items() if k != "id"}
    again = ws.job("gemm", timeout=180, format="bf16", max_rows=64, run=1)
    assert again["run"] == 1 and again["machine"]["measured_at"] >= r["machine"]["measured_at"]


def test_gemm_times_the_4_bit_format_the_chat_runs(ws):
    r = ws.job("gemm", timeout=180, format="q4_1", max_rows=64)
    assert (r["type"], r["format"]) == ("gemm", "q4_1"), r
    check_structure(r, ws.hello, 64)
    assert r["peak_gflops"] > 0


def test_the_job_times_one_point_per_slice(tiny_loaded):
    from app.jobs import Progress
    from app.widgets.gemm import TRIES, gemm_job
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8), tiny_loaded)
    gen = gemm_job(engine, format="fp32", max_rows=64, remeasure=0)
    items, r = drain(gen)
    assert all(isinstance(i, Progress) for i in items)
    assert len(items) == 5 * 7 + 2 * TRIES and items[-1].done == items[-1].total
    assert r["points"][0]["shape"] == "q/k/v" and r["points"][0]["rows"] == 1


class FakeClock:
    """perf_counter for app/widgets/gemm.py: time moves only inside the engine's products, by
    their FLOPs at RATE. RATE is a power of two and the FLOPs integers, so every reading is an exact
    binary fraction and every difference of two is exact."""
    RATE = 2.0 ** 30                     # FLOP/s

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def clocked(cls, clock: FakeClock):
    """cls with each call charged to the clock: 2 R K N FLOPs for x (R, K) -> (R, N)."""
    class Clocked(cls):
        def __call__(self, x):
            y = super().__call__(x)
            clock.now += 2 * x.shape[0] * x.shape[1] * y.shape[-1] / clock.RATE
            return y
    return Clocked


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_the_roof_is_timed_on_the_points_own_product(tiny_loaded, monkeypatch, fmt):
    # The roof bounds the points only if the peak is timed through the product the points are
    # (bf16 once had its peak from oneDNN's plain matmul, 1 GFLOP/s on this machine, under points at
    # 50). With a kernel that runs every product at one rate, the peak and every point are that
    # rate: flops / (flops / RATE) is RATE exactly, and the reply's GFLOP/s are each RATE / 1e9 in
    # one rounding: equal bit for bit. A peak timed on another product leaves the clock still
    # (a zero time: ZeroDivisionError) or at another rate.
    import types
    from app.widgets import gemm as module
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine

    clock = FakeClock()
    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(module, "PackedLinear", clocked(module.PackedLinear, clock))
    monkeypatch.setattr(module, "PackedQ8_0", clocked(module.PackedQ8_0, clock))
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8), tiny_loaded)
    _, r = drain(module.gemm_job(engine, format=fmt, max_rows=64, remeasure=0))
    assert r["peak_gflops"] == clock.RATE / 1e9
    assert len(r["points"]) == 5 * 7
    for p in r["points"]:
        assert p["gflop_s"] == r["peak_gflops"], p


@pytest.mark.real_model
def test_the_shapes_are_the_real_models_and_each_speedup_its_own_timings(real_ws, hf_reference):
    hf_model, _ = hf_reference
    r = real_ws.job("gemm", timeout=180, format="fp32", max_rows=64)
    # the shapes are the real model's: each product's weight is a weight of transformers' model
    hf = {tuple(p.shape) for p in hf_model.parameters()}
    for s in r["shapes"]:
        if s["name"] not in ("q/k/v", "gate/up"):            # the fused ones are concatenations
            assert (s["n"], s["k"]) in hf, s
    layer = hf_model.model.layers[0]
    assert r["shapes"][0]["n"] == sum(getattr(layer.self_attn, f"{x}_proj").weight.shape[0] for x in "qkv")
    assert r["shapes"][2]["n"] == layer.mlp.gate_proj.weight.shape[0] + layer.mlp.up_proj.weight.shape[0]
    # each shape's speed-up is its own timings' ratio (how large it is, is the benchmark's and the
    # page's to say: a test asserts no speed)
    for s in r["shapes"]:
        rows = {p["rows"]: p for p in r["points"] if p["shape"] == s["name"]}
        assert s["speedup_64"] == rows[64]["rows_per_s"] / rows[1]["rows_per_s"] > 0, s


@pytest.mark.browser
@pytest.mark.real_model
def test_gemm_page_takes_options_from_the_url(pg, real_ws, artifacts_dir):
    query = "?format=bf16&max_rows=64"
    shoot_widget(pg, "gemm", artifacts_dir, query, ready_timeout=180_000)
    page = pg.page
    pg.goto(f"/embed/gemm{query}")
    wait_ready(page, GM, 180_000)
    assert page.input_value(f'{GM} select[name="format"]') == "bf16"
    assert page.input_value(f'{GM} select[name="max_rows"]') == "64"
    r = real_ws.job("gemm", timeout=180, format="bf16", max_rows=64)           # the page's job, from the cache
    for key in ("peak_gflops", "bandwidth_gb_s", "knee_rows", "speedup_64"):   # the reply's numbers: exact
        assert figure_value(page, key) == r[key], key
    assert figure_value(page, "threads") == r["machine"]["threads"]
    assert page.locator(f"{GM} .gemm-table tbody tr").count() == 5
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_gemm_on_the_walkthrough_at_phone_width(pg, artifacts_dir):
    page = pg.page
    page.set_viewport_size({"width": 390, "height": 844})
    pg.goto("/?gemm.max_rows=64#gemm")
    page.locator(GM).scroll_into_view_if_needed()
    wait_ready(page, GM, 180_000)
    page.locator(GM).screenshot(path=str(artifacts_dir / "gemm-phone-390.png"))
    snippet = page.locator('.widget-frame:has([data-widget="gemm"]) .snippet').text_content()
    assert "/embed/gemm?" in snippet and "max_rows=64" in snippet
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, overflow
    pg.assert_clean()
