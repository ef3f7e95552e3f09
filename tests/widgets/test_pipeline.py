"""Widget `pipeline` (section 18): the job starts one process per stage through the job runner.
On the tiny model (2 layers, so 2 stages): the bubble figures are recomputed here from the spans
and from the formula, the output's check is the worker's own (bit-equal), and no worker process
outlives its job. On the real model: the page, its figures and its screenshots."""

import os

import pytest

from bounds import U64, gamma
from conftest import figure_value, shoot_widget, wait_for, wait_ready, worker_processes

PP = '[data-widget="pipeline"]'


def test_pipeline_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["pipeline"].messages
    assert m.type == "pipeline" and m.job and m.fields == {"stages", "microbatches", "tokens", "run"}


def test_pipeline_refuses_bad_input_naming_the_field(ws):
    for fields, param in [
        ({"stages": 1}, "stages"), ({"stages": 5}, "stages"), ({"stages": "2"}, "stages"),
        ({"stages": 3}, "stages"),                         # the tiny model has 2 layers
        ({"microbatches": 0}, "microbatches"), ({"microbatches": 9}, "microbatches"),
        ({"tokens": 3}, "tokens"), ({"tokens": 65}, "tokens"), ({"tokens": 8.5}, "tokens"),
        ({"run": -1}, "run"),
    ]:
        err = ws.error({"type": "pipeline", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
        assert param in err["message"]


def bubble_here(spans: list, stages: int) -> float:
    """Idle share between the first start and the last end, from the compute spans."""
    busy = [s for s in spans if s[2] == "compute"]
    start, end = min(s[3] for s in busy), max(s[4] for s in busy)
    return 1 - sum(s[4] - s[3] for s in busy) / (stages * (end - start))


def check_result(r: dict, stages: int, microbatches: int, tokens: int, layers: int) -> None:
    assert (r["stages"], r["microbatches"], r["tokens"]) == (stages, microbatches, tokens)
    assert r["schedules"] == sorted({1, 2, 4, 8, microbatches})
    assert [m for s in r["stage_layers"] for m in range(*s)] == list(range(layers))
    for run in r["runs"]:
        m = run["microbatches"]
        # core.parallel.pipeline's bubble_formula and bubble_measured are these expressions, on the same
        # numbers in the same order (the reply keeps the spans' order): bit for bit
        assert run["bubble_formula"] == (stages - 1) / (m + stages - 1)
        assert run["bubble_measured"] == bubble_here(run["spans"], stages)
        compute = {(s[0], s[1]): s for s in run["spans"] if s[2] == "compute"}
        assert set(compute) == {(st, i) for st in range(stages) for i in range(m)}
        for (st, i), s in compute.items():     # on one clock: a stage starts after the one before ends
            if st:
                assert s[3] >= compute[(st - 1, i)][4]
        assert min(s[3] for s in run["spans"]) == 0.0
    chosen = next(run for run in r["runs"] if run["microbatches"] == microbatches)
    assert r["bubble_fraction_measured"] == chosen["bubble_measured"]
    assert r["bubble_fraction_formula"] == (stages - 1) / (microbatches + stages - 1)     # the same expression
    one = next(run for run in r["runs"] if run["microbatches"] == 1)
    # one microbatch: never two stages at once (checked above on these very spans), so exactly the busy
    # time is at most stages x span and measured >= (p - 1) / p; in float64 the p durations, their sum,
    # the span, its product, the divide and 1 - x are 2p + 3 roundings of numbers relative to <= 1
    assert one["bubble_measured"] >= one["bubble_formula"] - 2 * gamma(2 * stages + 4, U64)
    assert r["bit_equal"] and r["max_abs_diff"] == 0.0
    assert r["machine"]["workers"] == stages


def test_pipeline_job_on_the_tiny_model(ws):
    r = ws.job("pipeline", stages=2, microbatches=3, tokens=8)
    assert r["type"] == "pipeline", r
    check_result(r, 2, 3, 8, 2)
    assert r["activation_bytes"] == 8 * 64 * 4                          # T x C floats, tiny's C = 64
    cached = ws.job("pipeline", stages=2, microbatches=3, tokens=8)
    assert {k: v for k, v in cached.items() if k != "id"} == {k: v for k, v in r.items() if k != "id"}
    assert worker_processes(os.getpid()) == []


def test_closing_the_socket_ends_the_pipelines_workers(live_server):
    from conftest import WS
    client = WS(live_server.ws)
    client.send({"type": "pipeline", "id": "p", "stages": 2, "run": 77})
    wait_for(lambda: len(worker_processes(os.getpid())) == 2, timeout=60, what="two worker processes")
    client.close()
    wait_for(lambda: not worker_processes(os.getpid()), timeout=20, what="the workers to end with the socket")
    # close() reaps the processes, then frees their budget: a moment later, on the engine loop's thread
    wait_for(lambda: live_server.runtime.workers.in_use == 0, timeout=10, what="the worker budget back")


def test_a_stopping_server_ends_the_workers_of_a_running_job(tiny_loaded):
    """JobRunner.close (the server's shutdown) closes the job, and the job closes its group."""
    from app import create_app
    from app.widgets.pipeline import pipeline_job

    app = create_app({"model": "tiny", "num_kv_blocks": 16, "testing": True}, loaded=tiny_loaded)
    runtime = app.extensions["sendlens"]
    events = []

    def work(engine):
        return (yield from pipeline_job(engine, "tiny", 2, 2, 4, 8, 0, runtime.workers, 60))
    try:
        runtime.jobs.submit("owner", "token", "pipeline:stop-test", work, events.append)
        wait_for(lambda: len(worker_processes(os.getpid())) == 2, timeout=60, what="two worker processes")
    finally:
        runtime.shutdown()
    wait_for(lambda: not worker_processes(os.getpid()), timeout=20, what="the workers to end with the server")
    wait_for(lambda: runtime.workers.in_use == 0, timeout=10, what="the worker budget back")
    assert not [e for e in events if e.kind == "result"]          # it was stopped, not finished


@pytest.mark.browser
@pytest.mark.real_model
def test_pipeline_page_is_live_with_its_figures(pg, real_ws, server, artifacts_dir):
    query = "?stages=4&microbatches=6"
    shoot_widget(pg, "pipeline", artifacts_dir, query, ready_timeout=180_000)
    page = pg.page
    page.set_viewport_size({"width": 1280, "height": 800})
    pg.goto(f"/embed/pipeline{query}")
    wait_ready(page, PP, 180_000)
    r = real_ws.job("pipeline", stages=4, microbatches=6, tokens=16)       # from the cache
    check_result(r, 4, 6, 16, 30)
    assert figure_value(page, "stages") == 4 and figure_value(page, "microbatches") == 6
    for key in ("bubble_fraction_measured", "bubble_fraction_formula"):    # the reply's numbers: exact
        assert figure_value(page, key) == r[key], key
    assert figure_value(page, "bubble_fraction_formula") == 3 / 9       # (p - 1) / (m + p - 1), one rounding
    assert page.locator(f"{PP} .pp-timeline .bars .point").count() == 4 * 6
    assert page.locator(f"{PP} .pp-bubble .scatterlayer .trace").count() == 2     # measured and formula
    pg.assert_clean()
    wait_for(lambda: not worker_processes(server.proc.pid), timeout=20, what="the server's workers to end")


@pytest.mark.browser
@pytest.mark.real_model
def test_pipeline_on_the_walkthrough_at_phone_width(pg, server, artifacts_dir):
    from conftest import on_a_phone
    snippet = on_a_phone(pg, "pipeline", "?pipeline.stages=2&pipeline.tokens=8", artifacts_dir, ready_timeout=180_000)
    assert "/embed/pipeline?" in snippet and "stages=2" in snippet and "tokens=8" in snippet
    assert figure_value(pg.page, "stages", PP) == 2
    assert figure_value(pg.page, "bubble_fraction_formula", PP) == 1 / 5    # p = 2, m = 4: the same one rounding
    pg.assert_clean()
