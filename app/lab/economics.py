"""What a decode step costs on GPUs we do not have: a roofline per step for a dense model and a
mixture of experts, and from it the price of a million output tokens at each concurrency.

The model, step by step (every formula is shown beside its number on the economics widget):
- A decode step gives each of the B sequences it serves one token. It reads the weights its tokens
  touch plus every sequence's KV cache, and does 2 FLOPs per active weight per token plus attention
  over the cached tokens. Its time is the roofline's (Williams, Waterman & Patterson 2009, "Roofline:
  an insightful visual performance model"): max(bytes / (GPUs x HBM bandwidth), FLOPs / (GPUs x
  FLOP/s)), plus the communication that is not hidden behind it.
- Dense: every weight, every step. Mixture of experts: the always-on weights (attention, embeddings,
  dense layers, shared experts) plus, in each MoE layer, the distinct experts the batch reaches. If
  each token picks k of E experts uniformly, a batch of B tokens reaches E(1 - (1 - k/E)^B) of them
  on average, and each expert sees B.k/E tokens (the per-expert batch): small batches leave the
  expensive weights idle but still paid for.
- Memory: weights + KV x sequences x context must fit in usable HBM: GPUs needed =
  ceil(that / (HBM x usable share)). A replica is deployed on 1, 2, 4 or 8 GPUs of one node (tensor
  and expert parallel, two all-reduces of the activations per layer, ring cost 2(g-1)/g x bytes /
  link + a latency), or on whole nodes, one pipeline stage per node.
- Pipeline: p stages and m microbatches in flight leave (p - 1) / (m + p - 1) of the time idle
  (GPipe, Huang et al. 2019); a step takes (m + p - 1) stage times, and each microbatch reads its
  stage's weights again.
- Each concurrency is served by the cheapest choice of replicas (data parallel copies, 1, 2, 4 ...)
  and microbatches (1, 2, 4 ... 64): cost per million tokens = GPUs x price per hour /
  (tokens per second x 3600) x 1e6.

Sources: the roofline paper above; the ring all-reduce's cost (Patarasuk & Yuan 2009, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", as NCCL runs it); GPipe (Huang et al.
2019) for the bubble; the default hardware from NVIDIA's H100 SXM datasheet (80 GB HBM3 at 3.35 TB/s,
989 dense bf16 and 1,979 fp8 TFLOP/s, NVLink 900 GB/s both ways) and 400 Gb/s InfiniBand per GPU,
with an assumed price; the model shapes from their public configs (static/data/models.json).

Not modelled: kernel efficiency below the roofline, overlap of communication with compute, uneven
routing, prefill, and the queueing of real traffic. The numbers are upper bounds on speed and lower
bounds on cost, good for comparing the two models, not for quoting prices.
"""

import math
from dataclasses import dataclass
from enum import Enum

ACTIVATION_BYTES = 2        # bf16 activations between GPUs
MAX_MICROBATCHES = 64       # the most microbatches a step is cut into


class Bound(str, Enum):
    MEMORY = "memory"        # bytes over bandwidth sets the stage time
    COMPUTE = "compute"      # FLOPs over FLOP/s does


@dataclass(frozen=True)
class Hardware:
    price_per_hour: float = 2.50    # $ per GPU-hour (assumed: a cloud H100 rate)
    hbm_gb: float = 80.0            # GB of HBM per GPU (H100 SXM)
    bandwidth_tb_s: float = 3.35    # TB/s of HBM bandwidth per GPU (H100 SXM)
    tflops: float = 1979.0          # dense TFLOP/s per GPU at the weights' format (H100 SXM: fp8 1979, bf16 989)
    link_gb_s: float = 450.0        # GB/s per GPU each way inside a node (NVLink 4: 900 both ways)
    network_gb_s: float = 50.0      # GB/s per GPU between nodes (400 Gb/s InfiniBand)
    gpus_per_node: int = 8          # GPUs one NVLink domain joins
    latency_us: float = 10.0        # fixed cost of one collective or hand-off (assumed)
    usable_hbm: float = 0.9         # share of HBM for weights and KV (the rest: activations, workspace)


@dataclass(frozen=True)
class Model:
    name: str
    params: float                   # every weight
    active: float                   # weights one token uses (all of them for a dense model)
    layers: int
    hidden: int                     # width of the activations sent between GPUs
    kv_bytes_per_token: float       # at the cache's format
    attention_flops: float          # FLOPs per new token per cached token, all layers
    experts: int = 0                # routed experts per MoE layer (0: dense)
    top_k: int = 0                  # experts each token picks
    moe_layers: int = 0             # layers whose MLP is a mixture of experts

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_params(self) -> float:
        """One routed expert: total - active = (E - k) x MoE layers x expert."""
        return (self.params - self.active) / ((self.experts - self.top_k) * self.moe_layers) if self.is_moe else 0.0

    @property
    def always_params(self) -> float:
        """Weights every token uses: active - k x MoE layers x expert."""
        return self.active - self.top_k * self.moe_layers * self.expert_params


def experts_touched(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens reach in one layer, each picking top_k of
    `experts` uniformly: E(1 - (1 - k/E)^B)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def per_expert_batch(model: Model, tokens: float) -> float:
    """Tokens each routed expert sees on average: B x k / E."""
    return tokens * model.top_k / model.experts


def weight_bytes(model: Model, tokens: float, bytes_per_weight: float) -> float:
    """Weight bytes a step of `tokens` tokens reads."""
    if not model.is_moe:
        return model.params * bytes_per_weight
    touched = experts_touched(model.experts, model.top_k, tokens)
    return (model.always_params + model.moe_layers * touched * model.expert_params) * bytes_per_weight


def kv_bytes(model: Model, seqs: float, context: int) -> float:
    """KV bytes a step reads: every sequence's cache of `context` tokens."""
    return seqs * context * model.kv_bytes_per_token


def step_flops(model: Model, tokens: float, context: int) -> float:
    """2 FLOPs per active weight per token, plus attention over `context` cached tokens."""
    return tokens * (2 * model.active + model.attention_flops * context)


def memory_needed(model: Model, bytes_per_weight: float, seqs: float, context: int) -> float:
    """Bytes that must sit in HBM: all the weights and every sequence's KV cache at full context."""
    return model.params * bytes_per_weight + seqs * context * model.kv_bytes_per_token


def gpus_needed(model: Model, hw: Hardware, bytes_per_weight: float, seqs: float, context: int) -> int:
    """ceil((weights + KV x sequences x context) / (HBM x usable share))."""
    return math.ceil(memory_needed(model, bytes_per_weight, seqs, context) / (hw.hbm_gb * 1e9 * hw.usable_hbm))


def deployed_gpus(needed: int, per_node: int) -> int:
    """A tensor-parallel group of 1, 2, 4 ... GPUs inside a node, or whole nodes."""
    if needed <= per_node:
        return min(1 << (max(needed, 1) - 1).bit_length(), per_node)
    return math.ceil(needed / per_node) * per_node


def pipeline_bubble(stages: int, microbatches: int) -> float:
    """The idle share of a pipeline of p stages with m microbatches: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def allreduce_s(nbytes: float, gpus: int, hw: Hardware) -> float:
    """A ring all-reduce over `gpus` GPUs of one node: 2(g - 1)/g x bytes / link + latency."""
    if gpus <= 1:
        return 0.0
    return 2 * (gpus - 1) / gpus * nbytes / (hw.link_gb_s * 1e9) + hw.latency_us * 1e-6


def handoff_s(nbytes: float, hw: Hardware) -> float:
    """Activations sent from one pipeline stage to the next, over the network."""
    return nbytes / (hw.network_gb_s * 1e9) + hw.latency_us * 1e-6


@dataclass(frozen=True)
class Step:
    """One decode step at a concurrency, on its cheapest deployment."""
    concurrency: int          # sequences served, each given one token a step
    replicas: int             # data-parallel copies of the model, each serving concurrency / replicas
    gpus: int                 # GPUs of one replica
    needed: int               # ... before rounding to a group or whole nodes
    stages: int               # pipeline stages (nodes) of a replica
    microbatches: int         # microbatches a replica's step is cut into
    micro_seqs: float         # sequences in one microbatch
    experts_touched: float    # distinct experts per MoE layer one microbatch reaches (0: dense)
    per_expert_batch: float   # tokens per routed expert in one microbatch (0: dense)
    weight_bytes: float       # weights one microbatch reads, whole model
    kv_bytes: float           # KV one microbatch reads, whole model
    flops: float              # FLOPs of one microbatch, whole model
    memory_s: float           # one stage, one microbatch: bytes / (its GPUs x bandwidth)
    compute_s: float          # ... FLOPs / (its GPUs x FLOP/s)
    comm_s: float             # ... its layers' all-reduces and the hand-off to the next stage
    bound: Bound
    bubble: float             # (p - 1) / (m + p - 1)
    step_s: float             # (m + p - 1) x (max(memory, compute) + communication)
    tokens_per_s: float       # all replicas: concurrency / step
    user_tokens_per_s: float  # one sequence: 1 / step
    cost_per_mtok: float      # replicas x GPUs x price / (tokens per second x 3600) x 1e6


def step(model: Model, hw: Hardware, bytes_per_weight: float, concurrency: int, context: int,
         replicas: int, microbatches: int) -> Step | None:
    """One deployment's step; None if a replica cannot hold its share (a stage per layer at most)."""
    seqs = concurrency / replicas
    needed = gpus_needed(model, hw, bytes_per_weight, seqs, context)
    gpus = deployed_gpus(needed, hw.gpus_per_node)
    stages = gpus // hw.gpus_per_node if gpus > hw.gpus_per_node else 1
    if stages > model.layers:
        return None
    per_stage = gpus // stages
    u = seqs / microbatches                                  # sequences (= tokens) per microbatch
    weights, kv, flops = weight_bytes(model, u, bytes_per_weight), kv_bytes(model, u, context), step_flops(model, u, context)
    memory_s = (weights + kv) / stages / (per_stage * hw.bandwidth_tb_s * 1e12)
    compute_s = flops / stages / (per_stage * hw.tflops * 1e12)
    activations = u * model.hidden * ACTIVATION_BYTES        # (u, hidden) in bf16
    comm_s = model.layers / stages * 2 * allreduce_s(activations, per_stage, hw)
    if stages > 1:
        comm_s += handoff_s(activations, hw)
    step_s = (microbatches + stages - 1) * (max(memory_s, compute_s) + comm_s)
    tokens_per_s = concurrency / step_s
    total_gpus = replicas * gpus
    return Step(
        concurrency=concurrency, replicas=replicas, gpus=gpus, needed=needed, stages=stages,
        microbatches=microbatches, micro_seqs=u,
        experts_touched=experts_touched(model.experts, model.top_k, u) if model.is_moe else 0.0,
        per_expert_batch=per_expert_batch(model, u) if model.is_moe else 0.0,
        weight_bytes=weights, kv_bytes=kv, flops=flops, memory_s=memory_s, compute_s=compute_s, comm_s=comm_s,
        bound=Bound.MEMORY if memory_s >= compute_s else Bound.COMPUTE,
        bubble=pipeline_bubble(stages, microbatches), step_s=step_s, tokens_per_s=tokens_per_s,
        user_tokens_per_s=1 / step_s,
        cost_per_mtok=total_gpus * hw.price_per_hour / (tokens_per_s * 3600) * 1e6)


def powers_of_two(limit: float) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def cheapest_step(model: Model, hw: Hardware, bytes_per_weight: float, concurrency: int, context: int) -> Step | None:
    """The cheapest step over replicas (1, 2, 4 ... up to the concurrency, and one per sequence) and
    microbatches (1, 2, 4 ... up to a replica's sequences, at most MAX_MICROBATCHES); ties go to
    fewer of each. None if even one sequence per replica does not fit."""
    best = None
    for replicas in sorted(set(powers_of_two(concurrency)) | {concurrency}):
        for microbatches in powers_of_two(min(concurrency / replicas, MAX_MICROBATCHES)):
            s = step(model, hw, bytes_per_weight, concurrency, context, replicas, microbatches)
            if s is not None and (best is None or s.cost_per_mtok < best.cost_per_mtok):
                best = s
    return best


def concurrencies(highest: int, extra: int | None = None) -> list[int]:
    """1 to `highest` in steps of about sqrt(2) (a log axis), with `extra` among them."""
    values = {round(2 ** (i / 2)) for i in range(0, 2 * int(math.log2(highest)) + 1)} | {highest}
    if extra is not None:
        values.add(extra)
    return sorted(v for v in values if 1 <= v <= highest)
