"""Mixture of experts in one MLP: a router picks k of E experts for each token, and each expert runs
only on the tokens sent to it (Shazeer et al., 2017, "Outrageously Large Neural Networks: The
Sparsely-Gated Mixture-of-Experts Layer"; Fedus et al., 2021, "Switch Transformers").

Our experts come from MoEfication (Zhang et al., 2022, "MoEfication: Transformer Feed-forward
Layers are Mixtures of Experts"). A SwiGLU MLP, down(silu(gate(x)) * up(x)), is a sum over its
hidden units: unit i adds silu(gate_i . x) * (up_i . x) times column i of down. Cut the units into
E groups and each group is a small SwiGLU MLP of its own, an expert, and the sum of all E experts
IS the dense MLP. The router only chooses which k of them run; each chosen expert counts with
weight 1 (no softmax gate), so k = E gives back the dense model. toy_models/moe.py makes the
groups and trains the routers.

The forward pass is the grouped product of MoE engines (MegaBlocks' grouped GEMM, written as a
loop): router logits in fp32 -> the top-k experts of each token -> the (token, expert) pairs
sorted by expert -> one product per expert over just its tokens, through gemm.py's
batch-invariant kernels -> each token's k results summed in the order of their expert ids. Every
step treats a token's row on its own, so a request gives the same tokens alone and batched, as
with the dense MLP. core/parallel/expert_parallel.py runs the same steps with the experts in other processes.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.config import ModelConfig, WeightFormat
from core.errors import InvalidParameter, is_int
from core.model.linear import PackedLinear, linear


class Router(nn.Module):
    """x W^T with W (E, C): one logit per expert. Always fp32, in every weight format: it is small
    (E x C) and it decides which experts run."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x):  # (T, C) -> (T, E)
        return linear(x.float(), self.weight)


class Experts(nn.Module):
    """E small SwiGLU MLPs of F units each. gate_up (E, 2F, C): each expert's F gate rows, then its
    F up rows (one product for both, as the dense MLP's fused gate_up_proj); down (E, C, F). The
    weights start empty (checkpoints load over them); until pack() the products run in fp32."""

    def __init__(self, num_experts: int, hidden_size: int, expert_size: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * expert_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, expert_size))
        self.kernels: list[tuple[PackedLinear, PackedLinear]] | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def pack(self, fmt: WeightFormat) -> None:
        self.kernels = [(PackedLinear(fmt, gu.detach()), PackedLinear(fmt, d.detach()))
                        for gu, d in zip(self.gate_up, self.down)]

    def forward(self, e: int, x):  # expert e on its rows: (n, C) -> (n, C), fp32
        if self.kernels is None:
            gate, up = linear(x, self.gate_up[e]).chunk(2, dim=-1)       # (n, F) each
            return linear(F.silu(gate) * up, self.down[e])              # (n, C)
        gate_up, down = self.kernels[e]
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(F.silu(gate) * up).float()


def check_top_k(k, num_experts: int) -> int:
    if not is_int(k) or not 1 <= k <= num_experts:
        raise InvalidParameter("top_k", f"must be an integer from 1 to {num_experts}, got {k!r}")
    return k


def route(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k experts with the highest router logits, per token, in ascending expert order (the
    order their results are summed in): (T, E) -> (T, k) expert ids."""
    check_top_k(k, logits.shape[-1])
    return logits.topk(k, dim=-1).indices.sort(dim=-1).values


def grouped(experts, x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The grouped product: pair p runs expert ids[p] on x[rows[p]]. The pairs are sorted by expert
    (stable), each expert multiplies all its rows at once, and the results go back to the pairs'
    order. experts(e, rows) -> outputs; x (N, C), rows and ids (P,) -> (P, C) fp32."""
    order = torch.argsort(ids, stable=True)                                 # (P,) pairs by expert
    counts = torch.bincount(ids, minlength=experts.num_experts).tolist()    # pairs per expert
    out = torch.empty(ids.shape[0], x.shape[1])                             # (P, C)
    start = 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start:start + n]
            out[pairs] = experts(e, x[rows[pairs]])                        # (n, C)
        start += n
    return out


def combine(y: torch.Tensor) -> torch.Tensor:
    """Each token's k expert results summed in a fixed order (ascending expert id), one addition
    at a time, so the rounding never depends on the batch: (T, k, C) -> (T, C)."""
    out = y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + y[:, j]
    return out


class MoEMLP(nn.Module):
    """The MLP of a block as E experts and a router that picks `num_experts_per_token` of them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, k = cfg.num_experts, cfg.num_experts_per_token
        if not is_int(E) or E < 1 or cfg.intermediate_size % E:
            raise InvalidParameter("num_experts", f"must divide the MLP's {cfg.intermediate_size} units evenly, "
                                                  f"got {E!r}")
        if not is_int(k) or not 1 <= k <= E:
            raise InvalidParameter("num_experts_per_token", f"must be an integer from 1 to {E}, got {k!r}")
        self.top_k = k
        self.router = Router(cfg.hidden_size, E)
        self.experts = Experts(E, cfg.hidden_size, cfg.expert_size)

    def forward(self, x, top_k: int | None = None):  # (T, C) -> (T, C)
        k = self.top_k if top_k is None else top_k
        chosen = route(self.router(x), k)                                  # (T, k)
        T = x.shape[0]
        rows = torch.arange(T).repeat_interleave(k)                        # (T k,) each pair's token
        y = grouped(self.experts, x, rows, chosen.reshape(-1))             # (T k, C)
        return combine(y.view(T, k, -1))                                   # (T, C)


def batch_split(chosen: torch.Tensor, num_experts: int, sizes, draws: int = 16, seed: int = 0) -> dict:
    """How a global batch of B tokens splits into per-expert batches, measured on real routing:
    for each B in `sizes`, `draws` random sets of B of the routed tokens (chosen: (T, k) expert ids),
    and the means over the draws of the largest expert batch, of the number of experts that get
    any token, and of those experts' mean batch (B k / that number). Beside them, B k / E is what
    each expert would get if the load were spread evenly over all E."""
    g = torch.Generator().manual_seed(seed)
    T, k = chosen.shape
    out = {"sizes": [], "largest": [], "active": [], "mean_active": [], "even": []}
    for B in sizes:
        largest = active = mean_active = 0.0
        for _ in range(draws):
            counts = torch.bincount(chosen[torch.randperm(T, generator=g)[:B]].reshape(-1), minlength=num_experts)
            used = int((counts > 0).sum())
            largest, active, mean_active = largest + int(counts.max()), active + used, mean_active + B * k / used
        for key, value in zip(("sizes", "largest", "active", "mean_active", "even"),
                              (B, largest / draws, active / draws, mean_active / draws, B * k / num_experts)):
            out[key].append(value)
    return out
