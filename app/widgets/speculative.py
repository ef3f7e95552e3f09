"""Widget `speculative` (section 20): speculative decoding on the reader's prompt, measured here.

A draft guesses k tokens, the model checks them in one forward pass and keeps the longest prefix
it agrees with plus one token of its own (Leviathan et al., 2023; Chen et al., 2023; the engine's
core/engine/speculative.py). Two drafts: prompt lookup (n-gram matches in the context, Saxena,
2023) and self-speculation (the model's own first layers with its shared head, as LayerSkip).

The job runs on a sibling engine in the serving engine's weight format, greedy, one request at a
time: plain decoding of the reader's prompt first, then both drafts for every k from 1 to MAX_K.
The draft and k the reader chose are read from that sweep, so its tiles and its row of the table
are one measurement. Each run is timed from the engine's own step records (the decode steps after
the first token), and its speed-up is plain decoding's time per token over its own. Greedy
speculative decoding must give plain decoding's tokens: `same_as_plain`.

Message: `speculative` {draft, k, text, run} -> a job (cached by its inputs; `run` is the
reader's "measure again" counter).
"""

from core.engine.sampling_params import SamplingParams, Speculation
from core.engine.trace import StepKind
from core.errors import InvalidParameter

from ..jobs import Progress
from .base import Widget, encode, integer, message, text
from .seam import machine, remeasure, step_until_finished, token_list, with_progress

MAX_K = 8                # the sweep's largest k (docs/widgets.md: k = 1..8)
GENERATE_TOKENS = 32     # tokens each run generates (greedy, past the end token)
DRAFTS = [s.value for s in Speculation]


def speculative(call) -> None:
    msg = call.msg
    draft = msg.get("draft", Speculation.NGRAM.value)
    if draft not in DRAFTS:
        raise InvalidParameter("draft", f"must be one of {DRAFTS}, got {draft!r}")
    k = integer(msg, "k", 1, MAX_K, default=4)
    ids = encode(call, text(msg))
    limit = call.info["context_window"] - GENERATE_TOKENS - MAX_K - 1
    if len(ids) > limit:
        raise InvalidParameter("text", f"is {len(ids)} tokens; the most this view takes is {limit}")
    inputs = {"draft": draft, "k": k, "ids": ids, "remeasure": remeasure(msg)}

    def work(engine):
        return (yield from speculative_job(engine, **inputs))
    call.job(inputs, work)


def run(sibling, ids: list[int], draft: str | None, k: int | None):
    """One greedy request on the sibling, one engine step per next(); returns its final output."""
    params = SamplingParams(temperature=0.0, max_tokens=GENERATE_TOKENS, ignore_eos=True,
                            speculation=draft, num_speculative_tokens=k)
    seq = sibling.add_request(ids, params)
    finished = yield from step_until_finished(sibling, [seq.request_id])
    return finished[seq.request_id]


def ms_per_token(out) -> float:
    """Decode time per token after the first: the decode (or verify) steps' time over their tokens."""
    decode_s = sum(s.duration_s for s in out.metrics.steps if s.kind == StepKind.DECODE)
    return decode_s * 1000.0 / (len(out.token_ids) - 1)


def row(out, plain, plain_ms: float, k: int) -> dict:
    stats = out.speculation
    spec_ms = ms_per_token(out)
    return {"k": k, "ms_per_token": round(spec_ms, 3), "speedup": round(plain_ms / spec_ms, 4),
            "acceptance_rate": stats.acceptance_rate, "tokens_per_pass": stats.tokens_per_pass,
            "same_as_plain": int(out.token_ids == plain.token_ids)}


def speculative_job(engine, draft: str, k: int, ids: list[int], remeasure: int):
    started = machine()
    block = engine.view.config.block_size
    sibling = engine.sibling(max_num_seqs=1, num_kv_blocks=-(-(len(ids) + GENERATE_TOKENS + MAX_K + 1) // block) + 1)
    sweep_runs = [(d, n) for d in DRAFTS for n in range(1, MAX_K + 1)]
    runs = [(None, None)] + sweep_runs
    total = len(runs) + 1
    count = iter(range(1, total + 1))
    note = lambda d, n: "plain decoding" if d is None else f"{d} draft, k = {n}"   # noqa: E731
    yield Progress(0, total, "a warm-up run")
    yield from run(sibling, ids[:8], None, None)                                  # first calls pay setup
    outs = []
    for d, n in runs:
        done = next(count)
        out = yield from with_progress(run(sibling, ids, d, n), lambda: Progress(done, total, note(d, n)))
        outs.append(out)
        yield Progress(done + 1, total, note(d, n))
    plain, sweep = outs[0], outs[1:]
    chosen = sweep[sweep_runs.index((draft, k))]
    plain_ms = ms_per_token(plain)
    tok = engine.view.tokenizer
    stats = chosen.speculation
    return {
        "machine": started, "run": remeasure, "draft": draft, "k": k, "prompt_tokens": len(ids),
        "generated_tokens": len(plain.token_ids), "weight_format": engine.view.config.weight_format.value,
        "draft_layers": sibling.speculator.draft_layers, "num_layers": engine.view.model_config.num_layers,
        "tokens": token_list(tok, chosen.token_ids),
        "passes": [{"proposed": token_list(tok, p.proposed), "accepted": p.accepted,
                    "token": token_list(tok, [p.token])[0]} for p in stats.passes],
        "acceptance_per_position": stats.acceptance_per_position,
        "proposed_per_position": stats.proposed_per_position,
        "plain_ms_per_token": round(plain_ms, 3),
        **row(chosen, plain, plain_ms, k),
        "sweep": {d: [row(out, plain, plain_ms, n) for (dd, n), out in zip(sweep_runs, sweep) if dd == d]
                  for d in DRAFTS},
    }


WIDGET = Widget("speculative", messages=(
    message("speculative", {"draft", "k", "text", "run"}, speculative, job=True),
))
