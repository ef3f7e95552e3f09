"""Widget `quantization` (section 20): the engine's four weight formats, side by side, measured.

Quantization stores weights in fewer bits and maps them back with a scale per group (llama.cpp's
Q8_0 and Q4_1 formats; Dettmers et al., 2022, "LLM.int8()", and Frantar et al., 2023, "GPTQ", for
the wider picture). A decode step reads every weight once, so fewer bytes make it faster where
the kernels keep up; the price is rounding, which moves the logits. For each of the engine's
formats (core/config.py WeightFormat: fp32, bf16, q8_0, q4_1) this widget runs a sibling engine in
that format (LLMEngine.sibling: the same fp32 weights, packed again in the format; the serving
format's sibling runs the serving model itself) and measures, here:

- weight_bytes: the bytes one decode step reads (Transformer.decode_weight_bytes);
- decode_tokens_per_s: decode alone, one request after the reader's text, from the engine's own
  step records (the median decode step);
- on the reader's text, every position's next-token distribution against fp32's: top5_agreement
  (the share of positions whose five most likely tokens are the same set) and kl (the mean of
  KL(fp32 || format) over the positions, in nats);
- perplexity on the held-out text of the MoE perplexity table (toy_models/train_router.py's
  text_pieces with its Settings: pieces of Python's documentation topics, read at run time), each
  piece its own sequence: exp(mean negative log-likelihood of each token given those before it).

The logits come from the format's own model run block by block (core/inspect/probes.py, one short
slice each) with its LM head as the engine runs it (bf16, q8_0, q4_1: the top lm_head_candidates
logits recomputed in fp32). The held-out perplexities depend on the model only, so they are kept
per serving model after the first job.

Message: `quantization` {text, run} -> a job. The reply has each format's figures, every position's
top candidates under each format (the reader picks the position in the browser), the serving
engine's format (from engine.view.config) and the machine.
"""

import math
import statistics
import weakref

import torch

from core.config import WeightFormat
from core.engine.trace import StepKind
from core.inspect import probes
from toy_models.train_router import Settings, text_pieces

from ..jobs import Progress
from ..lab.formats import TOP, compare, nll_sum
from .base import Widget, encode, message, text
from .seam import machine, ms, remeasure, run_request, token_list, with_progress

FORMATS = (WeightFormat.FP32, WeightFormat.BF16, WeightFormat.Q8_0, WeightFormat.Q4_1)
DECODE_TOKENS = 16          # decode steps timed after the reader's text
CHUNK_TOKENS = 32           # prefill tokens per engine step of the timed request: one slice


def quantization(call) -> None:
    ids = encode(call, text(call.msg))
    inputs = {"ids": ids, "remeasure": remeasure(call.msg)}

    def work(engine):
        return (yield from quantization_job(engine, **inputs))
    call.job(inputs, work)


# -- held-out text -------------------------------------------------------------------------------

_PERPLEXITY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # serving model -> {format: figures}


def held_out_pieces(tokenizer) -> tuple[list[list[int]], dict]:
    """The MoE perplexity table's held-out pieces (token lists) and their description."""
    _, held, about = text_pieces(tokenizer, Settings())
    return held, {"source": about["source"], "held_out": about["held_out"], "pieces": len(held),
                  "piece_tokens": about["chunk_tokens"], "predicted_tokens": sum(len(p) - 1 for p in held)}


# -- running one format --------------------------------------------------------------------------

def logits_in_slices(model, ids: list[int]):
    """Every position's logits (T, V) fp32 from `model` as its engine multiplies it, in slices."""
    gen = probes.slices(model, ids, entropies=False)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            x = stop.value                                                   # (T, C) the residual stream
            break
        yield None
    parts = []
    with torch.inference_mode():
        for rows in model.norm(x).split(probes.ROWS):
            parts.append(model.logits(rows).float())                         # (rows, V)
            yield None
    return torch.cat(parts)


def decode_speed(sibling, ids: list[int]):
    """One greedy request after `ids`, DECODE_TOKENS decode steps timed -> (tokens/s, median ms)."""
    out = yield from run_request(sibling, ids, DECODE_TOKENS + 1)
    steps = [s.duration_s for s in out.metrics.steps if s.kind == StepKind.DECODE]
    median = statistics.median(steps)
    return 1.0 / median, ms(median)


def format_job(engine, fmt: WeightFormat, ids: list[int], held: list[list[int]], known: dict | None, note):
    """Everything measured in format `fmt`: -> (figures, logits (T, V) of the reader's text)."""
    block = engine.view.config.block_size
    sibling = engine.sibling(weight_format=fmt, max_num_seqs=1, max_num_batched_tokens=CHUNK_TOKENS,
                             num_kv_blocks=-(-(len(ids) + DECODE_TOKENS + 1) // block) + 1,
                             enable_prefix_caching=False, enable_chunked_prefill=True)
    yield note("packed")
    model = sibling.view.model
    yield from with_progress(run_request(sibling, ids[:1], 1), lambda: note("warm-up"))  # first calls pay setup
    tokens_per_s, step_ms = yield from with_progress(decode_speed(sibling, ids), lambda: note("decode, timed"))
    logits = yield from with_progress(logits_in_slices(model, ids), lambda: note("the reader's text"))
    if known is None:
        total = 0.0
        for n, piece in enumerate(held):
            piece_logits = yield from with_progress(logits_in_slices(model, piece),
                                                    lambda: note(f"held-out piece {n + 1} of {len(held)}"))
            total += nll_sum(piece_logits, piece)
        predicted = sum(len(p) - 1 for p in held)
        known = {"perplexity": math.exp(total / predicted), "nll_sum": total}
    kernel = model.layers[0].attn.qkv_proj.kernel                         # linear.PackedLinear
    figures = {"format": fmt.value, "weight_bytes": model.decode_weight_bytes(),
               "decode_tokens_per_s": tokens_per_s, "decode_step_ms": step_ms,
               "product": kernel.product.value if kernel is not None else "plain",
               "activation_rounding": model.activation_rounding(),
               "attention_operands": model.attention_operands(), **known}
    return figures, known, logits


def candidates(tokenizer, logits: torch.Tensor) -> list[list[dict]]:
    """Every position's TOP candidates: [{id, text, prob}], most likely first."""
    probs = torch.softmax(logits.double(), -1)
    p, idx = probs.topk(TOP, -1)                                              # (T, TOP)
    texts = tokenizer.token_texts(idx.reshape(-1).tolist())
    return [[{"id": int(i), "text": texts[r * TOP + c], "prob": round(float(q), 6)}
             for c, (i, q) in enumerate(zip(row_i, row_p))] for r, (row_i, row_p) in enumerate(zip(idx, p))]


def quantization_job(engine, ids: list[int], remeasure: int):
    tokenizer = engine.view.tokenizer
    held, about = held_out_pieces(tokenizer)
    kept = _PERPLEXITY.setdefault(engine.view.model, {})
    # slices per format: packing, warm-up, prefill chunks and decodes, the text, the held-out pieces
    def slices(n):                        # probes.slices: per layer 3 pieces of ROWS rows and attention
        pieces = -(-n // probes.ROWS)
        return (3 * pieces + 1) * engine.view.model_config.num_layers + pieces
    per_format = [2 + 1 + -(-len(ids) // CHUNK_TOKENS) + DECODE_TOKENS + slices(len(ids))
                  + (0 if fmt.value in kept else sum(slices(len(p)) for p in held)) for fmt in FORMATS]
    total, done = sum(per_format), [0]

    def note_for(fmt):
        def note(what):
            done[0] += 1
            return Progress(min(done[0], total), total, f"{fmt.value}: {what}")
        return note

    rows, reference = [], None
    for fmt in FORMATS:
        figures, known, logits = yield from format_job(engine, fmt, ids, held, kept.get(fmt.value), note_for(fmt))
        kept[fmt.value] = known
        if reference is None:                                                 # fp32 runs first
            reference = logits
        stats = compare(logits, reference)
        stats.pop("kl_each")
        rows.append({**figures, **stats, "top": candidates(tokenizer, logits)})
    serving = engine.view.config.weight_format.value
    result = {"machine": machine(), "run": remeasure, "serving_format": serving,
              "tokens": token_list(tokenizer, ids), "formats": rows, "held_out": about, "top": TOP,
              "decode_tokens": DECODE_TOKENS, "lm_head_candidates": engine.view.config.lm_head_candidates}
    for row in rows:                                      # the figures under their contract's keys
        for key in ("weight_bytes", "decode_tokens_per_s", "top5_agreement", "kl", "perplexity"):
            result[f"{key}_{row['format']}"] = row[key]
    return result


WIDGET = Widget("quantization", messages=(
    message("quantization", {"text", "run"}, quantization, job=True),
))
