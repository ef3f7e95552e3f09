"""From logits to the next token: greedy, temperature, top-k, top-p, per-request seeds.

Order of the filters (as in Hugging Face's generate): divide by the temperature, keep the top k,
keep the smallest set whose probability reaches top_p, renormalise, draw. Temperature 0 means
greedy (argmax). Each request draws with its own torch.Generator, so a seeded request samples the
same tokens alone or beside any others. It can also report the N most likely tokens with their
probabilities before and after the filters and their raw logits, for the widgets that show sampling.
"""

from dataclasses import dataclass

import torch


@dataclass
class Candidate:
    """One likely next token: its raw logit, its probability from the logits and after the sampling filters."""

    token_id: int
    prob: float        # softmax of the logits at temperature 1
    final_prob: float  # after temperature, top-k and top-p (what was actually sampled from)
    logit: float       # the model's raw logit (before temperature), so a client can reshape the distribution



def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) -> (N,) int64: each row's first largest logit, as torch.argmax. numpy's plain scan of
    an fp32 row is far quicker than torch's general reduction on one row of the vocabulary, which
    a decode step pays once per sampled row (the README's benchmark notes have the timings)."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """logits (N, V); per-row temperature (>0), top_k (0 = off), top_p (1 = off) -> filtered logits.

    Filtered-out tokens get -inf, so softmax gives them probability exactly 0. A row with top-k
    sorts only its k best logits (torch.topk), not the whole vocabulary: with a classroom's rows
    at top-k 50, a full sort of 49,152 logits a row was most of a sampled step's sampling. Rows
    are filtered in groups of equal k, so what a row gets depends on its own settings alone,
    never on the other rows of the step (batch invariance).
    """
    logits = logits / temperature[:, None]
    V = logits.shape[-1]
    k_of = torch.where(top_k > 0, top_k.clamp(max=V), V)                     # (N,) candidates a row keeps
    active = (top_k > 0) | (top_p < 1)
    if not bool(active.any()):
        return logits
    filtered = logits.clone()
    for k in sorted(set(k_of[active].tolist())):
        rows = torch.nonzero(active & (k_of == k)).flatten()
        group = logits[rows]                                                   # (n, V)
        if k < V:
            best, order = group.topk(k, dim=-1)                                # (n, k), sorted, top-k
        else:
            best, order = group.sort(dim=-1, descending=True)
        probs = best.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs                                  # mass of better tokens
        p = top_p[rows][:, None]
        drop = (before >= p) & (p < 1)                                         # top-p; 1 keeps all
        drop[:, 0] = False                         # the most likely token always stays, whatever p
        kept = torch.full_like(group, float("-inf")).scatter_(-1, order, best.masked_fill(drop, float("-inf")))
        filtered[rows] = kept
    return filtered


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to weights (V,), >= 0, not all 0: inverse
    transform sampling, one uniform from the generator against the float64 running sum. The same
    law as torch.multinomial(weights, 1), in one cumulative sum and one binary search, where
    multinomial's own path over a whole vocabulary is far slower (a step draws for every sampled
    request). An index of weight 0 is never drawn: the running sum does not grow there."""
    total = weights.double().cumsum(0)                                         # (V,)
    if not float(total[-1]) > 0.0:
        raise ValueError("weights: every weight is 0, or one is not finite: nothing to draw")
    # u in [0, total): a uniform is at most 1 - 2^-53, and that times any float64 rounds below it
    u = torch.rand((), generator=generator, dtype=torch.float64) * total[-1]
    return int(torch.searchsorted(total, u, right=True))                      # the first sum above u


class Sampler:
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, params: list,
                 generators: list[torch.Generator | None]):
        """logits (N, V), one SamplingParams per row -> (token ids [N], candidates per row or None)."""
        N = logits.shape[0]
        tokens = argmax_rows(logits)                                           # greedy rows
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        final_probs = None
        if sampled:
            rows = torch.tensor(sampled)
            filtered = filter_logits(
                logits[rows],
                torch.tensor([params[i].temperature for i in sampled], dtype=logits.dtype),
                torch.tensor([params[i].top_k for i in sampled]),
                torch.tensor([params[i].top_p for i in sampled], dtype=logits.dtype))
            final_probs = filtered.softmax(dim=-1)                            # (n, V)
            for j, i in enumerate(sampled):
                if bool(torch.isfinite(final_probs[j]).all()):
                    tokens[i] = draw(final_probs[j], generators[i])
                # else: the logits overflowed; keep the argmax rather than fail the whole step
        candidates = [None] * N
        wanted = [i for i, p in enumerate(params) if p.top_candidates]
        if wanted:
            raw = logits[wanted].softmax(dim=-1)
            row_of = {i: j for j, i in enumerate(sampled)}
            for j, i in enumerate(wanted):
                top = raw[j].topk(params[i].top_candidates).indices.tolist()
                chosen = int(tokens[i])
                if chosen not in top:
                    top.append(chosen)
                if i in row_of:
                    final = final_probs[row_of[i]]
                    finals = [float(final[t]) for t in top]
                else:  # greedy: all the probability on the argmax
                    finals = [1.0 if t == chosen else 0.0 for t in top]
                candidates[i] = [Candidate(t, float(raw[j, t]), f, float(logits[i, t])) for t, f in zip(top, finals)]
        return tokens.tolist(), candidates
