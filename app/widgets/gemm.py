"""Widget `gemm` (section 12): matrix-multiply time for 1 to 256 rows at SmolLM2's own layer
shapes, in the engine's weight formats, with a roofline of this machine.

One token through a linear layer is one row times the weight matrix: every weight is read from
memory for one multiply-add, so the time is the time to read the weights. Stack R rows (the tokens
of R requests: batching) and each weight read serves R rows; the time barely moves until the
arithmetic units, not memory, are the limit. The roofline model (Williams, Waterman & Patterson,
2009) draws this: attainable FLOP/s = min(peak FLOP/s, bandwidth x arithmetic intensity), where
the intensity of an (R, K) @ (K, N) product is 2RKN FLOPs over the bytes it moves (the weight
plus the activations). The knee is the row count where the intensity reaches the machine balance
(peak / bandwidth): below it a row is almost free, above it each row costs its arithmetic.

The products run through core/model/linear.py's kernels, the engine's own: PackedLinear in fp32, bf16
and q4_1 (the 4-bit format the server serves; in q4_1 the LM head is PackedQ8_0, the file's
8-bit embedding, as the engine runs it), on weights of each layer's shape
(values do not change the time). The job times one shape at one row count per slice (a warm-up
call, then the best of up to REPEATS within SLICE_S), then measures the machine: memory read
bandwidth and matmul peak in the format (a square product hot in cache, through the same product
as the points), best of TRIES, one try per slice. The largest slice is the LM head at 256 rows:
one call, about 0.2 s in fp32 on two threads.

Message: `gemm` {format, max_rows, run} -> a job (cached by its inputs; `run` is the reader's
"measure again" counter). The reply carries the machine, its threads and the time it ran.
"""

import time

import torch

from core.config import WeightFormat
from core.errors import InvalidParameter, is_int
from core.model.linear import PackedLinear, PackedQ8_0

from ..jobs import EXCLUSIVE, Progress
from .base import Widget, message
from .seam import machine, read_bandwidth, remeasure

ROWS = tuple(1 << i for i in range(9))      # 1, 2, 4, ... 256
FORMATS = ("fp32", "bf16", "q4_1")
DEFAULT_FORMAT, DEFAULT_MAX_ROWS = "fp32", 256
REPEATS = 5          # timed calls per point, best of: the machine is shared
SLICE_S = 0.05       # a point's repeats stop early past this much time in its slice (one call at least)
TRIES = 3            # bandwidth and peak: best of, one per slice
EXCLUSIVE_FLOPS = 4e9  # a product bigger than this (about a decode step here) waits for an idle engine
PEAK_SIZE = 1024     # (N, N) @ (N, N) for the peak: 2 N^3 FLOPs


def layer_shapes(mc) -> list[dict]:
    """The model's matmuls as (name, in K, out N): fused q/k/v, o, fused gate/up, down, LM head."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return [{"name": "q/k/v", "k": mc.hidden_size, "n": q + 2 * kv},
            {"name": "o", "k": q, "n": mc.hidden_size},
            {"name": "gate/up", "k": mc.hidden_size, "n": 2 * mc.intermediate_size},
            {"name": "down", "k": mc.intermediate_size, "n": mc.hidden_size},
            {"name": "LM head", "k": mc.hidden_size, "n": mc.vocab_size}]


def gemm(call) -> None:
    msg = call.msg
    fmt = msg.get("format", DEFAULT_FORMAT)
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise InvalidParameter("format", f"must be one of {sorted(FORMATS)}, got {fmt!r}")
    max_rows = msg.get("max_rows", DEFAULT_MAX_ROWS)
    if not is_int(max_rows) or max_rows not in ROWS or max_rows < 64:
        raise InvalidParameter("max_rows", f"must be one of {[r for r in ROWS if r >= 64]}, got {max_rows!r}")
    inputs = {"format": fmt, "max_rows": max_rows, "remeasure": remeasure(msg)}

    def work(engine):
        return (yield from gemm_job(engine, **inputs))
    call.job(inputs, work)


def gemm_job(engine, format: str, max_rows: int, remeasure: int):
    shapes = layer_shapes(engine.view.model_config)
    rows = [r for r in ROWS if r <= max_rows]
    total = len(shapes) * len(rows) + 2 * TRIES
    done = 0
    points = []
    for shape in shapes:
        weight, nbytes = product(format, shape)
        for r in rows:
            if 2 * r * shape["k"] * shape["n"] > EXCLUSIVE_FLOPS:
                yield EXCLUSIVE                  # a long product: time it while nobody is served
            seconds = time_product(weight, r, shape["k"])
            points.append(point(shape, nbytes, r, seconds))
            done += 1
            yield Progress(done, total, f"{shape['name']} ({shape['k']}→{shape['n']}), {r} rows")
    bandwidth = peak = 0.0
    for _ in range(TRIES):
        bandwidth = max(bandwidth, read_bandwidth())
        done += 1
        yield Progress(done, total, "memory bandwidth")
    for _ in range(TRIES):
        peak = max(peak, matmul_peak(format))
        done += 1
        yield Progress(done, total, f"{format} matmul peak")
    return summary(format, max_rows, remeasure, shapes, points, bandwidth, peak)


def product(format: str, shape: dict):
    """The engine's product for a weight of the shape's (N, K), and the bytes it reads: -> (a
    function of x (R, K), bytes)."""
    w = torch.randn(shape["n"], shape["k"]) * 0.02                    # (N, K)
    if format == "q4_1" and shape["name"] == "LM head":                # the Q8_0 embedding, as model.py runs it
        head = PackedQ8_0(w)
        return head, head.nbytes
    layer = PackedLinear(WeightFormat(format), w)
    return layer, layer.nbytes


def time_product(weight, rows: int, k: int) -> float:
    """Best time of weight(x) for x (rows, K). The first call is a warm-up, unless it alone took
    more than SLICE_S (then it is the measurement: the slice is already long); then up to REPEATS
    timed calls, stopping once the slice has run SLICE_S."""
    x = torch.randn(rows, k)                     # (R, K) fp32 activations, as the engine's
    start = time.perf_counter()
    weight(x)
    best = time.perf_counter() - start
    if best > SLICE_S:
        return best
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        weight(x)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > SLICE_S:
            break
    return best


def matmul_peak(format: str) -> float:
    """FLOP/s of one (N, N) @ (N, N) product in the format, hot in cache (compute-bound), through
    the engine's own product for it (PackedLinear), the one the points are timed on: a roof from
    another kernel would not bound them (oneDNN's plain bf16 matmul runs at about 1 GFLOP/s on a
    CPU without AVX-512 BF16, where the engine's bf16 runs at tens)."""
    a = torch.randn(PEAK_SIZE, PEAK_SIZE)
    multiply = PackedLinear(WeightFormat(format), torch.randn(PEAK_SIZE, PEAK_SIZE))
    multiply(a)
    t0 = time.perf_counter()
    multiply(a)
    return 2 * PEAK_SIZE ** 3 / (time.perf_counter() - t0)


def point(shape: dict, weight_bytes: int, rows: int, seconds: float) -> dict:
    flops = 2 * rows * shape["k"] * shape["n"]
    moved = weight_bytes + 4 * rows * (shape["k"] + shape["n"])     # weights + fp32 rows in and out
    return {"shape": shape["name"], "rows": rows, "ms": seconds * 1000.0, "us_per_row": seconds * 1e6 / rows,
            "rows_per_s": rows / seconds, "gflop_s": flops / seconds / 1e9, "intensity": flops / moved,
            "weight_bytes": weight_bytes}


def knee(shape: dict, weight_bytes: int, balance: float) -> float | None:
    """Rows R where the intensity 2RKN / (W + 4R(K+N)) reaches the machine balance B (FLOPs/byte):
    R = B W / (2KN - 4B(K+N)); None if the shape never gets there (intensity tops out below B)."""
    k, n = shape["k"], shape["n"]
    denominator = 2 * k * n - 4 * balance * (k + n)
    return balance * weight_bytes / denominator if denominator > 0 else None


def summary(format, max_rows, remeasure, shapes, points, bandwidth: float, peak: float) -> dict:
    balance = peak / bandwidth                                     # FLOPs per byte at the ridge
    for shape in shapes:
        mine = [p for p in points if p["shape"] == shape["name"]]
        shape["weight_bytes"] = mine[0]["weight_bytes"]
        shape["knee_rows"] = knee(shape, shape["weight_bytes"], balance)
        by_rows = {p["rows"]: p for p in mine}
        shape["speedup_64"] = by_rows[64]["rows_per_s"] / by_rows[1]["rows_per_s"]
    main = next(s for s in shapes if s["name"] == "gate/up")       # the model's largest per-layer product
    return {"machine": machine(), "run": remeasure, "format": format, "max_rows": max_rows, "repeats": REPEATS,
            "shapes": shapes, "points": points, "bandwidth_gb_s": bandwidth / 1e9, "peak_gflops": peak / 1e9,
            "machine_balance": balance, "knee_rows": main["knee_rows"], "knee_shape": main["name"],
            "speedup_64": main["speedup_64"]}


WIDGET = Widget("gemm", messages=(
    message("gemm", {"format", "max_rows", "run"}, gemm, job=True),
))
