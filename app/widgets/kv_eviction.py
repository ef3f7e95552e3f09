"""Widget `kv-eviction` (section 20): what dropping old keys and values costs, measured on the real model.

A long conversation's KV cache grows by a token's keys and values every step. KV eviction keeps a
bounded part of it: a sliding window of the last w tokens, or, as StreamingLLM does (Xiao et al.,
2023, "Efficient Streaming Language Models with Attention Sinks"), the first s tokens as well,
because a trained model puts much of its attention on the first tokens (the `attention` widget's
sink_weight) and a window that drops them moves every softmax. The engine takes the rule as two
settings (EngineConfig.kv_sink_tokens, kv_window) and applies it as a mask in attention, in the C++
kernel and the torch path alike (core/model/attention.py, Eviction); the blocks are not freed, so the
memory figures are what an engine that frees them would keep: (s + w) tokens' keys and values.

The cost is measured as perplexity on a long held-out text, one sequence of LONG_TOKENS tokens of
the MoE perplexity table's held-out documentation topics (toy_models/train_router.py's
held_out_ids, read at run time): full attention, then for each window w the window alone and the
window with s sinks. The model is the serving weights in fp32 (engine.view.reference_model), run
block by block in short slices (core/inspect/probes.py) with the eviction mask. A rule's
perplexity depends on the model and the rule only, so each is kept per serving model: a reader
who changes the sinks waits only for the windows with the new sinks.

Message: `kv_eviction` {windows, sinks} -> a job. Reply: each run's perplexity and KV bytes kept.
"""

import math
import weakref

import torch

from core.errors import InvalidParameter, is_int
from core.inspect import probes
from core.model.attention import Eviction
from toy_models.train_router import held_out_ids

from ..jobs import Progress
from .base import Widget, integer, message
from .seam import machine

LONG_TOKENS = 1024              # the held-out sequence's length
WINDOWS = (32, 64, 128, 256, 512)
DEFAULT_WINDOWS = [64, 256]      # five reads of the text by default (about a minute on two busy cores)
MAX_SINKS = 16
DEFAULT_SINKS = 4


def kv_eviction(call) -> None:
    windows = call.msg.get("windows", DEFAULT_WINDOWS)
    if (not isinstance(windows, list) or not 1 <= len(windows) <= len(WINDOWS)
            or not all(is_int(w) and w in WINDOWS for w in windows) or len(set(windows)) != len(windows)):
        raise InvalidParameter("windows", f"must be a list of 1 to {len(WINDOWS)} different sizes from "
                                          f"{list(WINDOWS)}, got {windows!r}")
    sinks = integer(call.msg, "sinks", 1, MAX_SINKS, default=DEFAULT_SINKS)
    inputs = {"windows": sorted(windows), "sinks": sinks}

    def work(engine):
        return (yield from eviction_job(engine, **inputs))
    call.job(inputs, work)


def long_text(engine) -> list[int]:
    """LONG_TOKENS tokens of the held-out text, within the model's context window (the model reads
    it as one sequence without the engine's KV pool, so the pool's size does not bound it)."""
    return held_out_ids(engine.view.tokenizer)[:min(LONG_TOKENS, engine.view.model_config.max_position_embeddings)]


def perplexity_in_slices(model, ids: list[int], eviction: Eviction):
    """exp(mean -log p(token | the ones before it that the rule keeps)) over ids, in slices."""
    gen = probes.slices(model, ids, eviction=eviction, entropies=False)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            x = stop.value                                                   # (T, C)
            break
        yield None
    nll = 0.0
    targets = torch.tensor(ids[1:])
    with torch.inference_mode():
        h = model.norm(x[:-1])                                               # (T - 1, C)
        for start in range(0, len(targets), probes.ROWS):
            logits = model.logits(h[start:start + probes.ROWS]).double()    # (rows, V)
            logp = torch.log_softmax(logits, -1).gather(1, targets[start:start + probes.ROWS, None])
            nll -= float(logp.sum())
            yield None
    return math.exp(nll / len(targets))


_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # serving model -> {eviction rule: perplexity}


def eviction_job(engine, windows: list[int], sinks: int):
    ids = long_text(engine)
    pool = engine.view.kv_stats()                     # the serving pool: its dtype and bytes a token
    T, per_token = len(ids), pool["bytes_per_token"]
    model = engine.view.reference_model
    kept = _KEPT.setdefault(engine.view.model, {})
    runs = [("full", Eviction())] + [(f"window_{w}{suffix}", Eviction(s, w))
                                     for w in windows for suffix, s in (("_nosink", 0), ("", sinks))]
    results = {name: kept[rule] for name, rule in runs if rule in kept}
    todo = [(name, rule) for name, rule in runs if name not in results]
    for n, (name, rule) in enumerate(todo):
        gen = perplexity_in_slices(model, ids, rule)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                results[name] = kept[rule] = stop.value
                break
            yield Progress(n, len(todo), f"{'full attention' if name == 'full' else name.replace('_', ' ')}")
    rows = [{"window": w, "sinks": sinks, "perplexity": results[f"window_{w}"],
             "perplexity_nosink": results[f"window_{w}_nosink"],
             "kept_tokens": Eviction(sinks, w).kept_tokens(T),
             "kv_bytes": Eviction(sinks, w).kept_tokens(T) * per_token} for w in windows]
    out = {"machine": machine(), "tokens": T, "sinks": sinks, "windows": windows, "kv_bytes_per_token": per_token,
           "kv_cache_dtype": pool["dtype"],
           "perplexity_full": results["full"], "kv_bytes_full": T * per_token, "rows": rows,
           "engine_window": engine.view.config.kv_window, "engine_sinks": engine.view.config.kv_sink_tokens,
           "text": "the held-out documentation topics of the MoE perplexity table, as one sequence"}
    for row in rows:
        out[f"perplexity_window_{row['window']}"] = row["perplexity"]
        out[f"perplexity_window_{row['window']}_nosink"] = row["perplexity_nosink"]
        out[f"kv_bytes_window_{row['window']}"] = row["kv_bytes"]
    return out


WIDGET = Widget("kv-eviction", messages=(
    message("kv_eviction", {"windows", "sinks"}, kv_eviction, job=True),
))
