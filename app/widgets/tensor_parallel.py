"""Widget `tensor-parallel` (section 17): the model's layers split by heads and MLP columns across
real worker processes (core/parallel/tensor_parallel.py, after Megatron-LM), measured.

The job starts `tp_degree` processes in one gloo group. Each loads the model, keeps its share of
every block (its query heads with the KV heads they read, its slice of the MLP's middle) and the
replicated embedding and norms, and runs the reader's prompt, timing each layer's compute and
each all-reduce on the machine's shared monotonic clock; then a few greedy tokens, and a sweep of
all-reduces of 1 to 1,024 rows (the volume grows with the batch). Rank 0 first runs the whole
model in one process, the reference for `max_logit_diff` and the greedy tokens.

Degrees: those that split the heads into whole grouped-query groups (1 and 3 for SmolLM2: 9 query
heads, 3 KV heads) up to `max_worker_processes`; 2 and 4 are refused with the reason (the
InvalidParameter of core.parallel.tensor_parallel.check_degree, naming `tp_degree`).

Message: `tensor_parallel` (old name `tensor-parallel`) {tp_degree, text, run} -> a job (cached by its inputs; `run` is the
reader's "measure again" counter).
"""

from core.errors import InvalidParameter
from core.parallel.tensor_parallel import Kind, TPSettings, check_degree, shard_plan, tp_worker, valid_degrees
from core.parallel.workers import WorkerGroup

from .base import Widget, alias, encode, integer, message
from ..processes import align, run_workers
from .seam import remeasure, worker_machine

MAX_TOKENS = 128           # the prompt's tokens at most: each rank runs it several times
DEFAULT_TEXT = "The capital of France is Paris, and the capital of Italy is"
NEW_TOKENS = 4             # greedy tokens after the prompt, each a full recompute on every rank
SWEEP_ROWS = (1, 4, 16, 64, 256, 1024)   # batch rows of the all-reduce sweep
SWEEP_REPEATS = 5                        # all-reduces timed per row count (the median is shown)
THREADS = 1                # torch threads per worker


def default_degree(cfg, limit: int) -> int:
    """The largest degree up to 3 that splits the model's heads (3 for SmolLM2, 2 for tiny)."""
    return max(valid_degrees(cfg, min(3, limit)))


def tensor_parallel(call) -> None:
    msg = call.msg
    cfg = call.runtime.engine.view.model_config
    limit = call.config.max_worker_processes
    degree = integer(msg, "tp_degree", 1, limit, default=default_degree(cfg, limit))
    check_degree(cfg, degree)
    text = msg.get("text", DEFAULT_TEXT)
    ids = prompt(call, text)
    inputs = {"tp_degree": degree, "text": text, "remeasure": remeasure(msg)}
    model = call.config.model
    budget, timeout = call.runtime.workers, call.config.worker_timeout_s

    def work(engine):
        return (yield from tp_job(engine, model, cfg, degree, ids, inputs["remeasure"], budget, timeout, limit))
    call.job(inputs, work)


def prompt(call, text) -> list[int]:
    if not isinstance(text, str) or not text:
        raise InvalidParameter("text", "must be a non-empty string")
    ids = encode(call, text, "text")
    if len(ids) > MAX_TOKENS:
        raise InvalidParameter("text", f"is {len(ids)} tokens; this view takes at most {MAX_TOKENS}")
    return ids


def tp_job(engine, model: str, cfg, degree: int, ids: list[int], remeasure: int, budget, timeout: float, limit: int):
    settings = TPSettings(new_tokens=NEW_TOKENS, sweep_rows=SWEEP_ROWS, sweep_repeats=SWEEP_REPEATS)
    group = WorkerGroup(tp_worker, degree, (model, ids, settings), timeout_s=timeout,
                        threads_per_worker=THREADS, budget=budget)
    results = yield from run_workers(engine, group, f"{degree} ranks run the prompt, {NEW_TOKENS} tokens and "
                                                    "the all-reduce sweep", expected_s=6.0 + 2.0 * degree)
    return tp_result(engine, cfg, degree, ids, remeasure, results, limit)


def tp_result(engine, cfg, degree: int, ids: list[int], remeasure: int, results: list[dict], limit: int) -> dict:
    L = cfg.num_layers
    spans = align([(r["rank"], *s) for r in results for s in r["timeline"]], start=4)
    ranks = []
    for r in results:
        mine = [s for s in spans if s[0] == r["rank"]]
        per = {k.value: sum(s[5] - s[4] for s in mine if 0 <= s[1] < L and s[3] == k.value) / L for k in Kind}
        ranks.append({"rank": r["rank"], "load_s": round(r["load_s"], 3), "threads": r["threads"],
                      "compute_ms_per_layer": per[Kind.COMPUTE.value],
                      "allreduce_ms_per_layer": per[Kind.ALLREDUCE.value],
                      "spans": [[s[1], s[2], s[3], s[4], s[5]] for s in mine]})
    first = results[0]
    tokenizer = engine.view.tokenizer
    return {
        "run": remeasure, "tp_degree": degree, "prompt_tokens": len(ids), "new_tokens": NEW_TOKENS,
        "machine": worker_machine(degree, THREADS),
        "shape": {"num_layers": L, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                  "head_dim": cfg.head_dim, "hidden_size": cfg.hidden_size,
                  "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size},
        "valid_degrees": valid_degrees(cfg, limit), "max_worker_processes": limit,
        "plan": shard_plan(cfg, degree), "whole_params": shard_plan(cfg, 1)[0]["params"], "ranks": ranks,
        "compute_ms_per_layer": sum(r["compute_ms_per_layer"] for r in ranks) / degree,
        "allreduce_ms_per_layer": sum(r["allreduce_ms_per_layer"] for r in ranks) / degree,
        "allreduce_bytes_per_layer": first["allreduce_bytes_per_layer"],
        "sweep": [{**s, "ms": round(s["ms"], 4), "min_ms": round(s["min_ms"], 4)} for s in first["sweep"]],
        "sweep_repeats": SWEEP_REPEATS,
        "max_logit_diff": first["max_logit_diff"],
        "tokens": first["tokens"], "reference_tokens": first["reference_tokens"],
        "tokens_equal": first["tokens"] == first["reference_tokens"],
        "continuation": tokenizer.decode(first["tokens"]),
        "top": [{"token_id": t, "text": tokenizer.decode([t]), "logit": round(v, 6)}
                for t, v in zip(first["top_ids"], first["top_logits"])],
    }


MESSAGE = message("tensor_parallel", {"tp_degree", "text", "run"}, tensor_parallel, job=True)
WIDGET = Widget("tensor-parallel", messages=(MESSAGE, alias("tensor-parallel", of=MESSAGE)))
