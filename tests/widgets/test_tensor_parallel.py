"""Widget `tensor-parallel` (section 17): the job starts real worker processes through the job
runner. On the tiny model (4 query heads, 2 KV heads): the answer is checked against the model
run here in one process, the per-layer figures against the spans they summarize, and no worker
process may outlive its job, whether it finished, was aborted or lost its socket. On the real
model: the page, its figures and its screenshots."""

import os

import pytest
import torch

from bounds import SPLIT_SUM_ERROR_RATIO, U64, against_f64, decimal_half, llama_logits_f64
from conftest import figure_value, shoot_widget, wait_for, wait_ready, worker_processes

TP = '[data-widget="tensor-parallel"]'
TEXT = "The capital of France is"


def test_tensor_parallel_registers_one_job():
    from app.widgets import BY_NAME
    m, old_name = BY_NAME["tensor-parallel"].messages
    assert old_name.type == "tensor-parallel" and old_name.alias_of == "tensor_parallel"  # accepted for one release
    assert m.type == "tensor_parallel" and m.job and m.fields == {"tp_degree", "text", "run"}


def test_tensor_parallel_refuses_bad_input_naming_the_field(ws):
    for fields, param in [
        ({"tp_degree": 0}, "tp_degree"), ({"tp_degree": 5}, "tp_degree"), ({"tp_degree": "2"}, "tp_degree"),
        ({"tp_degree": 3}, "tp_degree"),                  # 4 heads in 2 groups do not split in 3
        ({"text": ""}, "text"), ({"text": 7}, "text"), ({"text": "word " * 80}, "text"),   # over 64 tokens
        ({"run": -1}, "run"),
    ]:
        err = ws.error({"type": "tensor_parallel", "id": "bad", **fields}, "bad")
        assert err["param"] == param, (fields, err)
        assert param in err["message"]
    err = ws.error({"type": "tensor_parallel", "id": "bad", "tp_degree": 3}, "bad")
    assert "query heads" in err["message"] and "KV heads" in err["message"]    # says why


def per_layer(rank: dict, kind: str, layers: int) -> float:
    return sum(s[4] - s[3] for s in rank["spans"] if 0 <= s[0] < layers and s[2] == kind) / layers


def greedy_here(loaded, ids: list[int], n: int) -> tuple[torch.Tensor, list[int], float]:
    """The last position's logits and n greedy tokens of the model in this process, and the bound
    on |TP logit - this process's logit| (tests/bounds.py, SPLIT_SUM_ERROR_RATIO): TP's error against
    float64 is at most k times this process's own plus a floor, so the two differ by at most
    (k + 1) times this process's error plus the floor."""
    from core.model.model import Transformer
    model = Transformer.from_state_dict(loaded.config, loaded.state_dict)
    seq = list(ids)
    with torch.inference_mode():
        logits = model.score(ids)
        for _ in range(n):
            seq.append(int(model.score(seq)[-1].argmax()))
    _, tp_bound, err_one = against_f64(logits, logits, llama_logits_f64(model, ids), SPLIT_SUM_ERROR_RATIO)
    return logits[-1], seq[len(ids):], tp_bound + err_one


def check_result(r: dict, loaded, text: str, degree: int) -> None:
    cfg = loaded.config
    ids = loaded.tokenizer.encode(text)
    assert r["tp_degree"] == degree and r["prompt_tokens"] == len(ids)
    last, tokens, bound = greedy_here(loaded, ids, r["new_tokens"])
    assert r["tokens"] == tokens and r["tokens_equal"]             # the same greedy tokens as one process
    assert 0 <= r["max_logit_diff"] <= bound, (r["max_logit_diff"], bound)
    for t in r["top"]:              # the TP logits, against ours: the bound, and the reply's 6 places
        mine = float(last[t["token_id"]])
        assert t["logit"] == pytest.approx(mine, rel=0, abs=bound + decimal_half(6) + 2 * U64 * abs(mine))
    assert [t["token_id"] for t in r["top"]] == last.topk(10).indices.tolist()
    L = cfg.num_layers
    assert [rk["rank"] for rk in r["ranks"]] == list(range(degree))
    for rk in r["ranks"]:
        # app/widgets/tensor_parallel.py sums the same spans in the same order and divides by L: exact
        assert rk["compute_ms_per_layer"] == per_layer(rk, "compute", L)
        assert rk["allreduce_ms_per_layer"] == per_layer(rk, "allreduce", L)
        assert sum(1 for s in rk["spans"] if s[2] == "allreduce") == 2 * L
    assert min(s[3] for rk in r["ranks"] for s in rk["spans"]) == 0.0          # aligned on one clock
    # the same sum in the same order, the same divide: exact
    assert r["compute_ms_per_layer"] == sum(rk["compute_ms_per_layer"] for rk in r["ranks"]) / degree
    assert r["allreduce_ms_per_layer"] == sum(rk["allreduce_ms_per_layer"] for rk in r["ranks"]) / degree
    assert r["allreduce_bytes_per_layer"] == 2 * len(ids) * cfg.hidden_size * 4
    assert [s["bytes"] for s in r["sweep"]] == [s["rows"] * cfg.hidden_size * 4 for s in r["sweep"]]
    heads = [h for p in r["plan"] for h in range(*p["q_heads"])]
    assert heads == list(range(cfg.num_heads))
    assert r["machine"]["workers"] == degree and r["machine"]["threads_per_worker"] == 1


def test_tensor_parallel_job_on_the_tiny_model(ws, tiny_loaded):
    r = ws.job("tensor_parallel", tp_degree=2, text=TEXT)
    assert r["type"] == "tensor_parallel", r
    check_result(r, tiny_loaded, TEXT, 2)
    assert r["valid_degrees"] == [1, 2, 4]
    cached = ws.job("tensor_parallel", tp_degree=2, text=TEXT)
    assert {k: v for k, v in cached.items() if k != "id"} == {k: v for k, v in r.items() if k != "id"}
    assert worker_processes(os.getpid()) == []


def test_the_job_holds_the_engine_loop_only_briefly(tiny_loaded, monkeypatch):
    """Every slice is short: it polls the worker group at most once to start it and once to wait
    for it, each poll allowed at most 50 ms (counted, not timed), and it reports progress."""
    from app.jobs import Progress
    from app.widgets.tensor_parallel import tp_job
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine
    from core.parallel.workers import ProcessBudget, WorkerGroup

    polls: list[tuple[str, float]] = []          # (what, the longest wait it was allowed)
    start, wait = WorkerGroup.start, WorkerGroup.wait
    monkeypatch.setattr(WorkerGroup, "start", lambda self, wait_s=0.0: polls.append(("start", wait_s))
                        or start(self, wait_s))
    monkeypatch.setattr(WorkerGroup, "wait", lambda self, timeout=0.0: polls.append(("wait", timeout))
                        or wait(self, timeout))
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8), tiny_loaded)
    ids = tiny_loaded.tokenizer.encode(TEXT)
    budget = ProcessBudget(4)
    gen, items, marks = tp_job(engine, "tiny", tiny_loaded.config, 2, ids, 0, budget, 60, 4), [], [0]
    while True:
        try:
            items.append(next(gen))
        except StopIteration as stop:
            r = stop.value
            break
        finally:
            marks.append(len(polls))
    assert items and all(isinstance(i, Progress) and 0 <= i.done <= i.total and i.note for i in items)
    for a, b in zip(marks, marks[1:]):
        kinds = [what for what, _ in polls[a:b]]
        assert 1 <= len(kinds) <= 2 and len(set(kinds)) == len(kinds), kinds   # one start, one wait at most
    assert all(allowed <= 0.05 for _, allowed in polls)                       # a poll of 50 ms at most
    check_result(r, tiny_loaded, TEXT, 2)
    assert budget.in_use == 0 and worker_processes(os.getpid()) == []


def test_aborting_the_job_or_closing_the_socket_ends_its_workers(ws, live_server):
    from conftest import WS
    ws.send({"type": "tensor_parallel", "id": "a", "tp_degree": 2, "text": TEXT, "run": 101})
    pids = wait_for(lambda: len(worker_processes(os.getpid())) == 2 and worker_processes(os.getpid()),
                    timeout=60, what="two worker processes")
    ws.send({"type": "abort", "id": "a"})
    assert ws.recv_for("a")["code"] == "aborted"
    wait_for(lambda: not worker_processes(os.getpid()), timeout=20, what="the workers to end after abort")
    assert not set(pids) & set(worker_processes(os.getpid()))
    other = WS(live_server.ws)
    other.send({"type": "tensor_parallel", "id": "b", "tp_degree": 2, "text": TEXT, "run": 102})
    wait_for(lambda: len(worker_processes(os.getpid())) == 2, timeout=60, what="two worker processes")
    other.close()
    wait_for(lambda: not worker_processes(os.getpid()), timeout=20, what="the workers to end with the socket")
    # close() reaps the processes, then frees their budget: a moment later, on the engine loop's thread
    wait_for(lambda: live_server.runtime.workers.in_use == 0, timeout=10, what="the worker budget back")


@pytest.mark.browser
@pytest.mark.real_model
def test_tensor_parallel_page_is_live_with_its_figures(pg, real_ws, server, smollm_loaded, artifacts_dir):
    query = "?tp_degree=3"
    shoot_widget(pg, "tensor-parallel", artifacts_dir, query, ready_timeout=180_000)
    page = pg.page
    page.set_viewport_size({"width": 1280, "height": 800})
    pg.goto(f"/embed/tensor-parallel{query}")
    wait_ready(page, TP, 180_000)
    r = real_ws.job("tensor_parallel", tp_degree=3, text="The capital of France is Paris, and the capital of "
                                                         "Italy is")          # the page's default text: from the cache
    check_result(r, smollm_loaded, "The capital of France is Paris, and the capital of Italy is", 3)
    assert figure_value(page, "tp_degree") == 3
    for key in ("compute_ms_per_layer", "allreduce_ms_per_layer", "max_logit_diff"):   # the reply's numbers: exact
        assert figure_value(page, key) == r[key], key
    assert page.locator(f"{TP} .tp-timeline .bars .point").count() > 0
    assert page.locator(f"{TP} .tp-shards svg rect.shard").count() >= 3 * 4
    assert page.locator(f'{TP} select[name="tp_degree"] option[value="2"]').is_disabled()
    pg.assert_clean()
    wait_for(lambda: not worker_processes(server.proc.pid), timeout=20, what="the server's workers to end")


@pytest.mark.browser
@pytest.mark.real_model
def test_tensor_parallel_on_the_walkthrough_at_phone_width(pg, server, artifacts_dir):
    from conftest import on_a_phone
    snippet = on_a_phone(pg, "tensor-parallel", "?tensor-parallel.tp_degree=1", artifacts_dir, ready_timeout=180_000)
    assert "/embed/tensor-parallel?" in snippet and "tp_degree=1" in snippet
    assert figure_value(pg.page, "tp_degree", TP) == 1
    assert figure_value(pg.page, "max_logit_diff", TP) == 0.0      # one process: the same products exactly
    pg.assert_clean()
