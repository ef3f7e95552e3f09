"""Remake toy_models/data/: the experts and top-2 routers of `smollm2-135m-moe16`, and its
perplexity table (MoEfication: Zhang et al., 2022, "MoEfication: Transformer Feed-forward Layers
are Mixtures of Experts").

    python -m toy_models.train_router                     # a few minutes on two cores
    python -m toy_models.train_router --quick --out DIR   # little text (for the tests)

1. Text: Python's own documentation topics (`pydoc_data.topics`, in the standard library, so it
   works offline), sorted by name; every fourth topic is held out for the perplexity table, the
   rest is calibration. Each side is cut into pieces of `chunk_tokens`, taken evenly spaced.
2. Activations: the dense model runs over the calibration pieces; each layer's MLP input (after
   its RMSNorm) is kept.
3. Experts, per layer: a = silu(gate x) * up x over the calibration tokens; unit i "fires" on a
   token when its contribution |a_i| * ||column i of down|| is in the token's top 10%. Each unit
   is described by the tokens it fires on, and balanced spherical k-means groups the units that
   fire together into 16 experts of exactly 96 (co-activation clustering). Firing sets group
   better than raw |a| (measured: a smaller error of the top-2 experts' sum in most layers).
4. Router, per layer: each expert's share of the MLP's output on each token, ||down_e a_e||; a
   linear router (576 -> 16, no bias) is trained with cross-entropy towards
   softmax(log(norm) / temperature), so its top k are the experts that contribute most.
5. Perplexity on the held-out pieces: the dense model, and the MoE model with top-k 1, 2, 4, 8
   and 16 (all experts: the dense model again, up to rounding). Written with the router.
"""

import argparse
import dataclasses
import math
import platform
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from core.model import Transformer

from .moe import DATA, NAME, NUM_EXPERTS, TOP_K, RouterFiles, derive, expert_weights, write_files


@dataclasses.dataclass(frozen=True)
class Settings:
    calibration_tokens: int = 6144    # tokens the experts and routers are fitted on
    eval_tokens: int = 2048           # held-out tokens the perplexities are measured on
    chunk_tokens: int = 256           # one piece of text, run as its own sequence
    held_out_every: int = 4           # every n-th documentation topic is held out
    firing_fraction: float = 0.10     # a unit fires on a token when in its top 10% of contributions
    kmeans_iters: int = 25            # rounds of balanced k-means (it usually settles sooner)
    router_steps: int = 300           # full-batch Adam steps per router
    router_lr: float = 1e-2
    temperature: float = 0.25         # of the router's target distribution over log-norms
    seed: int = 0
    top_ks: tuple = (1, 2, 4, 8, 16)  # the perplexity table's columns


QUICK = Settings(calibration_tokens=256, eval_tokens=128, chunk_tokens=64, kmeans_iters=3, router_steps=20)


def text_pieces(tokenizer, s: Settings):
    """-> (calibration pieces, held-out pieces, a description of the text), pieces as token lists."""
    import pydoc_data.topics as docs

    names = sorted(docs.topics)
    held = [n for i, n in enumerate(names) if i % s.held_out_every == s.held_out_every - 1]
    calib = [n for n in names if n not in held]

    def pieces(topic_names, tokens):
        ids = tokenizer.encode("\n\n".join(docs.topics[n] for n in topic_names))
        total, want = len(ids) // s.chunk_tokens, tokens // s.chunk_tokens
        picks = torch.linspace(0, total - 1, want).round().long().tolist()
        return [ids[i * s.chunk_tokens:(i + 1) * s.chunk_tokens] for i in picks], len(ids)

    cal, cal_total = pieces(calib, s.calibration_tokens)
    ev, ev_total = pieces(held, s.eval_tokens)
    about = {"source": f"pydoc_data.topics of Python {platform.python_version()} (the standard library's "
                       "documentation topics)", "topics": len(names),
             "held_out": f"every {s.held_out_every}th topic by name ({len(held)} topics, {ev_total:,} tokens)",
             "held_out_topics": held, "calibration_topics": len(calib), "calibration_pool_tokens": cal_total,
             "chunk_tokens": s.chunk_tokens, "calibration_tokens": sum(map(len, cal)),
             "eval_tokens": sum(map(len, ev)), "eval_chunks": len(ev)}
    return cal, ev, about


@torch.no_grad()   # not inference_mode: the routers are trained on these tensors
def mlp_inputs(model: Transformer, pieces) -> list[torch.Tensor]:
    """Each layer's MLP input over all pieces: [(N, C)] per layer."""
    store = [[] for _ in model.layers]
    hooks = [b.mlp.register_forward_pre_hook(lambda m, args, i=i: store[i].append(args[0].clone()))
             for i, b in enumerate(model.layers)]
    try:
        for ids in pieces:
            model(torch.tensor(ids), torch.arange(len(ids)))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(s) for s in store]


def group_units(a: torch.Tensor, down: torch.Tensor, num_experts: int, s: Settings, seed: int) -> torch.Tensor:
    """Balanced spherical k-means over the units' firing patterns: a (N, I), down (C, I) -> units
    (I,), the unit indices expert by expert, I / E per expert. Each round assigns (unit, centre)
    pairs from the most similar down, skipping full centres, so every expert gets exactly I / E."""
    contribution = a.abs() * down.norm(dim=0)                           # (N, I)
    fires = contribution >= contribution.quantile(1 - s.firing_fraction, dim=1, keepdim=True)
    X = F.normalize(fires.float().T, dim=-1)                            # (I, N) a unit's pattern
    I, cap = X.shape[0], X.shape[0] // num_experts
    g = torch.Generator().manual_seed(seed)
    centres = X[torch.randperm(I, generator=g)[:num_experts]]           # (E, N)
    assign = None
    for _ in range(s.kmeans_iters):
        order = (X @ centres.T).flatten().argsort(descending=True).tolist()  # (unit, centre) pairs
        new, fill, left = [-1] * I, [0] * num_experts, I
        for p in order:
            u, c = divmod(p, num_experts)
            if new[u] < 0 and fill[c] < cap:
                new[u], fill[c], left = c, fill[c] + 1, left - 1
                if not left:
                    break
        new = torch.tensor(new)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        centres = F.normalize(torch.stack([X[assign == c].mean(0) for c in range(num_experts)]), dim=-1)
    return torch.cat([torch.nonzero(assign == c).flatten() for c in range(num_experts)])


def contribution_norms(h: torch.Tensor, weights: dict, prefix: str) -> torch.Tensor:
    """||expert e's output|| for every token: h (N, C) -> (N, E)."""
    gate_up, down = weights[prefix + "experts.gate_up"], weights[prefix + "experts.down"]  # (E,2F,C), (E,C,F)
    gate, up = torch.einsum("nc,efc->enf", h, gate_up).chunk(2, dim=-1)                 # (E, N, F) each
    return torch.einsum("enf,ecf->enc", F.silu(gate) * up, down).norm(dim=-1).T         # (N, E)


def train_one_router(h: torch.Tensor, norms: torch.Tensor, s: Settings) -> torch.Tensor:
    """A linear router whose softmax follows softmax(log(norm) / T): (N, C), (N, E) -> (E, C)."""
    torch.manual_seed(s.seed)
    target = F.softmax(torch.log(norms + 1e-6) / s.temperature, dim=-1)   # (N, E)
    weight = torch.zeros(norms.shape[1], h.shape[1], requires_grad=True)
    opt = torch.optim.Adam([weight], lr=s.router_lr)
    for _ in range(s.router_steps):
        loss = -(target * F.log_softmax(h @ weight.T, dim=-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return weight.detach()


@torch.inference_mode()
def nll(model: Transformer, pieces) -> list[float]:
    """Summed negative log-likelihood (nats) of each piece's tokens 2..n given the ones before."""
    out = []
    for ids in pieces:
        logits = model.score(ids)[:-1]                                    # (n-1, V)
        out.append(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item())
    return out


def build(s: Settings, log=print) -> tuple[list, list, dict]:
    """Every step above: -> (units per layer, router per layer, the perplexity table)."""
    from core.models import load

    t0 = time.perf_counter()
    dense = load("smollm2-135m")
    cfg, sd = dense.config, dense.state_dict
    model = Transformer.from_state_dict(cfg, sd)
    calib, held, about = text_pieces(dense.tokenizer, s)
    log(f"text: {about['calibration_tokens']} calibration tokens, {about['eval_tokens']} held out")
    inputs = mlp_inputs(model, calib)
    log(f"activations collected ({time.perf_counter() - t0:.0f} s)")
    units, routers = [], []
    for i, h in enumerate(inputs):
        prefix = f"layers.{i}.mlp."
        gate, up = F.linear(h, sd[prefix + "gate_up_proj.weight"]).chunk(2, dim=-1)
        units.append(group_units(F.silu(gate) * up, sd[prefix + "down_proj.weight"], NUM_EXPERTS, s, s.seed + i))
        norms = contribution_norms(h, expert_weights(sd, i, units[-1], NUM_EXPERTS), prefix)
        routers.append(train_one_router(h, norms, s))
        log(f"layer {i}: experts grouped, router trained ({time.perf_counter() - t0:.0f} s)")
    del inputs
    files = RouterFiles(units, routers, {})
    moe_cfg, moe_sd = derive(cfg, sd, files)
    sums = {"dense": nll(model, held)}
    for k in s.top_ks:
        sums[str(k)] = nll(Transformer.from_state_dict(dataclasses.replace(moe_cfg, num_experts_per_token=k), moe_sd),
                           held)
        log(f"top-{k}: perplexity {math.exp(sum(sums[str(k)]) / (len(held) * (s.chunk_tokens - 1))):.2f}")
    predicted = sum(len(p) - 1 for p in held)
    table = {
        "model": NAME, "dense_model": cfg.name, "num_layers": cfg.num_layers, "experts": NUM_EXPERTS, "units_per_expert": cfg.intermediate_size // NUM_EXPERTS,
        "router_top_k": TOP_K, "method": "MoEfication: co-activation clustering (balanced spherical k-means on firing patterns), "
        "linear routers trained towards the experts' output norms",
        "perplexity": {k: math.exp(sum(v) / predicted) for k, v in sums.items()},
        "formula": "exp(sum of -log p(token | the tokens before it in its piece) / predicted tokens)",
        "predicted_tokens": predicted, "nll_sum": {k: sum(v) for k, v in sums.items()},
        "dense_nll_per_piece": sums["dense"], "text": about, "settings": dataclasses.asdict(s),
        "made_by": "python -m toy_models.train_router" + (" --quick" if s == QUICK else ""),
        "made_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return units, routers, table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m toy_models.train_router", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DATA), help=f"where the files go (default: {DATA})")
    p.add_argument("--quick", action="store_true", help="little text and few steps: a smoke test, not the shipped files")
    args = p.parse_args(argv)
    s = QUICK if args.quick else Settings()
    units, routers, table = build(s, log=lambda m: print(m, file=sys.stderr, flush=True))
    write_files(args.out, units, routers, table)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v:.2f}" for k, v in table["perplexity"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Settings", "QUICK", "build", "main"]
