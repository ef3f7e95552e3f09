"""Remake toy_models/data/: the experts and top-2 routers of `smollm2-135m-moe16`, and its
perplexity table (MoEfication: Zhang et al., 2022, "MoEfication: Transformer Feed-forward Layers
are Mixtures of Experts").

    python -m toy_models.train_router                     # a few minutes on two cores
    python -m toy_models.train_router --quick --out DIR   # little text (for the tests)

1. Text: Python's own documentation topics (`pydoc_data.topics`, in the standard library, so it
   works offline), sorted by name; every fourth topic is held out for the perplexity table, the
   rest is calibration. Each side is cut into pieces of `chunk_tokens`, taken evenly spaced.
2. Layer by layer, in order: the calibration pieces' residual streams go through the layer's
   attention, and its MLP inputs (after the RMSNorm) are what steps 3 and 4 fit on. The new MoE
   layer (top-2) then updates the streams, so every router learns from the inputs it will get
   when the layers before it are experts too: fitted on the dense model's inputs instead
   (`follow_moe=False`), the routers went wrong on the shifted inputs, and held-out perplexity at
   top-2 was in the hundreds of millions.
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

from core.model.model import Transformer
from core.model.moe import MoEMLP

from .moe import DATA, NAME, NUM_EXPERTS, TOP_K, RouterFiles, derive, expert_weights, moe_config, write_files


@dataclasses.dataclass(frozen=True)
class Settings:
    calibration_tokens: int = 6144    # tokens the experts and routers are fitted on
    eval_tokens: int = 2048           # held-out tokens the perplexities are measured on
    chunk_tokens: int = 256           # one piece of text, run as its own sequence
    held_out_every: int = 4           # every n-th documentation topic is held out
    firing_fraction: float = 0.10     # a unit fires on a token when in its top 10% of contributions
    kmeans_iters: int = 25            # rounds of balanced k-means (it usually settles sooner)
    router_steps: int = 300           # full-batch Adam steps per router
    router_lr: float = 1e-2           # (100 steps at 0.03 and 600 at 0.01 gave a worse top-2 perplexity)
    temperature: float = 0.25         # of the router's target distribution over log-norms
    follow_moe: bool = True           # fit each layer on the MoE model's own inputs (top-2 before it)
    seed: int = 0
    top_ks: tuple = (1, 2, 4, 8, 16)  # the perplexity table's columns


QUICK = Settings(calibration_tokens=256, eval_tokens=128, chunk_tokens=64, kmeans_iters=3, router_steps=20)


def held_out_ids(tokenizer, s: Settings = Settings()) -> list[int]:
    """The whole held-out text (every s.held_out_every-th documentation topic by name, joined) as
    one token list: text_pieces cuts its evaluation pieces from it; the KV-eviction widget reads it
    as one long sequence."""
    import pydoc_data.topics as docs

    names = sorted(docs.topics)
    held = [n for i, n in enumerate(names) if i % s.held_out_every == s.held_out_every - 1]
    return tokenizer.encode("\n\n".join(docs.topics[n] for n in held))


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


@torch.no_grad()
def fit_layers(model: Transformer, pieces, s: Settings, log) -> tuple[list, list]:
    """Experts and a router for every layer, in order. The calibration pieces' residual streams
    are carried through the blocks one layer at a time: attention, then the layer's MLP inputs
    are what its experts and router are fitted on; with s.follow_moe the MoE layer just made (top-2)
    then updates the streams, so each router learns from the inputs it gets when the layers before
    it are experts too, otherwise the dense MLP does. -> (units per layer, router per layer)."""
    cfg, sd = model.config, model.state_dict()
    moe_cfg = moe_config(cfg, NUM_EXPERTS, TOP_K)
    xs = [model.embed_tokens(torch.tensor(ids)) for ids in pieces]         # per piece: (n, C)
    positions = [torch.arange(len(ids)) for ids in pieces]
    units, routers, t0 = [], [], time.perf_counter()
    for i, block in enumerate(model.layers):
        xs = [x + block.attn(block.attn_norm(x), pos, model.rotary, None) for x, pos in zip(xs, positions)]
        hs = [block.mlp_norm(x) for x in xs]
        h = torch.cat(hs)                                                  # (N, C) the MLP's inputs
        prefix = f"layers.{i}.mlp."
        gate, up = F.linear(h, sd[prefix + "gate_up_proj.weight"]).chunk(2, dim=-1)
        units.append(group_units(F.silu(gate) * up, sd[prefix + "down_proj.weight"], NUM_EXPERTS, s, s.seed + i))
        weights = expert_weights(sd, i, units[-1], NUM_EXPERTS)
        routers.append(train_one_router(h, contribution_norms(h, weights, prefix), s))
        mlp = block.mlp
        if s.follow_moe:
            mlp = MoEMLP(moe_cfg)
            mlp.load_state_dict({"router.weight": routers[-1], "experts.gate_up": weights[prefix + "experts.gate_up"],
                                 "experts.down": weights[prefix + "experts.down"]}, assign=True)
        xs = [x + mlp(hh) for x, hh in zip(xs, hs)]
        log(f"layer {i}: experts grouped, router trained ({time.perf_counter() - t0:.0f} s)")
    return units, routers


def group_units(a: torch.Tensor, down: torch.Tensor, num_experts: int, s: Settings, seed: int) -> torch.Tensor:
    """Balanced spherical k-means over the units' firing patterns: a (N, I), down (C, I) -> units
    (I,), the unit indices expert by expert, I / E per expert. Each round assigns (unit, centre)
    pairs from the most similar down, skipping full centres, so every expert gets exactly I / E."""
    contribution = a.abs() * down.norm(dim=0)                           # (N, I)
    rank = max(1, round((1 - s.firing_fraction) * contribution.shape[1]))
    fires = contribution >= contribution.kthvalue(rank, dim=1, keepdim=True).values   # top 10% of the token
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
    """A linear router whose softmax follows softmax(log(norm) / T): (N, C), (N, E) -> (E, C).
    Full-batch Adam (Kingma & Ba, 2015) on the cross-entropy, with its gradient written out,
    (softmax(h W^T) - target)^T h / N, so no autograd graph is built."""
    target = F.softmax(torch.log(norms + 1e-6) / s.temperature, dim=-1)      # (N, E)
    weight = torch.zeros(norms.shape[1], h.shape[1])                         # (E, C)
    m, v = torch.zeros_like(weight), torch.zeros_like(weight)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for t in range(1, s.router_steps + 1):
        grad = (F.softmax(h @ weight.T, dim=-1) - target).T @ h / h.shape[0]   # (E, C)
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        weight -= s.router_lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    return weight


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
    from core.registry import load

    t0 = time.perf_counter()
    dense = load("smollm2-135m")
    cfg, sd = dense.config, dense.state_dict
    model = Transformer.from_state_dict(cfg, sd)
    calib, held, about = text_pieces(dense.tokenizer, s)
    log(f"text: {about['calibration_tokens']} calibration tokens, {about['eval_tokens']} held out")
    units, routers = fit_layers(model, calib, s, log)
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
