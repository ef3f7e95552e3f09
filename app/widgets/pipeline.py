"""Widget `pipeline` (section 18): the model's 30 layers split into stages in real worker
processes, microbatches sent from stage to stage (core/parallel/pipeline.py, after GPipe), measured.

The job starts `stages` processes in one gloo group. Each loads the model and keeps its contiguous
range of layers; the microbatches (`tokens` tokens each, overlapping windows of a fixed text) go
through the stages with send and receive. The same group runs several schedules one after
another, with m = 1, 2, 4, 8 and the reader's `microbatches`, so the bubble can be drawn against
m from measured points, beside GPipe's formula (p - 1) / (m + p - 1). Each stage times every
microbatch on the machine's shared monotonic clock; the parent lines them up. The last stage
then runs its outputs through the whole model in one process: `bit_equal` says whether the
pipeline's final hidden states are exactly one process's.

Message: `pipeline` {stages, microbatches, tokens, run} -> a job (cached by its inputs; `run` is
the reader's "measure again" counter).
"""

from core.errors import InvalidParameter
from core.parallel.pipeline import PPSettings, bubble_formula, bubble_measured, check_batch, pp_worker, stage_ranges
from core.parallel.workers import WorkerGroup

from .base import Widget, integer, message
from ..processes import align, run_workers
from .seam import remeasure, worker_machine

MIN_STAGES, MAX_STAGES, DEFAULT_STAGES = 2, 4, 3
MAX_MICROBATCHES, DEFAULT_MICROBATCHES = 8, 4
MIN_TOKENS, MAX_TOKENS, DEFAULT_TOKENS = 4, 64, 16     # tokens per microbatch
SWEEP = (1, 2, 4, 8)                                   # microbatch counts always measured, for the curve
THREADS = 1                                            # torch threads per worker


def pipeline(call) -> None:
    msg = call.msg
    limit = call.config.max_worker_processes
    model, layers = call.config.model, call.info["num_layers"]
    stages = integer(msg, "stages", MIN_STAGES, MAX_STAGES, default=min(DEFAULT_STAGES, limit, layers))
    if stages > limit:
        raise InvalidParameter("stages", f"needs {stages} worker processes; this server runs at most {limit} "
                                         "(max_worker_processes)")
    if stages > layers:
        raise InvalidParameter("stages", f"must be at most the model's {layers} layers, got {stages}")
    microbatches = integer(msg, "microbatches", 1, MAX_MICROBATCHES, default=DEFAULT_MICROBATCHES)
    tokens = integer(msg, "tokens", MIN_TOKENS, MAX_TOKENS, default=DEFAULT_TOKENS)
    inputs = {"stages": stages, "microbatches": microbatches, "tokens": tokens, "remeasure": remeasure(msg)}
    budget, timeout = call.runtime.workers, call.config.worker_timeout_s

    def work(engine):
        return (yield from pipeline_job(engine, model, layers, stages, microbatches, tokens, inputs["remeasure"], budget, timeout))
    call.job(inputs, work)


def pipeline_job(engine, model: str, layers: int, stages: int, microbatches: int, tokens: int, remeasure: int,
                 budget, timeout: float):
    schedules = tuple(sorted(set(SWEEP) | {microbatches}))
    batch = check_batch(engine.view.tokenizer, max(schedules), tokens)
    group = WorkerGroup(pp_worker, stages, (model, batch, PPSettings(schedules=schedules)), timeout_s=timeout,
                        threads_per_worker=THREADS, budget=budget)
    results = yield from run_workers(engine, group, f"{stages} stages run {len(schedules)} schedules "
                                                    f"(m = {', '.join(map(str, schedules))})", expected_s=8.0 + stages)
    runs = []
    for i, m in enumerate(schedules):
        spans = [s for r in results for s in r["runs"][i]["spans"]]
        shown = align(spans)            # the figure's spans, in ms rounded to the microsecond
        runs.append({"microbatches": m, "bubble_measured": bubble_measured(shown, stages),
                     "bubble_formula": bubble_formula(stages, m), "spans": shown})
    chosen = next(r for r in runs if r["microbatches"] == microbatches)
    last = results[-1]
    return {
        "run": remeasure, "stages": stages, "microbatches": microbatches, "tokens": tokens, "num_layers": layers,
        "machine": worker_machine(stages, THREADS),
        "stage_layers": [[r.start, r.stop] for r in stage_ranges(layers, stages)],
        "load_s": [round(r["load_s"], 3) for r in results],
        "runs": runs, "schedules": list(schedules),
        "bubble_fraction_measured": chosen["bubble_measured"], "bubble_fraction_formula": chosen["bubble_formula"],
        "bit_equal": last["bit_equal"], "max_abs_diff": last["max_abs_diff"], "checked_microbatches": max(schedules),
        "activation_bytes": tokens * engine.view.model_config.hidden_size * 4,
    }


WIDGET = Widget("pipeline", messages=(
    message("pipeline", {"stages", "microbatches", "tokens", "run"}, pipeline, job=True),
))
