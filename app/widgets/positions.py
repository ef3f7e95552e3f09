"""Widget `positions` (section 4): rotary position embedding on the model's real queries and keys.

RoPE (Su et al., 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding") turns
each pair of a head's dimensions by position x theta^(-2i/D). In Llama's "rotate half" layout,
pair i is dimensions (i, i + D/2). Because a rotation keeps dot products between rotated vectors
dependent only on the difference of their angles, q(m) . k(n) depends on m - n alone.

Message: `rope` {text, layer, head, query, key} -> a job that runs the probe pass up to `layer`
(core/inspect/probes.py, sliced per block), takes the pre-RoPE query of token `query` in `head` and the
pre-RoPE key of token `key` in that head's KV group, and rotates them with the model's own
`rotary` module (the code the forward pass uses):

- `clock`: every dimension pair of the query before and after rotation to positions NEAR and FAR,
  with the angle the formula predicts and the angle measured from the rotated vector;
- `table`: the attention logit q(p + offset) . k(p) / sqrt(D) for several absolute positions p and
  offsets, and its spread across p for each offset (float rounding only).
"""

import math

import torch

from core.errors import InvalidParameter
from core.inspect import probes

from ..jobs import Progress
from .base import Widget, encode, integer, message, text

NEAR, FAR = 5, 500                          # the two positions of the clock view
STARTS = (0, 100, 1000, 5000)               # positions p of the key in the offset check (those that fit)
OFFSETS = (0, 1, 2, 4, 8, 16, 64, 256, 1024)  # query position minus key position


def token_index(msg: dict, name: str, size: int, default: int) -> int:
    value = msg.get(name)
    if value is None:
        return default
    return probes.check_index(name, value, size)


def rope(call) -> None:
    info = call.info
    value = text(call.msg)
    ids = encode(call, value)
    T = len(ids)
    layer = integer(call.msg, "layer", 0, info["num_layers"] - 1, default=0)
    head = integer(call.msg, "head", 0, info["num_heads"] - 1, default=0)
    query = token_index(call.msg, "query", T, T - 1)
    key = token_index(call.msg, "key", T, max(query - 1, 0))
    if key > query:
        raise InvalidParameter("key", f"must be at most query ({query}): a token attends only to itself "
                                      f"and the tokens before it, got {key}")
    inputs = {"ids": ids, "layer": layer, "head": head, "query": query, "key": key}

    def work(engine):
        return (yield from rope_job(engine, **inputs))
    call.job(inputs, work)


def layer_record(model, ids: list[int], layer: int):
    """Run the probe pass up to `layer`, one slice per `next()`; returns its LayerRecord."""
    total = layer + 1
    gen = probes.slices(model, ids)
    try:
        for item in gen:
            if item is None:
                yield None
                continue
            if item.layer == layer:
                return item
            yield Progress(item.layer + 1, total, f"layer {item.layer + 1} of {total}")
    finally:
        gen.close()
    raise InvalidParameter("layer", f"the model has no layer {layer}")


def rope_job(engine, ids: list[int], layer: int, head: int, query: int, key: int):
    model = engine.view.reference_model
    record = yield from layer_record(model, ids, layer)
    cfg = model.config
    kv_head = head // (cfg.num_heads // cfg.num_kv_heads)
    q = record.q_raw[query, head]            # (D,) the query before RoPE
    k = record.k_raw[key, kv_head]           # (D,) the key before RoPE, shared by the head's group
    return {
        "tokens": [{"id": i, "text": t} for i, t in zip(ids, engine.view.tokenizer.token_texts(ids))],
        "layer": layer, "head": head, "kv_head": kv_head, "query": query, "key": key,
        "head_dim": cfg.head_dim, "theta": cfg.rope_theta,
        "q_raw": q.tolist(), "k_raw": k.tolist(),
        "q_rotated": record.q[query, head].tolist(), "k_rotated": record.k[key, kv_head].tolist(),
        "real_score": score(record.q[query, head], record.k[key, kv_head]),
        "clock": clock(model.rotary, q, cfg.rope_theta),
        **offset_table(model.rotary, q, k),
    }


def rotate(rotary, vector: torch.Tensor, positions) -> torch.Tensor:
    """One head vector (D,) rotated to each of `positions` by the model's rotary module: (P, D)."""
    positions = torch.as_tensor(positions, dtype=torch.long)
    return rotary(vector.expand(len(positions), 1, -1), positions)[:, 0]


def score(q: torch.Tensor, k: torch.Tensor) -> float:
    """The attention logit the softmax sees: q . k / sqrt(D)."""
    return float(q @ k) / math.sqrt(q.shape[-1])


def clock(rotary, q: torch.Tensor, theta: float) -> dict:
    """Each dimension pair (i, i + D/2) of q as a 2-D hand, at position 0 (no rotation), NEAR
    and FAR; the angle RoPE turns it by, from the formula and measured from the rotated vector."""
    D = q.shape[-1]
    half = D // 2
    rotated = rotate(rotary, q, [NEAR, FAR])                       # (2, D)
    inv_freq = [theta ** (-2 * i / D) for i in range(half)]          # radians per position, pair i
    before = torch.stack([q[:half], q[half:]], dim=-1)               # (D/2, 2)
    pairs = []
    for i in range(half):
        hand = {"pair": i, "dims": [i, i + half], "frequency": inv_freq[i],
                "before": before[i].tolist(), "length": float(before[i].norm())}
        for name, pos, r in (("near", NEAR, rotated[0]), ("far", FAR, rotated[1])):
            after = torch.stack([r[i], r[i + half]])
            measured = math.atan2(float(after[1]), float(after[0])) - math.atan2(float(before[i, 1]),
                                                                                 float(before[i, 0]))
            hand[name] = {"position": pos, "vector": after.tolist(),
                          "angle": pos * inv_freq[i],                       # the formula, unwrapped
                          "measured": math.remainder(measured, 2 * math.pi)}  # in (-pi, pi]
        pairs.append(hand)
    return {"near": NEAR, "far": FAR, "pairs": pairs}


def offset_table(rotary, q: torch.Tensor, k: torch.Tensor) -> dict:
    """q rotated to p + offset against k rotated to p, for every p in STARTS and offset in OFFSETS:
    the scores (len(OFFSETS), len(STARTS)) and their spread across p for each offset."""
    limit = rotary.cos.shape[0]                                      # the positions RoPE has angles for
    starts = [p for p in STARTS if p + max(OFFSETS) < limit]
    ks = rotate(rotary, k, starts)                                   # (P, D)
    rows = []
    for offset in OFFSETS:
        qs = rotate(rotary, q, [p + offset for p in starts])         # (P, D)
        rows.append((qs * ks).sum(-1) / math.sqrt(q.shape[-1]))     # (P,)
    scores = torch.stack(rows)                                       # (O, P)
    spread = scores.max(dim=1).values - scores.min(dim=1).values     # (O,)
    max_spread = float(spread.max())
    scale = float(scores.abs().max())
    return {"starts": starts, "offsets": list(OFFSETS), "scores": scores.tolist(),
            "spread": spread.tolist(), "max_spread": max_spread,
            "max_spread_rel": max_spread / scale if scale else 0.0,
            "offset_range": float(scores.mean(dim=1).max() - scores.mean(dim=1).min())}


WIDGET = Widget("positions", messages=(
    message("rope", {"text", "layer", "head", "query", "key"}, rope, job=True),
))
