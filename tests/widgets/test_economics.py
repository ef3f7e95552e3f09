"""Widget `economics` (section 22): the cost model's formulas against computations of their own
here (a routing simulation, a pipeline timeline, the experts' sizes from the public configs'
matrix shapes, a decode step priced by hand), the job through the websocket, and the page."""

import math
import random

import pytest

from conftest import drain, figure_value, shoot_widget, wait_ready

EC = '[data-widget="economics"]'
H100 = {"price": 2.5, "hbm": 80.0, "bandwidth": 3.35, "tflops": 1979.0, "link": 450.0, "network": 50.0}
DEEPSEEK_KV = 61 * (512 + 64) * 2          # MLA: latent + RoPE key per layer, bf16
LLAMA70_KV = 2 * 80 * 8 * 128 * 2          # K and V, 8 KV heads of 128, bf16


# A float64 formula (u = 2^-53) evaluated twice, in another order or form (here and in the widget, in
# Python or in the page's JS): at most 20 roundings each, a power x^B with B <= 8192 (the relative error
# of x, times B) and one 1 - x^B with x^B <= 31/32 (an absolute error divided by 1 - x^B >= 1/32), so the
# two within 32 (8192 + 20) u of each other, relative; the same absolute for a value near 0 (a bubble).
F64 = 32 * (8192 + 20) * 2.0 ** -53


def econ():
    from app.lab import economics
    return economics


def models():
    from app.widgets.economics import model_of
    return model_of("llama-3.1-70b"), model_of("deepseek-v3"), model_of("mixtral-8x7b")


def test_economics_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["economics"].messages
    assert m.type == "economics" and m.job
    assert m.fields == {"price", "hbm", "bandwidth", "tflops", "link", "network", "dtype", "dense", "moe", "context", "batch"}


def test_distinct_experts_match_a_routing_simulation():
    e = econ()
    rng = random.Random(0)
    for experts, top_k, tokens in ((256, 8, 1), (256, 8, 16), (256, 8, 64), (8, 2, 3), (256, 8, 512)):
        trials = 1000 if tokens <= 64 else 200
        seen = sum(len({x for _ in range(tokens) for x in rng.sample(range(experts), top_k)}) for _ in range(trials))
        # distinct experts = a sum of `experts` indicators, negatively associated (each token draws
        # without replacement, tokens independently), so its variance is at most sum p (1 - p) =
        # mean (1 - p), p = mean / experts: the mean of `trials` draws within 4 standard deviations
        mean = e.experts_touched(experts, top_k, tokens)
        assert abs(mean - seen / trials) <= 4 * math.sqrt(mean * (1 - mean / experts) / trials), (experts, top_k, tokens)
    assert e.experts_touched(256, 8, 1) == pytest.approx(8, rel=F64, abs=F64)


def test_expert_and_always_on_sizes_match_the_configs_matrices():
    dense, ds, mx = models()
    # DeepSeek-V3 config.json: an expert is gate, up and down of hidden 7168 x moe_intermediate 2048
    # expert_params comes from the published totals: (671B - 37B) / (248 x 58 layers); "671B" is within
    # half a billion, "37B" within one (37.55B from the shapes below, written 37B), so the difference
    # within 1.5e9 of 634e9
    assert ds.expert_params == pytest.approx(3 * 7168 * 2048, rel=1.5e9 / (671e9 - 37e9))
    # the always-on weights: MLA attention in 61 layers, 3 dense MLPs (intermediate 18432), the
    # shared expert in 58 layers, embeddings and LM head (vocab 129280), the routers
    mla = 7168 * 1536 + 1536 * 128 * (128 + 64) + 7168 * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * 7168
    always = 61 * mla + 3 * 3 * 7168 * 18432 + 58 * 3 * 7168 * 2048 + 2 * 129280 * 7168 + 58 * 256 * 7168
    expert = 3 * 7168 * 2048
    assert always + 58 * 256 * expert == pytest.approx(671e9, abs=0.5e9)    # the headline total, from the shapes, to the billion
    assert always + 58 * 8 * expert == pytest.approx(37e9, abs=1e9)         # ... and the active (37.55B: "37B" drops the fraction)
    # derived from the two headline figures, the always-on part carries their rounding: 37B's (1e9)
    # and 8 x 58 experts' share of expert_params' (above)
    assert ds.always_params == pytest.approx(always, abs=1e9 + 8 * 58 * 1.5e9 / (248 * 58))
    assert (ds.experts, ds.top_k, ds.moe_layers, ds.layers) == (256, 8, 58, 61)
    # Mixtral-8x7B config.json: hidden 4096, intermediate 14336
    # from "46.7B" and "12.9B" (each within 0.05e9): (46.7B - 12.9B) / (6 x 32 layers)
    assert mx.expert_params == pytest.approx(3 * 4096 * 14336, rel=0.1e9 / (46.7e9 - 12.9e9))
    assert not dense.is_moe and dense.always_params == dense.params == 70.6e9
    assert ds.kv_bytes_per_token == DEEPSEEK_KV == 70_272 and dense.kv_bytes_per_token == LLAMA70_KV == 327_680
    # attention FLOPs per cached token: QK and PV over every query head; MLA's absorbed form works in the latent
    assert dense.attention_flops == 80 * 64 * (2 * 128 + 2 * 128)
    assert ds.attention_flops == 61 * 128 * (2 * (512 + 64) + 2 * 512)


def test_weights_read_grow_with_the_batch_only_for_the_moe():
    e = econ()
    dense, ds, _ = models()
    assert e.weight_bytes(dense, 1, 1) == e.weight_bytes(dense, 4096, 1) == 70.6e9
    one, many = e.weight_bytes(ds, 1, 1), e.weight_bytes(ds, 4096, 1)
    assert one == pytest.approx(37e9, rel=F64, abs=F64)                      # one token: the active weights
    assert many == pytest.approx(671e9, rel=F64, abs=F64)          # thousands: every expert
    assert e.per_expert_batch(ds, 64) == 64 * 8 / 256 == 2


def test_pipeline_bubble_matches_a_timeline():
    e = econ()
    for p, m in ((1, 1), (2, 1), (2, 2), (4, 8), (3, 5)):
        # GPipe's forward schedule, unit stage times: microbatch i is on stage s during [i + s, i + s + 1)
        end = max(i + s + 1 for i in range(m) for s in range(p))
        busy = p * m
        assert e.pipeline_bubble(p, m) == pytest.approx(1 - busy / (p * end), rel=F64, abs=F64), (p, m)


def test_gpus_needed_and_deployment_by_hand():
    e = econ()
    dense, ds, _ = models()
    hw = e.Hardware()
    usable = 80e9 * 0.9
    assert e.gpus_needed(ds, hw, 1, 64, 4096) == math.ceil((671e9 + 64 * 4096 * DEEPSEEK_KV) / usable) == 10
    assert e.gpus_needed(dense, hw, 2, 64, 4096) == math.ceil((2 * 70.6e9 + 64 * 4096 * LLAMA70_KV) / usable) == 4
    assert [e.deployed_gpus(n, 8) for n in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 16, 24]


def test_one_user_priced_by_hand():
    e = econ()
    dense, ds, _ = models()
    hw = e.Hardware()
    # Llama-3.1-70B in fp8 on one GPU: the weights and one 4,096-token cache over 3.35 TB/s
    s = e.cheapest_step(dense, hw, 1, 1, 4096)
    step_s = (70.6e9 + 4096 * LLAMA70_KV) / 3.35e12
    assert (s.replicas, s.gpus, s.stages, s.microbatches) == (1, 1, 1, 1)
    assert s.step_s == pytest.approx(step_s, rel=F64, abs=F64) and s.comm_s == 0
    assert s.cost_per_mtok == pytest.approx(2.5 / (3600 / step_s) * 1e6, rel=F64, abs=F64)
    # DeepSeek-V3: ten GPUs' worth of weights on two nodes, a pipeline of two stages, one microbatch
    s = e.cheapest_step(ds, hw, 1, 1, 4096)
    assert (s.needed, s.gpus, s.stages, s.microbatches, s.bubble) == (10, 16, 2, 1, 0.5)
    memory = (37e9 + 4096 * DEEPSEEK_KV) / 2 / (8 * 3.35e12)
    allreduce = 2 * 7 / 8 * 7168 * 2 / 450e9 + 10e-6
    comm = 61 / 2 * 2 * allreduce + (7168 * 2 / 50e9 + 10e-6)
    assert s.memory_s == pytest.approx(memory, rel=F64, abs=F64) and s.comm_s == pytest.approx(comm, rel=F64, abs=F64)
    assert s.step_s == pytest.approx(2 * (memory + comm), rel=F64, abs=F64)
    assert s.cost_per_mtok == pytest.approx(16 * 2.5 / (1 / s.step_s * 3600) * 1e6, rel=F64, abs=F64)


def test_the_cheapest_deployment_is_the_least_cost_of_the_grid():
    e = econ()
    _, ds, _ = models()
    hw = e.Hardware()
    for users in (1, 6, 64, 1000):
        best = e.cheapest_step(ds, hw, 1, users, 4096)
        grid = [e.step(ds, hw, 1, users, 4096, r, m) for r in (*[2 ** i for i in range(14) if 2 ** i <= users], users)
                for m in (1, 2, 4, 8, 16, 32, 64) if m <= users / r]
        assert best.cost_per_mtok == min(g.cost_per_mtok for g in grid if g is not None)
        assert best.tokens_per_s == pytest.approx(users / best.step_s, rel=F64, abs=F64)


def test_the_prose_matches_the_model_at_the_defaults():
    """Section 22's numbers: what the widget shows at its default settings."""
    from app.sections import by_widget
    e = econ()
    dense, ds, _ = models()
    hw = e.Hardware()
    prose = " ".join(by_widget("economics").prose)
    one_d, one_m = e.cheapest_step(dense, hw, 1, 1, 4096), e.cheapest_step(ds, hw, 1, 1, 4096)
    assert "about ten GPUs" in prose and one_m.needed == 10 and "two nodes of eight" in prose and one_m.gpus == 16
    assert "about twice" in prose and 1.6 < one_m.cost_per_mtok / one_d.cost_per_mtok < 2.4 and one_d.gpus == 1
    assert "about 222 of the 256" in prose and round(e.experts_touched(256, 8, 64)) == 222
    assert "64 × 8 / 256 = 2" in prose
    for users in (1448, 4096, 16384):        # "with thousands of users ... about what the 70-billion model's do"
        ratio = e.cheapest_step(ds, hw, 1, users, 4096).cost_per_mtok / e.cheapest_step(dense, hw, 1, users, 4096).cost_per_mtok
        assert 0.85 < ratio < 1.15, (users, ratio)
    assert "70 KB per token against 328 KB" in prose and round(DEEPSEEK_KV / 1e3) == 70 and round(LLAMA70_KV / 1e3) == 328


def test_economics_refuses_bad_input_naming_the_field(ws):
    for fields, param in [
        ({"price": 0}, "price"), ({"price": "2"}, "price"), ({"hbm": 0.5}, "hbm"), ({"hbm": 2000}, "hbm"),
        ({"bandwidth": 0}, "bandwidth"), ({"tflops": -1}, "tflops"), ({"link": 0.5}, "link"),
        ({"network": 0}, "network"), ({"dtype": "fp16"}, "dtype"), ({"dense": "deepseek-v3"}, "dense"),
        ({"moe": "llama-3.1-70b"}, "moe"), ({"context": 0}, "context"), ({"context": 4096.5}, "context"),
        ({"batch": 16385}, "batch"), ({"batch": True}, "batch"),
        ({"hbm": 1, "dtype": "fp32"}, "hbm"),            # DeepSeek-V3 would need more stages than layers
        ({"colour": "red"}, "colour"),
    ]:
        err = ws.error({"type": "economics", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
    assert ws.job("economics", batch=8)["type"] == "economics"       # the connection is still usable


def test_economics_job_agrees_with_a_hand_computation(ws):
    r = ws.job("economics", **H100, dtype="fp8", dense="llama-3.1-70b", moe="deepseek-v3", context=4096, batch=64)
    assert r["type"] == "economics", r
    usable = 80e9 * 0.9
    assert r["gpus_needed"] == math.ceil((671e9 + 64 * 4096 * DEEPSEEK_KV) / usable) == 10
    sizes = {x["preset"]: x for x in r["sizing"]}
    assert sizes["llama-3.1-70b"]["gpus_needed"] == math.ceil((70.6e9 + 64 * 4096 * LLAMA70_KV) / usable) == 3
    assert sizes["smollm2-135m"]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    moe, dense = r["at_batch"]["moe"], r["at_batch"]["dense"]
    u = moe["micro_seqs"]
    assert moe["experts_touched"] == pytest.approx(256 * (1 - (1 - 8 / 256) ** u), rel=F64, abs=F64)
    assert moe["per_expert_batch"] == pytest.approx(u * 8 / 256, rel=F64, abs=F64)
    assert moe["bubble"] == pytest.approx((moe["stages"] - 1) / (moe["microbatches"] + moe["stages"] - 1), rel=F64, abs=F64)
    for side, s in (("dense", dense), ("moe", moe)):
        assert r[f"cost_per_mtok_{side}"] == s["cost_per_mtok"]
        assert s["cost_per_mtok"] == pytest.approx(s["total_gpus"] * 2.5 / (64 / s["step_s"] * 3600) * 1e6, rel=F64, abs=F64)
        assert s["step_s"] == pytest.approx((s["microbatches"] + s["stages"] - 1)
                                            * (max(s["memory_s"], s["compute_s"]) + s["comm_s"]), rel=F64, abs=F64)
    # the curves: every concurrency from 1 to 16,384, one user priced as by hand
    xs = [p["concurrency"] for p in r["curves"]["dense"]]
    assert xs[0] == 1 and xs[-1] == 16384 and 64 in xs and xs == sorted(xs)
    step_s = (70.6e9 + 4096 * LLAMA70_KV) / 3.35e12
    assert r["curves"]["dense"][0]["cost_per_mtok"] == pytest.approx(2.5 / (3600 / step_s) * 1e6, rel=F64, abs=F64)
    again = ws.job("economics", **H100, dtype="fp8", dense="llama-3.1-70b", moe="deepseek-v3", context=4096, batch=64)
    assert {k: v for k, v in again.items() if k != "id"} == {k: v for k, v in r.items() if k != "id"}


def test_the_job_is_one_concurrency_per_slice():
    from app.jobs import Progress
    from app.widgets.economics import DEFAULTS, economics_job
    gen = economics_job(**{**DEFAULTS, "batch": 100})
    items, r = drain(gen)
    assert all(isinstance(i, Progress) for i in items)
    assert len(items) == len(r["curves"]["dense"]) + len(r["curves"]["moe"]) and 100 in [p["concurrency"] for p in r["curves"]["moe"]]


def test_price_scales_cost_and_nothing_else(ws):
    a = ws.job("economics", price=2.5, batch=32)
    b = ws.job("economics", price=5.0, batch=32)
    for side in ("dense", "moe"):
        assert b[f"cost_per_mtok_{side}"] == pytest.approx(2 * a[f"cost_per_mtok_{side}"], rel=F64, abs=F64)
        assert b["at_batch"][side]["step_s"] == a["at_batch"][side]["step_s"]


def server_children(server) -> list[int]:
    """Processes the test server started (worker processes would be here)."""
    from pathlib import Path
    out = []
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def read_figures(page) -> dict:
    return {k: float(v) for k, v in page.eval_on_selector_all(
        f"{EC} [data-figure]", "els => els.map(e => [e.dataset.figure, e.dataset.value])")}


@pytest.mark.browser
@pytest.mark.real_model
def test_economics_page(pg, real_ws, server, artifacts_dir):
    before = server_children(server)
    shoot_widget(pg, "economics", artifacts_dir)
    page = pg.page
    query = "?price=3&context=2048&batch=128&dense=llama-3.1-8b&moe=mixtral-8x7b&dtype=bf16&tflops=989"
    pg.goto(f"/embed/economics{query}")
    wait_ready(page, EC)
    for name, value in (("price", "3"), ("context", "2048"), ("batch", "128"), ("tflops", "989")):
        assert page.input_value(f'{EC} input[name="{name}"]') == value
    assert page.input_value(f'{EC} select[name="moe"]') == "mixtral-8x7b"
    inputs = {**H100, "price": 3.0, "tflops": 989.0, "dtype": "bf16", "dense": "llama-3.1-8b", "moe": "mixtral-8x7b",
              "context": 2048, "batch": 128}
    r = real_ws.job("economics", **inputs)
    shown = read_figures(page)
    assert shown["cost_per_mtok_dense"] == pytest.approx(r["cost_per_mtok_dense"], rel=F64, abs=F64)
    assert shown["cost_per_mtok_moe"] == pytest.approx(r["cost_per_mtok_moe"], rel=F64, abs=F64)
    assert shown["gpus_needed"] == r["gpus_needed"]
    assert shown["experts_touched"] == pytest.approx(r["at_batch"]["moe"]["experts_touched"], rel=F64, abs=F64)
    assert shown["per_expert_batch"] == pytest.approx(r["at_batch"]["moe"]["per_expert_batch"], rel=F64, abs=F64)
    for side in ("dense", "moe"):
        s = r["at_batch"][side]
        for key, value in (("gpus", s["total_gpus"]), ("weight_bytes", s["weight_bytes"]), ("kv_bytes", s["kv_bytes"]),
                           ("flops", s["flops"]), ("memory_ms", s["memory_s"] * 1e3), ("compute_ms", s["compute_s"] * 1e3),
                           ("comm_ms", s["comm_s"] * 1e3), ("bubble", s["bubble"]), ("step_ms", s["step_s"] * 1e3),
                           ("tokens_per_s", s["tokens_per_s"]), ("cost", s["cost_per_mtok"])):
            assert shown[f"{key}_{side}"] == pytest.approx(value, rel=F64, abs=F64), (key, side)
    for x in r["sizing"]:
        assert shown[f"gpus_needed_{x['preset']}"] == x["gpus_needed"]
    # an independent check of one figure: Mixtral's GPUs for 128 sequences of 2,048 tokens in bf16
    assert shown["gpus_needed"] == math.ceil((2 * 46.7e9 + 128 * 2048 * 2 * 32 * 8 * 128 * 2) / (80e9 * 0.9))
    # editing a field recomputes: twice the price, twice the cost, and the chart follows
    y_before = page.evaluate(f"() => document.querySelector('{EC} .econ-chart').data[0].y[0]")
    page.fill(f'{EC} input[name="price"]', "6")
    page.wait_for_function(f"() => Number(document.querySelector('{EC} [data-figure=\"cost_per_mtok_dense\"]').dataset.value) "
                           f"> {1.5 * r['cost_per_mtok_dense']}")
    assert figure_value(page, "cost_per_mtok_dense", EC) == pytest.approx(2 * r["cost_per_mtok_dense"], rel=F64, abs=F64)
    assert figure_value(page, "cost_per_mtok_moe", EC) == pytest.approx(2 * r["cost_per_mtok_moe"], rel=F64, abs=F64)
    y_after = page.evaluate(f"() => document.querySelector('{EC} .econ-chart').data[0].y[0]")
    assert y_after == pytest.approx(2 * y_before, rel=F64, abs=F64)
    assert page.locator(f"{EC} .econ-chart .scatterlayer .trace").count() == 3      # two curves and the marks
    pg.assert_clean()
    assert server_children(server) == before               # no worker processes started or left


@pytest.mark.browser
@pytest.mark.real_model
def test_economics_on_the_walkthrough_at_phone_width(pg, real_ws, artifacts_dir):
    from conftest import on_a_phone
    snippet = on_a_phone(pg, "economics", "?economics.batch=256&economics.moe=mixtral-8x7b", artifacts_dir)
    assert "/embed/economics?" in snippet and "batch=256" in snippet and "moe=mixtral-8x7b" in snippet
    r = real_ws.job("economics", batch=256, moe="mixtral-8x7b")
    u = r["at_batch"]["moe"]["micro_seqs"]
    assert figure_value(pg.page, "per_expert_batch", EC) == pytest.approx(u * 2 / 8, rel=F64, abs=F64)
    assert figure_value(pg.page, "experts_touched", EC) == pytest.approx(8 * (1 - (1 - 2 / 8) ** u), rel=F64, abs=F64)
    pg.assert_clean()
