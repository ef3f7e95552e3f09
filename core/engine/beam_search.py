"""Beam search on the paged KV cache: beams fork by sharing blocks, pruned beams free theirs.

The API is vLLM's (`LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens))`), its
selection rule too: at each step every live beam offers its 2 * beam_width most likely next
tokens; a candidate ending in the end token is set aside as complete, the best beam_width of the
others (by cumulative log-probability) live on. At the end the complete and the live beams are
ranked by cumulative log-probability / generated tokens ** length_penalty (the end token not
counted), and the best beam_width are returned, best first.

Here each live beam is a sequence in the engine, batched with every other request. A beam whose
logits are in waits for the rest of its group; once all are in, the group picks the next beams:
a parent no candidate continues is pruned (its blocks go back at once); a parent continued k
times goes on itself and forks k - 1 children, which take its block table by reference count
(the shared, partial last block is copied on its first write, block_manager.py). Beams are
greedy sequences whose sampled token is ignored: the group appends the token it picked.
"""

from dataclasses import dataclass, field

import torch

from core.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from core.engine.sampling_params import MAX_TOKENS, SamplingParams
from core.engine.sequence import FinishReason, Sequence, SequenceStatus
from core.errors import InvalidParameter, is_int

MAX_BEAM_WIDTH = 16           # beams per prompt at most (each holds a batch slot)
MAX_LENGTH_PENALTY = 10.0     # |length_penalty| at most


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0   # > 0 favours longer beams in the final ranking, < 0 shorter ones

    def __post_init__(self):
        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidParameter("beam_width", f"must be an integer between 1 and {MAX_BEAM_WIDTH}, "
                                                 f"got {self.beam_width!r}")
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise InvalidParameter("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        penalty = self.length_penalty
        if not (is_int(penalty) or isinstance(penalty, float)) or not abs(penalty) <= MAX_LENGTH_PENALTY:
            raise InvalidParameter("length_penalty", f"must be a number between {-MAX_LENGTH_PENALTY} and "
                                                     f"{MAX_LENGTH_PENALTY}, got {penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameter("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")


@dataclass
class BeamSequence:
    """One finished beam, as vLLM's BeamSearchSequence: generated tokens, text, cumulative log-probability."""

    token_ids: list[int]
    cum_logprob: float
    text: str = ""
    finish_reason: str = "length"
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSequence] = field(default_factory=list)   # best first


def beam_score(num_tokens: int, cum_logprob: float, length_penalty: float, ends_in_eos: bool) -> float:
    """Cumulative log-probability over generated length ** length_penalty (the end token not counted)."""
    length = max(1, num_tokens - ends_in_eos)
    return cum_logprob / length ** length_penalty


class BeamGroup:
    """The live beams of one prompt and the beams already complete."""

    def __init__(self, engine, request_id: str, prompt_ids: list[int], params: BeamSearchParams):
        self.engine = engine
        self.request_id = request_id
        self.params = params
        self.eos = set() if params.ignore_eos else engine.stop_token_ids
        self.seq_params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        root = Sequence(request_id, prompt_ids, self.seq_params, engine.tokenizer, 0.0)
        # Slots held for the beams the root forks into after its prompt (see Scheduler._take_slots).
        self.placeholders = [Sequence(f"{request_id}#{i}", prompt_ids, self.seq_params, engine.tokenizer, 0.0)
                             for i in range(1, params.beam_width)]
        self.seqs = [root, *self.placeholders]   # every sequence it ever ran (for abort)
        self.live = [root]
        self.cum = {root.request_id: 0.0}
        self.complete: list[BeamSequence] = []
        self.result: BeamSearchOutput | None = None
        self.steps = 0
        self._next_id = params.beam_width
        for i, seq in enumerate(self.seqs):
            seq.index, seq.group = i, self
        self.reported: dict[str, tuple[list[float], list[int]]] = {}

    @property
    def root(self) -> Sequence:
        return self.seqs[0]

    @property
    def unforked(self) -> list[Sequence]:
        return self.placeholders

    @property
    def is_finished(self) -> bool:
        return self.result is not None

    # -- from the engine's step ----------------------------------------------------------------
    def report(self, seq: Sequence, logits: torch.Tensor) -> None:
        """seq's next-token logits (V,): keep its 2 * beam_width best log-probabilities."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = logprobs.topk(min(2 * self.params.beam_width, logprobs.numel()))
        self.reported[seq.request_id] = (top.values.tolist(), top.indices.tolist())

    @property
    def ready(self) -> bool:
        return all(b.request_id in self.reported for b in self.live)

    def advance(self) -> None:
        """Every live beam has reported: pick the next beams, prune, fork, append their tokens."""
        engine, w = self.engine, self.params.beam_width
        candidates = []                                   # (cum, parent, token), in beam order
        for beam in self.live:
            values, tokens = self.reported.pop(beam.request_id)
            for lp, tok in zip(values, tokens):
                candidates.append((self.cum[beam.request_id] + lp, beam, tok))
        going = []
        for cum, beam, tok in candidates:
            if tok in self.eos:
                self._complete(beam.output_token_ids + [tok], cum, FinishReason.STOP)
            else:
                going.append((cum, beam, tok))
        going.sort(key=lambda c: c[0], reverse=True)      # stable: ties keep beam order
        kept = going[:w]
        self.steps += 1
        for seq in self.placeholders:                     # their slots go to the real children
            engine.scheduler.finish(seq)
        self.placeholders = []
        parents = {beam.request_id for _, beam, _ in kept}
        for beam in self.live:
            if beam.request_id not in parents:            # pruned: its blocks go back now
                self._drop(beam)
        live, used = [], set()
        for cum, beam, tok in kept:
            if beam.request_id in used:                   # a second continuation: fork a child
                child = Sequence(f"{self.request_id}#{self._next_id}", beam.token_ids[: beam.num_prompt_tokens],
                                 self.seq_params, engine.tokenizer, 0.0)
                child.token_ids = list(beam.token_ids)
                child.index, child.group = self._next_id, self
                self._next_id += 1
                self.seqs.append(child)
                engine.scheduler.fork(beam, child)
                live.append((child, cum, tok))
            else:
                used.add(beam.request_id)
                live.append((beam, cum, tok))
        for seq, cum, tok in live:
            seq.token_ids.append(tok)
            self.cum[seq.request_id] = cum
        self.live = [seq for seq, _, _ in live]
        if self.steps >= self.params.max_tokens or any(s.num_tokens >= engine.max_model_len for s in self.live):
            self.finish()

    def finish(self) -> None:
        """Max tokens reached: the live beams complete; rank everything, keep the best beam_width."""
        for seq in self.live:
            self._complete(seq.output_token_ids, self.cum[seq.request_id], FinishReason.LENGTH)
            self._drop(seq)
        self.live = []
        ranked = sorted(self.complete, key=lambda b: b.score, reverse=True)
        self.result = BeamSearchOutput(ranked[: self.params.beam_width])

    def _complete(self, token_ids: list[int], cum: float, reason: FinishReason) -> None:
        ends_in_eos = reason == FinishReason.STOP
        score = beam_score(len(token_ids), cum, self.params.length_penalty, ends_in_eos)
        shown = token_ids[:-1] if ends_in_eos else token_ids
        self.complete.append(BeamSequence(list(token_ids), cum, self.engine.tokenizer.decode(shown),
                                          reason.value, score))

    def _drop(self, seq: Sequence) -> None:
        self.reported.pop(seq.request_id, None)
        self.cum.pop(seq.request_id, None)
        if seq.status != SequenceStatus.FINISHED:
            seq.finish_reason = FinishReason.ABORT
            self.engine.scheduler.finish(seq)

    def output(self, new: dict) -> RequestOutput:
        """The search's one output (finished when aborted or done): its beams, best first."""
        beams = self.result.sequences if self.result else []
        samples = [CompletionOutput(i, b.text, b.token_ids, b.finish_reason, None, cum_logprob=b.cum_logprob) for i, b in enumerate(beams)]
        root = self.root
        head = samples[0] if samples else CompletionOutput(0, "", [], "abort", None)
        return RequestOutput(
            request_id=self.request_id, prompt=None, prompt_token_ids=root.token_ids[: root.num_prompt_tokens],
            token_ids=head.token_ids, text=head.text, finished=True, finish_reason=head.finish_reason,
            stop_reason=None, num_cached_tokens=root.num_cached_tokens, metrics=RequestMetrics(0.0),
            samples=samples)
