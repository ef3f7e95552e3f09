"""Drafts for speculative decoding: cheap guesses of a request's next tokens, for the model to verify.

Prompt lookup (Saxena, 2023, "Prompt Lookup Decoding"; vLLM's n-gram proposer): find the last
earlier place where the context's final n tokens occurred (n = 3, then 2, then 1) and propose what
followed there. No model at all, so its guess is a point mass: the draft distribution q is 1 on
the proposed token. It wins where the answer repeats its context (code, lists, a quoted passage)
and proposes nothing, or the wrong thing, in free text.

Self-speculation (Elhoushi et al., 2024, "LayerSkip"; Zhang et al., 2023, "Draft & Verify"): the
model's own first layers, then its final norm and shared head, run as a decode over the same paged
KV cache. The first L layers of the full model compute exactly what the truncated model does, so
the cache already holds the draft's keys and values for every verified token; the draft writes
layers 0..L-1 of its own tokens' slots, which the verify pass then writes again. It samples from
its own distribution q (after the request's temperature, top-k and top-p), which the rejection
rule needs (speculative.py).
"""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from core.errors import InvalidParameter
from core.model.native_decoder import native_decoder
from core.model.sampler import draw, filter_logits

NGRAM_MAX = 3  # the longest context suffix prompt lookup matches
NGRAM_MIN = 1  # the shortest


@dataclass
class Draft:
    """One request's proposal for one verify pass."""

    tokens: list[int]
    q: torch.Tensor | None = None   # (len(tokens), V) the draft's probabilities; None: a point mass


def ngram_propose(token_ids: list[int], k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the context's final n tokens, trying
    n = NGRAM_MAX down to NGRAM_MIN: the latest occurrence with k tokens after it, else the earliest
    (in a run of one repeated token the latest overlaps the end); [] when none occurred before."""
    ids = np.asarray(token_ids, dtype=np.int64)
    L = len(ids)
    for n in range(min(NGRAM_MAX, L - 1), NGRAM_MIN - 1, -1):
        match = np.ones(L - n, dtype=bool)               # [i]: ids[i:i+n] equals the last n tokens
        for j in range(n):
            match &= ids[j:j + L - n] == ids[L - n + j]
        hits = np.flatnonzero(match)
        if hits.size:
            whole = hits[hits + n + k <= L]       # matches followed by k tokens: the latest of them,
            i = int(whole[-1] if whole.size else hits[0])   # else the earliest (the longest run after it)
            return ids[i + n:i + n + k].tolist()
    return []


def self_draft_layers(num_layers: int, setting: int | None) -> int:
    """How many first layers the self-speculation draft runs: the setting, or a quarter of them."""
    if setting is None:
        return max(1, num_layers // 4)
    if not 1 <= setting < num_layers:
        raise InvalidParameter("self_draft_layers", f"must be between 1 and {num_layers - 1} "
                                                    f"(the model has {num_layers} layers), got {setting}")
    return setting


class LayerDraft:
    """The model's first `num_layers` layers with its final norm and head, over the engine's cache."""

    def __init__(self, runner, num_layers: int):
        self.runner = runner
        self.num_layers = num_layers
        model = runner.model
        self.native = native_decoder(model, num_layers) if model.native is not None else None

    @torch.inference_mode()
    def logits(self, step) -> torch.Tensor:
        """A model_runner.StepInput -> the draft's logits (N, V) for its sampling rows."""
        model = self.runner.model
        if self.native is not None:
            hidden = self.native.forward(step.input_ids, step.positions, step.batch)
        else:
            x = model.embed_tokens(step.input_ids)                              # (T, C)
            for block in model.layers[: self.num_layers]:
                x = block(x, step.positions, model.rotary, step.batch)
            hidden = model.norm(x)
        return model.logits(hidden[step.sample_rows])                            # (N, V)

    def propose(self, work: list[tuple]) -> list[Draft]:
        """work: (seq, k) for decoding sequences whose blocks already cover k more tokens ->
        k draft tokens each, drafted together one position at a time (k decodes of the draft)."""
        drafts = [Draft([], None) for _ in work]
        qs: list[list[torch.Tensor]] = [[] for _ in work]
        for j in range(max((k for _, k in work), default=0)):
            active = [i for i, (_, k) in enumerate(work) if j < k]
            views = [(_at(work[i][0], drafts[i].tokens), 1) for i in active]
            logits = self.logits(self.runner.prepare(views))                    # (len(active), V)
            for row, i in enumerate(active):
                seq = work[i][0]
                token, q = pick(logits[row], seq.params, seq.generator)
                drafts[i].tokens.append(token)
                if q is not None:
                    qs[i].append(q)
        for draft, q in zip(drafts, qs):
            draft.q = torch.stack(q) if q else None
        return drafts


def _at(seq, drafted: list[int]):
    """seq as if its drafted tokens were in it and it were about to compute the last of them."""
    pos = seq.num_computed_tokens + len(drafted)
    return SimpleNamespace(token_ids=seq.token_ids + drafted, block_table=seq.block_table,
                           num_computed_tokens=pos, num_tokens=pos + 1)


def pick(logits: torch.Tensor, params, generator) -> tuple[int, torch.Tensor | None]:
    """A draft token from one row of logits (V,): the argmax for a greedy request, else a draw from
    the request's filtered distribution, returned too (the rejection rule needs it)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = filtered_probs(logits[None], params)[0]                                 # (V,)
    if not bool(torch.isfinite(q).all()):
        return int(logits.argmax()), None
    return draw(q, generator), q


def filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """(N, V) logits of one request -> its sampling distribution per row, as the sampler draws from."""
    n = logits.shape[0]
    return filter_logits(logits, torch.full((n,), params.temperature, dtype=logits.dtype),
                         torch.full((n,), params.top_k), torch.full((n,), params.top_p, dtype=logits.dtype)
                         ).softmax(dim=-1)
