"""Widget `economics` (section 22): why a giant mixture of experts is cheap at scale and dear for
one user. A dense model and a DeepSeek-V3-like MoE, priced per million output tokens against the
number of concurrent users, on hardware figures the reader edits (defaults: an H100 SXM-like GPU,
assumed). The cost model is app/lab/economics.py (a roofline per decode step); this module turns
the KV-memory widget's presets (app/presets.py, from each model's public config.json)
into its model shapes, checks the reader's inputs, and runs the curves as a job.

Shapes (sources in static/data/models.json): DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437):
671B weights, 37B active, 61 layers (3 dense, 58 MoE), 256 routed experts + 1 shared, top-8, MLA
caching a 512-value latent + a 64-value RoPE key per layer; Mixtral-8x7B (46.7B, 12.9B active, 8
experts, top-2); dense Llama-3.1-70B and 8B and SmolLM2-135M. Attention FLOPs per cached token:
4 x layers x heads x head size (QK and PV), or with MLA's absorbed projections 2 x layers x heads
x (2 x latent + RoPE key).

Message: `economics` {price, hbm, bandwidth, tflops, link, network, dtype, dense, moe, context,
batch} -> a job (one curve point per slice; cached by its inputs): both models' cheapest step at
each concurrency from 1 to MAX_CONCURRENCY, the step at `batch` in detail, and GPUs needed for
weights + KV at `context` x `batch` for every preset.
"""

from dataclasses import asdict

from app.lab import economics as econ
from core.errors import InvalidParameter

from ..jobs import Progress
from .base import Widget, integer, message, number
from ..presets import DTYPES, PRESETS, kv_bytes_per_token

MAX_CONCURRENCY = 16384
MAX_CONTEXT = 131072
KV_DTYPE = "bf16"                     # the KV cache's format (assumed, both models)
DENSE = tuple(k for k, p in PRESETS.items() if "experts" not in p)
MOE = tuple(k for k, p in PRESETS.items() if "experts" in p)
DEFAULTS = {"price": 2.5, "hbm": 80.0, "bandwidth": 3.35, "tflops": 1979.0, "link": 450.0, "network": 50.0,
            "dtype": "fp8", "dense": "llama-3.1-70b", "moe": "deepseek-v3", "context": 4096, "batch": 64}
NUMBERS = {  # field -> (lowest, highest, Hardware field)
    "price": (0.01, 1000.0, "price_per_hour"),
    "hbm": (1.0, 1024.0, "hbm_gb"),
    "bandwidth": (0.01, 100.0, "bandwidth_tb_s"),
    "tflops": (0.1, 100000.0, "tflops"),
    "link": (1.0, 10000.0, "link_gb_s"),
    "network": (0.1, 10000.0, "network_gb_s"),
}
ASSUMPTIONS = (
    "A step's time is the roofline's: every byte at the full HBM bandwidth, every FLOP at the full rate; "
    "real kernels reach less, and steps have launch and scheduling overheads, most felt at small batches.",
    "Every sequence holds the whole context in its KV cache (bf16) and gets one token a step; no prefill, "
    "no queueing.",
    "Each token picks its experts uniformly and independently (real routers are uneven, which costs more).",
    "A replica is 1, 2, 4 or 8 GPUs of one node (tensor and expert parallel: two all-reduces of the activations a "
    "layer over the NVLink), or whole nodes, one pipeline stage each, activations handed on over the network.",
    "A step is a pipeline flush: its m microbatches enter, the next step's wait for the last to leave; each "
    "microbatch reads its stage's weights again. Communication is not overlapped with compute.",
    "Each concurrency gets its cheapest deployment: replicas (copies) and microbatches, 1, 2, 4 ... of each.",
)


def model_of(key: str) -> econ.Model:
    """A preset of the KV-memory widget as the cost model's shape."""
    p = PRESETS[key]
    if p.get("mla"):
        attention = 2 * p["layers"] * p["heads"] * (2 * p["mla"]["latent"] + p["mla"]["rope"])
    else:
        attention = 4 * p["layers"] * p["heads"] * p["head"]
    e = p.get("experts", {})
    return econ.Model(name=p["label"], params=p["params"], active=p.get("active", p["params"]), layers=p["layers"],
                      hidden=p["hidden"], kv_bytes_per_token=kv_bytes_per_token(p, KV_DTYPE),
                      attention_flops=attention, experts=e.get("routed", 0), top_k=e.get("topK", 0),
                      moe_layers=e.get("moeLayers", 0))


def choice(msg: dict, name: str, choices) -> str:
    value = msg.get(name, DEFAULTS[name])
    if value not in choices:
        raise InvalidParameter(name, f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def economics(call) -> None:
    msg = call.msg
    inputs = {name: number(msg, name, lo, hi, default=DEFAULTS[name]) for name, (lo, hi, _) in NUMBERS.items()}
    inputs["dtype"] = choice(msg, "dtype", tuple(DTYPES))
    inputs["dense"] = choice(msg, "dense", DENSE)
    inputs["moe"] = choice(msg, "moe", MOE)
    inputs["context"] = integer(msg, "context", 1, MAX_CONTEXT, default=DEFAULTS["context"])
    inputs["batch"] = integer(msg, "batch", 1, MAX_CONCURRENCY, default=DEFAULTS["batch"])
    hw = hardware(inputs)
    for side in ("dense", "moe"):
        m = model_of(inputs[side])
        one = econ.step(m, hw, DTYPES[inputs["dtype"]], 1, inputs["context"], 1, 1)
        if one is None:
            raise InvalidParameter("hbm", f"{inputs['hbm']:g} GB a GPU is too little: {m.name} with one sequence "
                                          f"would need more pipeline stages than its {m.layers} layers")

    def work(engine):
        return (yield from economics_job(**inputs))
    call.job(inputs, work)


def hardware(inputs: dict) -> econ.Hardware:
    return econ.Hardware(**{field: inputs[name] for name, (_, _, field) in NUMBERS.items()})


def economics_job(**inputs):
    """Both curves, one concurrency per slice, then the step at `batch` and the sizing table."""
    hw, bpw = hardware(inputs), DTYPES[inputs["dtype"]]
    context, batch = inputs["context"], inputs["batch"]
    models = {side: model_of(inputs[side]) for side in ("dense", "moe")}
    points = econ.concurrencies(MAX_CONCURRENCY, batch)
    curves, at_batch = {"dense": [], "moe": []}, {}
    total, done = 2 * len(points), 0
    for side, model in models.items():
        for b in points:
            s = econ.cheapest_step(model, hw, bpw, b, context)
            if s is not None:
                curves[side].append(point(s))
                if b == batch:
                    at_batch[side] = step_dict(s)
            done += 1
            yield Progress(done, total, f"{model.name}, {b} concurrent users")
    sizing = [size(key, hw, bpw, context, batch) for key in PRESETS]
    moe_size = next(r for r in sizing if r["preset"] == inputs["moe"])
    return {
        "inputs": inputs,
        "hardware": asdict(hw),
        "kv_dtype": KV_DTYPE,
        "models": {side: shape(inputs[side], m) for side, m in models.items()},
        "curves": curves,
        "at_batch": at_batch,
        "sizing": sizing,
        "gpus_needed": moe_size["gpus_needed"],
        "cost_per_mtok_dense": at_batch["dense"]["cost_per_mtok"],
        "cost_per_mtok_moe": at_batch["moe"]["cost_per_mtok"],
        "assumptions": list(ASSUMPTIONS),
    }


def point(s: econ.Step) -> dict:
    return {"concurrency": s.concurrency, "cost_per_mtok": s.cost_per_mtok, "tokens_per_s": s.tokens_per_s,
            "user_tokens_per_s": s.user_tokens_per_s, "gpus": s.replicas * s.gpus, "replicas": s.replicas,
            "stages": s.stages, "microbatches": s.microbatches, "bound": s.bound.value,
            "experts_touched": s.experts_touched}


def step_dict(s: econ.Step) -> dict:
    out = asdict(s)
    out["bound"] = s.bound.value
    out["total_gpus"] = s.replicas * s.gpus
    return out


def shape(key: str, m: econ.Model) -> dict:
    out = asdict(m)
    out.update(preset=key, is_moe=m.is_moe, expert_params=m.expert_params, always_params=m.always_params)
    return out


def size(key: str, hw: econ.Hardware, bpw: float, context: int, batch: int) -> dict:
    """GPUs needed to hold a preset's weights and `batch` sequences of `context` tokens of KV."""
    m, window = model_of(key), PRESETS[key]["window"]
    return {"preset": key, "label": m.name, "weight_bytes": m.params * bpw,
            "kv_bytes": batch * context * m.kv_bytes_per_token, "kv_bytes_per_token": m.kv_bytes_per_token,
            "gpus_needed": econ.gpus_needed(m, hw, bpw, batch, context),
            "window": window, "beyond_window": context > window}


WIDGET = Widget("economics", messages=(
    message("economics", {"price", "hbm", "bandwidth", "tflops", "link", "network", "dtype", "dense", "moe",
                          "context", "batch"}, economics, job=True),
))
