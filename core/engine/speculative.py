"""Speculative decoding: a draft proposes k tokens, the model checks them all in one forward pass.

Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al.,
2023, "Accelerating Large Language Model Decoding with Speculative Sampling". A decode step reads
every weight to compute one token; a pass over 1 + k tokens reads them once too, so if the draft
guessed right the request gains up to k tokens for little more than one step's cost.

Inside an engine step (LLMEngine.run and postprocess):
1. extend: each speculative request that decodes this step gets its draft (drafts.py): its tokens
   are appended to the sequence, blocks are allocated for them, and it is scheduled with 1 + d
   tokens instead of one, like a prefill chunk (within the step's token budget and the free blocks).
2. run: the model runs the whole batch once; the rows of a request's last token and of its d draft
   tokens give d + 1 distributions. Plain requests sample through the Sampler as ever (their rows
   are computed as in any batch: batch invariance keeps their bits).
3. verify: draft token i is kept with probability min(1, p_i(x) / q_i(x)); at the first rejection
   the model's token is drawn from norm(max(0, p_i - q_i)), and if all d are kept one more is drawn
   from p_d. The output is then distributed exactly as the model's (the papers' theorem). A
   deterministic draft (prompt lookup) has q = a point mass on its token: keep it with probability
   p_i(x), else draw from p_i without x. A greedy request keeps the drafts that equal the argmax and
   adds the argmax after them, so its output is plain decoding's, token for token.
4. roll back: the rejected tokens leave the sequence, their KV slots count as unwritten again and
   blocks left empty go back to the pool, before full blocks are published to the prefix cache.
"""

import dataclasses

import torch

from core.engine.drafts import Draft, LayerDraft, filtered_probs, ngram_propose, self_draft_layers
from core.engine.sampling_params import Speculation
from core.model.sampler import draw


class Speculator:
    def __init__(self, engine):
        self.engine = engine
        self.draft_layers = self_draft_layers(engine.model_config.num_layers, engine.config.self_draft_layers)
        self._layer_draft: LayerDraft | None = None   # built on the first self-speculative request
        self.drafts: dict[str, Draft] = {}     # this step's, by request id
        self.rejected: dict[str, int] = {}     # this step's rejected draft tokens, by request id

    @property
    def layer_draft(self) -> LayerDraft:
        if self._layer_draft is None:
            self._layer_draft = LayerDraft(self.engine.runner, self.draft_layers)
        return self._layer_draft

    # -- 1. extend ------------------------------------------------------------------------------
    def extend(self, batch) -> None:
        """Give each speculative decode in the batch its draft: (seq, 1) -> (seq, 1 + d)."""
        engine, bm = self.engine, self.engine.block_manager
        self.drafts, self.rejected = {}, {}
        budget = engine.config.max_num_batched_tokens - batch.num_batched_tokens
        layer_work = []
        for seq, n in batch.scheduled:
            if seq.speculation is None or n != 1 or seq.num_uncomputed_tokens != 1:
                continue
            params, tokens = seq.params, []
            k = max(0, min(params.num_speculative_tokens, budget,
                           params.max_tokens - seq.num_output_tokens - 1,   # the pass adds up to k + 1
                           engine.max_model_len - seq.num_tokens - 1))
            if params.speculation is Speculation.NGRAM:
                tokens = ngram_propose(seq.token_ids, k) if k else []   # may be fewer than k
                k = len(tokens)
            while k and not bm.can_allocate(seq, 1 + k):
                k -= 1
            budget -= k
            bm.allocate(seq, 1 + k)
            if params.speculation is Speculation.NGRAM or not k:
                self.drafts[seq.request_id] = Draft(tokens[:k])         # k = 0: a plain decode, counted
            else:
                layer_work.append((seq, k))
        if layer_work:
            for (seq, _), draft in zip(layer_work, self.layer_draft.propose(layer_work)):
                self.drafts[seq.request_id] = draft
        for i, (seq, n) in enumerate(batch.scheduled):
            draft = self.drafts.get(seq.request_id)
            if draft is not None and draft.tokens:
                seq.token_ids.extend(draft.tokens)
                batch.scheduled[i] = (seq, 1 + len(draft.tokens))

    # -- 2. run and 3. verify ------------------------------------------------------------------
    def widen(self, step_input):
        """The rows to sample: a speculative sequence's last token and each of its draft tokens
        (d + 1 rows), one row for every other sequence. -> the step input with those rows."""
        if not self.drafts:
            return step_input
        rows = []
        for seq, last in zip(step_input.sample_seqs, step_input.sample_rows.tolist()):
            d = len(self.drafts[seq.request_id].tokens) if seq.request_id in self.drafts else 0
            rows.extend(range(last - d, last + 1))
        return dataclasses.replace(step_input, sample_rows=torch.tensor(rows))

    def verify(self, seqs, logits):
        """logits (R, V) of widen's rows -> (the plain sequences and their logits (P, V), the
        speculative ones and their tokens: the kept draft tokens plus the model's own)."""
        plain, plain_rows, drafted, tokens, row = [], [], [], [], 0
        for seq in seqs:
            draft = self.drafts.get(seq.request_id)
            if draft is None:
                plain.append(seq)
                plain_rows.append(row)
                row += 1
                continue
            d = len(draft.tokens)
            accepted, token = verify(logits[row:row + d + 1], draft, seq.params, seq.generator)
            seq.speculation.add(draft.tokens, accepted, token)
            self.rejected[seq.request_id] = d - accepted
            drafted.append(seq)
            tokens.append(draft.tokens[:accepted] + [token])
            row += d + 1
        return plain, (logits if len(plain_rows) == row else logits[plain_rows]), drafted, tokens

    # -- 4. roll back --------------------------------------------------------------------------
    def roll_back(self, seq) -> None:
        """After seq's computed count has advanced over its whole pass: the rejected draft tokens
        leave it, and blocks that hold none of its computed tokens go back to the pool."""
        rejected = self.rejected.pop(seq.request_id, 0)
        if rejected:
            del seq.token_ids[-rejected:]
            seq.num_computed_tokens -= rejected
            self.engine.block_manager.trim(seq)

    def kept_drafts(self, seq, tokens: list[int]) -> None:
        """Take the kept draft tokens out of seq again, so that the engine appends them one by one
        with the model's own token (stop conditions, text and timings see each)."""
        if len(tokens) > 1:
            del seq.token_ids[-(len(tokens) - 1):]


def verify(logits: torch.Tensor, draft: Draft, params, generator) -> tuple[int, int]:
    """logits (d + 1, V): the model's at the last token and at each of the d draft tokens ->
    (draft tokens kept, the model's next token after them)."""
    d = len(draft.tokens)
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()                                 # (d + 1,)
        kept = next((i for i in range(d) if draft.tokens[i] != target[i]), d)
        return kept, target[kept]
    p = filtered_probs(logits, params)                                          # (d + 1, V)
    if not bool(torch.isfinite(p).all()):        # the logits overflowed: as the sampler, the argmax
        return verify(logits, draft, dataclasses.replace(params, temperature=0.0), generator)
    for i, x in enumerate(draft.tokens):
        q_x = 1.0 if draft.q is None else float(draft.q[i, x])
        u = float(torch.rand(1, generator=generator, dtype=torch.float64))
        if u * q_x < float(p[i, x]):                                            # keep: u < p(x) / q(x)
            continue
        if draft.q is None:
            residual = p[i].clone()
            residual[x] = 0.0                                                   # p - (point mass at x), clipped
        else:
            residual = (p[i] - draft.q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:         # p <= q everywhere yet x rejected: only by rounding
            residual = p[i]
        return i, draw(residual, generator)
    return d, draw(p[d], generator)
