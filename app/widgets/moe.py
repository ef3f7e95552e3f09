"""Widget `moe` (section 19): a mixture of experts on the real model, routed, then run in parallel.

The MoE model is `smollm2-135m-moe16` (toy_models/moe.py, MoEfication): the serving engine's own
dense weights with every MLP cut into 16 experts of 96 units along the shipped unit order, and the
shipped top-2 routers. It is derived here once per process, one layer per slice (about 320 MB of
expert matrices; every other tensor is shared with the serving engine), and kept. A server that
already runs the MoE model lends its weights as they are; a model without shipped routers (the
random `tiny`) gets experts in unit order and random routers from a fixed seed, like its random
weights, and no perplexity table. The MoE model runs in fp32 whatever the serving format.

Messages:
- `moe` {texts, top_k} -> a job: the reader's batch of texts through the MoE model with top_k
  experts per token (core/inspect/probes.py runs its blocks in short slices; forward hooks on the routers
  record their logits). Reply, per layer: the experts of the first 12 tokens of the batch and
  their router probabilities, each expert's load over the whole batch, and how global batches of
  1, 2, 4 ... of these tokens split into per-expert batches (core/model/moe.py's batch_split); and the
  perplexity table stored with the routers (dense against top-k on held-out text).
- `moe_parallel` (old name `moe-parallel`) {texts, top_k, layer, workers, run} -> a job: the batch's MLP inputs at `layer`
  through that layer with its experts split across `workers` processes (core/parallel/expert_parallel.py;
  started through the job runner within max_worker_processes, killed after worker_timeout_s,
  always closed), compared with the layer in this process, the all-to-all exchange timed. `run`
  is the reader's "measure again" counter.
"""

import dataclasses
import weakref

import torch

from core.errors import InvalidParameter, is_int
from core.inspect import probes
from core.model.model import Transformer
from core.model.moe import batch_split, route
from core.parallel import expert_parallel
from core.parallel.workers import start_in_slices, wait_in_slices
from toy_models import moe as moe_files

from ..jobs import Progress
from .base import Widget, alias, integer, message, rounded
from .seam import machine, remeasure, token_list

TOP_KS = (1, 2, 4, 8, 16)        # the choices, and the perplexity table's columns
MAX_TEXTS = 8
MAX_TEXT_CHARS = 2000
SHOWN_TOKENS = 12                # tokens drawn to their experts
DRAWS = 16                       # random batches per size in the per-expert batch sizes
WORKERS = (2, 4)                 # expert-parallel processes (they must divide 16 experts)
REPEATS = 5                      # timed runs of the layer in the workers, after one warm-up


class MoEModel:
    """The derived MoE model, with a Transformer per top-k sharing its tensors (built on demand)."""

    def __init__(self, cfg, state_dict: dict, table: dict | None, routers: str):
        self.config, self.state_dict, self.table, self.routers = cfg, state_dict, table or None, routers
        self._by_k: dict[int, Transformer] = {}

    def with_top_k(self, k: int) -> Transformer:
        if k not in self._by_k:
            cfg = dataclasses.replace(self.config, num_experts_per_token=k)
            self._by_k[k] = Transformer.from_state_dict(cfg, self.state_dict)
        return self._by_k[k]


class _Derivation:
    """One model's MoE variant: being derived (gen) or ready (value)."""

    def __init__(self):
        self.gen, self.value = None, None


_DERIVED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # serving model -> its _Derivation


def moe_model(engine):
    """Slices until the MoE variant of the serving engine's model is ready; returns it. Jobs run
    on the engine loop's one thread, so a derivation begun by one job is carried on by the next;
    kept per model (two apps in a process, e.g. tests, never share one, nor keep an old model alive)."""
    state = _DERIVED.get(engine.view.model)
    if state is None:
        state = _DERIVED[engine.view.model] = _Derivation()
    while state.value is None:
        if state.gen is None:
            state.gen = derive(engine)
        try:
            layer = next(state.gen)
        except StopIteration as stop:
            state.gen, state.value = None, stop.value
            break
        except BaseException:
            state.gen = None
            raise
        yield Progress(layer + 1, engine.view.model_config.num_layers, "cutting each MLP into experts (once)")
    return state.value


def derive(engine):
    cfg, sd = engine.view.model_config, engine.view.model.state_dict()
    if cfg.num_experts:                        # the server runs the MoE model itself
        shipped = moe_files.read_files().table
        return MoEModel(cfg, sd, shipped if cfg.name == moe_files.NAME else None, "served")
    files = moe_files.files_for(cfg)
    moe_cfg, moe_sd = yield from moe_files.derive_layers(cfg, sd, files)
    return MoEModel(moe_cfg, moe_sd, files.table, "trained" if files.table else "random")


# -- checks -----------------------------------------------------------------------------------

def batch_of(call) -> list[list[int]]:
    texts = call.msg.get("texts")
    if not isinstance(texts, list) or not 1 <= len(texts) <= MAX_TEXTS:
        raise InvalidParameter("texts", f"must be a list of 1 to {MAX_TEXTS} texts")
    if not all(isinstance(t, str) and t.strip() and len(t) <= MAX_TEXT_CHARS for t in texts):
        raise InvalidParameter("texts", f"must each be a non-empty string of at most {MAX_TEXT_CHARS} characters")
    ids = [call.tokenizer.encode(t) for t in texts]
    total, limit = sum(map(len, ids)), call.config.max_inspect_tokens
    if total > limit:
        raise InvalidParameter("texts", f"are {total} tokens together; the most this view takes is {limit} "
                                        "(max_inspect_tokens)")
    return ids


def top_k_of(msg: dict) -> int:
    k = msg.get("top_k", 2)
    if not is_int(k) or k not in TOP_KS:
        raise InvalidParameter("top_k", f"must be one of {list(TOP_KS)}, got {k!r}")
    return k


def moe(call) -> None:
    ids, k = batch_of(call), top_k_of(call.msg)

    def work(engine):
        return (yield from route_job(engine, ids, k))
    call.job({"texts": call.msg["texts"], "top_k": k}, work)


def moe_parallel(call) -> None:
    msg = call.msg
    ids, k = batch_of(call), top_k_of(msg)
    layer = integer(msg, "layer", 0, call.info["num_layers"] - 1)
    workers = msg.get("workers", 2)
    if not is_int(workers) or workers not in WORKERS:
        raise InvalidParameter("workers", f"must be one of {list(WORKERS)}, got {workers!r}")
    if workers > call.config.max_worker_processes:
        raise InvalidParameter("workers", f"{workers} is more worker processes than this server allows at once "
                                          f"({call.config.max_worker_processes}, max_worker_processes)")
    again = remeasure(msg)
    budget, timeout_s = call.runtime.workers, call.config.worker_timeout_s

    def work(engine):
        return (yield from parallel_job(engine, ids, k, layer, workers, again, budget, timeout_s))
    call.job({"texts": msg["texts"], "top_k": k, "layer": layer, "workers": workers, "remeasure": again}, work)


# -- the jobs ---------------------------------------------------------------------------------

def route_job(engine, texts: list[list[int]], k: int):
    moe = yield from moe_model(engine)
    model, cfg = moe.with_top_k(k), moe.config
    L, E = cfg.num_layers, cfg.num_experts
    logits = [[] for _ in range(L)]                                  # per layer: (rows, E) pieces
    hooks = [block.mlp.router.register_forward_hook(lambda m, args, out, i=i: logits[i].append(out))
             for i, block in enumerate(model.layers)]
    try:
        done = 0
        for n, ids in enumerate(texts):
            for item in probes.slices(model, ids, entropies=False):  # one short slice each
                done += item is not None
                yield Progress(done, len(texts) * L, f"text {n + 1} of {len(texts)} through the routers")
    finally:
        for h in hooks:
            h.remove()
    everything = [t for ids in texts for t in ids]
    T = len(everything)
    sizes = [2 ** i for i in range(T.bit_length()) if 2 ** i < T] + [T]
    layers = []
    for i in range(L):
        scores = torch.cat(logits[i])                                # (T, E)
        chosen = route(scores, k)                                    # (T, k)
        first = chosen[:SHOWN_TOKENS]
        layers.append({"load": torch.bincount(chosen.reshape(-1), minlength=E).tolist(),
                       "first": first.tolist(),
                       "first_probs": rounded(scores[:SHOWN_TOKENS].softmax(-1).gather(1, first), 4),
                       "split": {key: v if key == "sizes" else rounded(v, 4)
                                 for key, v in batch_split(chosen, E, sizes, DRAWS).items()}})
    shown = token_list(engine.view.tokenizer, everything[:SHOWN_TOKENS])
    owner = [n for n, ids in enumerate(texts) for _ in ids][:SHOWN_TOKENS]
    table = moe.table
    return {"model": cfg.name, "routers": moe.routers, "experts": E, "top_k": k, "expert_size": cfg.expert_size,
            "num_layers": L, "texts": len(texts), "batch_tokens": T,
            "tokens": [{**tok, "text_index": i} for tok, i in zip(shown, owner)], "layers": layers,
            "table": table, "perplexity_dense": table["perplexity"]["dense"] if table else None,
            "perplexity_topk": table["perplexity"][str(k)] if table else None}


def parallel_job(engine, texts: list[list[int]], k: int, layer: int, workers: int, remeasure: int, budget, timeout_s):
    moe = yield from moe_model(engine)
    model = moe.with_top_k(k)
    mlp = model.layers[layer].mlp
    rows = []                                                        # the layer's MLP inputs
    hook = mlp.register_forward_pre_hook(lambda m, args: rows.append(args[0].clone()))
    try:
        for n, ids in enumerate(texts):
            for item in probes.slices(model, ids, entropies=False):
                if item is not None and item.layer == layer:
                    break
                yield Progress(n, len(texts) + 2, f"text {n + 1} of {len(texts)} up to layer {layer}")
    finally:
        hook.remove()
    x = torch.cat(rows)                                              # (T, C)
    here = []
    with torch.inference_mode():
        for part in x.split(probes.ROWS):                            # the layer in this process
            here.append(mlp(part))
            yield Progress(len(texts), len(texts) + 2, "the layer in this process")
    here = torch.cat(here)                                           # (T, C)
    group = expert_parallel.worker_group(x, mlp, k, workers, REPEATS, timeout_s, budget)
    try:
        note = f"{workers} worker processes: starting, then {REPEATS + 1} runs of the layer"
        for gen in (start_in_slices(group, engine), wait_in_slices(group, engine)):
            while True:
                try:
                    next(gen)
                except StopIteration as stop:
                    results = stop.value
                    break
                yield Progress(len(texts) + 1, len(texts) + 2, note)
    finally:
        group.close()
    r = expert_parallel.summarize(results)
    diff = (r.pop("output") - here).abs().max().item()
    r.pop("pids")
    return {**r, "layer": layer, "workers": workers, "top_k": k, "run": remeasure, "batch_tokens": x.shape[0],
            "max_abs_diff": diff, "worker_threads": group.threads, "machine": machine()}


PARALLEL = message("moe_parallel", {"texts", "top_k", "layer", "workers", "run"}, moe_parallel, job=True)
WIDGET = Widget("moe", messages=(
    message("moe", {"texts", "top_k"}, moe, job=True),
    PARALLEL,
    alias("moe-parallel", of=PARALLEL),
))
