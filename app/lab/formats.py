"""How far a weight format moves a model's next-token distributions from fp32's: plain maths on
logits, shared by the `quantization` widget and `python -m bench`'s quantization table.

- perplexity: exp of the mean negative log-likelihood of each token given the ones before it (the
  MoE table's formula), summed here per sequence (nll_sum) so that pieces add up;
- top-5 agreement: the share of positions whose five most likely next tokens are the same set;
- KL(fp32 || format): the information lost, in nats, when the format's distribution stands in for
  fp32's, averaged over positions. Everything in float64.
"""

import torch

TOP = 5   # candidates compared for the agreement


def nll_sum(logits: torch.Tensor, ids: list[int]) -> float:
    """logits (T, V) of one sequence -> sum over t < T - 1 of -log p(ids[t + 1] | ids[..t])."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return float(-logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())


def compare(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """A format's logits (T, V) against fp32's on the same positions: each position's top-5 set
    equal or not (top5_same), its KL(fp32 || format) (kl_each), and their means."""
    lp, lp32 = torch.log_softmax(logits.double(), -1), torch.log_softmax(reference.double(), -1)
    kl = (lp32.exp() * (lp32 - lp)).sum(-1).clamp_min(0.0)                  # (T,) >= 0 up to rounding
    top, top32 = logits.topk(TOP, -1).indices, reference.topk(TOP, -1).indices
    same = [set(a.tolist()) == set(b.tolist()) for a, b in zip(top, top32)]
    return {"top5_same": same, "top5_agreement": sum(same) / len(same), "kl_each": kl.tolist(),
            "kl": float(kl.mean()), "kl_max": float(kl.max())}
