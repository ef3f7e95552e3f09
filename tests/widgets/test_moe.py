"""Widget `moe` (section 19): a batch routed through the MoE model, and one layer run with its experts
in worker processes. The routing is checked against the MoE model run independently (a whole
forward pass with hooks, not the widget's sliced probe), the expert-parallel output against the
layer in one process, the perplexity figures against the stored table and transformers."""

import os

import pytest
import torch

from conftest import drain, figure_value, on_a_phone, shoot_widget, wait_ready, worker_processes

MOE = '[data-widget="moe"]'
TEXTS = ["The cat sat on the mat.", "def f(x): return x + 1", "Paris is in France."]
DEFAULT_TEXTS = [   # the widget's defaults (static/js/widgets/moe.js)
    "The cat sat on the mat and watched the rain run down the window.",
    "def mean(values): return sum(values) / len(values)",
    "In 1969 about 600 million people watched Apollo 11 land on the Moon.",
    "Bonjour, je m'appelle Marie et j'habite à Paris.",
]


def test_moe_registers_two_jobs():
    from app.widgets import BY_NAME
    route, parallel, old_name = BY_NAME["moe"].messages
    assert route.type == "moe" and route.job and route.fields == {"texts", "top_k"}
    assert parallel.type == "moe_parallel" and parallel.job
    assert old_name.type == "moe-parallel" and old_name.alias_of == "moe_parallel"  # accepted for one release
    assert parallel.fields == {"texts", "top_k", "layer", "workers", "run"}


def test_moe_refuses_bad_input_naming_the_field(ws):
    long = " ".join(["word"] * 80)                       # more than the live server's 64 tokens
    for kind, fields, param in [
        ("moe", {}, "texts"), ("moe", {"texts": "one text"}, "texts"), ("moe", {"texts": []}, "texts"),
        ("moe", {"texts": ["a"] * 9}, "texts"), ("moe", {"texts": ["ok", ""]}, "texts"),
        ("moe", {"texts": ["ok", 3]}, "texts"), ("moe", {"texts": [long]}, "texts"),
        ("moe", {"texts": TEXTS, "top_k": 3}, "top_k"), ("moe", {"texts": TEXTS, "top_k": "2"}, "top_k"),
        ("moe_parallel", {"texts": TEXTS, "layer": 2}, "layer"),          # tiny has layers 0 and 1
        ("moe_parallel", {"texts": TEXTS, "layer": 0, "workers": 3}, "workers"),
        ("moe_parallel", {"texts": TEXTS, "layer": 0, "workers": 8}, "workers"),
        ("moe_parallel", {"texts": TEXTS, "layer": 0, "run": -1}, "run"),
        ("moe_parallel", {"texts": TEXTS, "layer": 0, "top_k": 0}, "top_k"),
    ]:
        err = ws.error({"type": kind, "id": "bad", **fields}, "bad")
        assert err["param"] == param, (kind, fields, err)
        assert param in err["message"]
    assert ws.job("moe", texts=["still usable"])["type"] == "moe"


def independent_routing(loaded, texts: list[str], k: int):
    """Each layer's router logits over the batch, from whole forward passes of a separately derived
    MoE model (the widget runs its own cached model block by block)."""
    import dataclasses

    from core.model.model import Transformer
    from toy_models.moe import derive, files_for

    cfg, sd = derive(loaded.config, loaded.state_dict, files_for(loaded.config))
    model = Transformer.from_state_dict(dataclasses.replace(cfg, num_experts_per_token=k), sd)
    logits = [[] for _ in model.layers]
    hooks = [b.mlp.router.register_forward_hook(lambda m, a, out, i=i: logits[i].append(out))
             for i, b in enumerate(model.layers)]
    ids = [loaded.tokenizer.encode(t) for t in texts]
    with torch.inference_mode():
        for seq in ids:
            model(torch.tensor(seq), torch.arange(len(seq)))
    for h in hooks:
        h.remove()
    return [torch.cat(x) for x in logits], ids, model


def sliced_router_logits(model, ids: list[list[int]]) -> list[torch.Tensor]:
    """Each layer's router logits (T, E) computed as the widget computes them: the model's blocks
    run slice by slice by core/inspect/probes.py, one text at a time."""
    from core.inspect import probes
    logits = [[] for _ in model.layers]
    hooks = [b.mlp.router.register_forward_hook(lambda m, a, out, i=i: logits[i].append(out))
             for i, b in enumerate(model.layers)]
    try:
        with torch.inference_mode():
            for seq in ids:
                for _ in probes.slices(model, seq):
                    pass
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(x) for x in logits]


def check_routing(r, loaded, texts, k):
    from core.model.moe import route
    logits, ids, model = independent_routing(loaded, texts, k)
    sliced = sliced_router_logits(model, ids)
    T = sum(map(len, ids))
    assert r["batch_tokens"] == T and r["texts"] == len(texts) and r["top_k"] == k
    assert r["experts"] == 16 and r["num_layers"] == loaded.config.num_layers
    assert [t["id"] for t in r["tokens"]] == [t for seq in ids for t in seq][:12]
    for i, layer in enumerate(r["layers"]):
        chosen = route(logits[i], k)                                          # (T, k)
        assert layer["load"] == torch.bincount(chosen.reshape(-1), minlength=16).tolist()
        assert layer["first"] == chosen[:12].tolist()
        # the widget's probabilities: the same derived weights through the same sliced path
        # (sliced_router_logits) give the same router logits bit for bit, and the same fp32 softmax,
        # so only the reply's rounding to 4 places remains: half a unit (and the double nearest that
        # decimal). The choices above come from whole forward passes, independently.
        half = 0.5e-4 * (1 + 2.0 ** -40)
        probs = sliced[i][:12].softmax(-1).gather(1, chosen[:12]).double()
        assert ((torch.tensor(layer["first_probs"], dtype=torch.float64) - probs).abs() <= half).all()
        split = layer["split"]
        assert split["sizes"][-1] == T and split["sizes"][0] == 1
        assert split["even"] == pytest.approx([b * k / 16 for b in split["sizes"]], abs=half)   # rounded to 4 places
        # the whole batch is one draw however it is drawn
        assert split["largest"][-1] == max(layer["load"])
        assert split["active"][-1] == sum(c > 0 for c in layer["load"])
        assert split["mean_active"][-1] == pytest.approx(T * k / split["active"][-1], abs=half)   # rounded to 4 places
        assert split["largest"][0] == 1 and split["active"][0] == k       # one token: k experts, one row each


def test_moe_routes_the_batch_on_the_tiny_model(ws, tiny_loaded):
    r = ws.job("moe", texts=TEXTS, top_k=2)
    assert r["type"] == "moe" and r["routers"] == "random"
    assert r["table"] is None and r["perplexity_dense"] is None and r["perplexity_topk"] is None
    check_routing(r, tiny_loaded, TEXTS, 2)
    r4 = ws.job("moe", texts=TEXTS, top_k=4)
    check_routing(r4, tiny_loaded, TEXTS, 4)


@pytest.mark.slow   # starts worker processes (conftest.py: SLOW_MODULES says why make fast leaves them out)
def test_moe_parallel_equals_one_process_and_leaves_no_worker(ws, tiny_loaded):
    from core.model.moe import route
    r = ws.job("moe_parallel", texts=TEXTS, top_k=2, layer=1, workers=2, timeout=180)
    assert r["type"] == "moe_parallel", r
    assert (r["layer"], r["workers"], r["top_k"], r["run"]) == (1, 2, 2, 0)
    assert r["max_abs_diff"] == 0.0      # the same bits as one process (test_expert_parallel.py: batch-invariant kernels)
    logits, ids, _ = independent_routing(tiny_loaded, TEXTS, 2)
    chosen = route(logits[1], 2)
    T = sum(map(len, ids))
    assert r["batch_tokens"] == T and sum(r["tokens"]) == T
    for i, shard in enumerate(torch.arange(T).tensor_split(2)):              # rank i's tokens
        assert r["sent"][i] == torch.bincount((chosen[shard] // 8).reshape(-1), minlength=2).tolist()
    assert r["experts"] == [[0, 8], [8, 16]] and r["runs"] == 5 and r["worker_threads"] == 1
    assert r["alltoall_ms"] > 0 and r["total_ms"] >= r["alltoall_ms"]
    assert r["alltoall_ms"] == sorted(r["alltoall_runs_ms"])[2]               # the median of 5
    assert worker_processes(os.getpid()) == []


@pytest.mark.slow   # starts worker processes (conftest.py: SLOW_MODULES says why make fast leaves them out)
def test_the_jobs_run_in_short_slices(tiny_loaded):
    """Every slice is a piece of a probe pass or a poll of the workers: the job yields Progress only,
    many times, and leaves the serving engine alone."""
    from app.jobs import Progress
    from app.widgets.moe import parallel_job, route_job
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine
    from core.parallel.workers import ProcessBudget

    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8), tiny_loaded)
    ids = [tiny_loaded.tokenizer.encode(t) for t in TEXTS]
    for gen in (route_job(engine, ids, 2), parallel_job(engine, ids, 2, 0, 2, 0, ProcessBudget(2), 120)):
        items, r = drain(gen)
        assert all(isinstance(i, Progress) and 0 <= i.done <= i.total and i.note for i in items)
        assert len(items) >= len(ids) * 2                  # several slices per text and layer
    assert r["max_abs_diff"] == 0.0      # the same bits as one process (test_expert_parallel.py: batch-invariant kernels)
    assert engine.view.stats()["kv"]["used_blocks"] == 0


@pytest.mark.real_model
def test_moe_on_the_real_model_matches_an_independent_run_and_the_stored_table(real_ws, smollm_loaded):
    from toy_models.moe import read_files
    r = real_ws.job("moe", texts=TEXTS, top_k=2, timeout=300)
    assert r["type"] == "moe", r
    assert r["routers"] == "trained" and r["model"] == "smollm2-135m-moe16" and r["expert_size"] == 96
    table = read_files().table
    assert r["table"] == table
    assert r["perplexity_dense"] == table["perplexity"]["dense"] and r["perplexity_topk"] == table["perplexity"]["2"]
    check_routing(r, smollm_loaded, TEXTS, 2)


@pytest.mark.browser
@pytest.mark.real_model
def test_moe_page_shows_the_figures_and_leaves_no_worker(pg, real_ws, server, smollm_loaded, artifacts_dir):
    from toy_models.moe import read_files
    shoot_widget(pg, "moe", artifacts_dir, ready_timeout=300_000)
    page = pg.page
    pg.goto("/embed/moe?top_k=4&layer=20&workers=4")
    wait_ready(page, MOE, 300_000)
    assert page.input_value(f'{MOE} select[name="top_k"]') == "4"
    assert page.input_value(f'{MOE} select[name="layer"]') == "20"
    assert page.input_value(f'{MOE} select[name="workers"]') == "4"
    table = read_files().table
    assert figure_value(page, "experts") == 16
    assert figure_value(page, "top_k") == 4
    assert figure_value(page, "batch_tokens") == sum(len(smollm_loaded.tokenizer.encode(t)) for t in DEFAULT_TEXTS)
    # the table's floats through JSON and a JS number's shortest repr (data-value): exact
    assert figure_value(page, "perplexity_dense") == table["perplexity"]["dense"]
    assert figure_value(page, "perplexity_topk") == table["perplexity"]["4"]
    p = real_ws.job("moe_parallel", texts=DEFAULT_TEXTS, top_k=4, layer=20, workers=4, run=0)   # from the cache
    assert figure_value(page, "alltoall_ms") == p["alltoall_ms"]                     # the cached reply's, exact
    assert p["max_abs_diff"] == 0.0 and p["workers"] == 4     # bit-equal, as above
    assert page.locator(f"{MOE} .moe-routing svg path").count() == 12 * 4              # a line per choice
    assert page.locator(f"{MOE} .moe-load .trace.bars .point").count() == 16           # a bar per expert
    pg.assert_clean()
    snippet = on_a_phone(pg, "moe", "?moe.top_k=4&moe.workers=4", artifacts_dir, 300_000)
    assert "/embed/moe?" in snippet and "top_k=4" in snippet and "workers=4" in snippet
    pg.assert_clean()
    assert worker_processes(server.proc.pid) == []


def test_an_abandoned_parallel_job_closes_its_workers(tiny_loaded):
    """The job runner closes the generator of a job nobody waits for: its workers go with it."""
    import time

    from app.widgets.moe import parallel_job
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine
    from core.parallel.workers import ProcessBudget

    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8), tiny_loaded)
    budget = ProcessBudget(4)
    gen = parallel_job(engine, [tiny_loaded.tokenizer.encode(TEXTS[0])], 2, 1, 4, 0, budget, 120)
    deadline = time.monotonic() + 60
    while budget.in_use == 0 and time.monotonic() < deadline:   # up to the slice that starts them
        next(gen)
    assert budget.in_use == 4 and worker_processes(os.getpid())
    gen.close()
    assert budget.in_use == 0 and worker_processes(os.getpid()) == []
