"""Parallel sampling: the n samples of one request, which share its prompt's KV blocks.

After vLLM's SequenceGroup (Kwon et al., 2023, section 4.4). Sample 0 is the request itself and
the only one that is prefilled. When its prompt is done, the last logits give every sample its
first token (each with its own generator), and samples 1..n-1 are forked from it: they take its
block table and each block's reference count goes up by one. From then on each sample is a
sequence of its own; the first write into the shared last, partial block copies it
(copy-on-write, block_manager.py), and each sample frees its own blocks when it ends.

The group hands back one RequestOutput for all samples, vLLM's layout: `outputs` lists the n
completions by index; the top-level fields are sample 0's. It is finished when every sample is.
"""

from dataclasses import replace

from core.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from core.engine.sequence import Sequence


def sample_id(request_id: str, index: int) -> str:
    """The engine's id of sample `index` (its slot and trace name): the request's own for sample 0."""
    return request_id if index == 0 else f"{request_id}#{index}"


class SequenceGroup:
    def __init__(self, request_id: str, seqs: list[Sequence]):
        self.request_id = request_id
        self.seqs = seqs                 # by sample index; seqs[0].request_id == request_id
        self.forked = False
        for i, seq in enumerate(seqs):
            seq.index, seq.group = i, self

    @property
    def unforked(self) -> list[Sequence]:
        """The samples still waiting for sample 0's prompt to be done."""
        return [] if self.forked else self.seqs[1:]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self, new: dict[int, tuple[list[int], str]]) -> RequestOutput:
        """The request's output after a step; new: sample index -> (token ids, text) it added."""
        first = self.seqs[0]
        finished = self.is_finished
        samples = [CompletionOutput(s.index, s.detokenizer.text, s.output_token_ids,
                                    s.finish_reason.value if s.finish_reason else None, s.stop_reason,
                                    *new.get(s.index, ([], "")), s.metrics) for s in self.seqs]
        head = samples[0]
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt,
            prompt_token_ids=first.token_ids[: first.num_prompt_tokens],
            token_ids=head.token_ids, text=head.text, finished=finished,
            finish_reason=head.finish_reason if finished else None,
            stop_reason=head.stop_reason if finished else None,
            num_cached_tokens=first.num_cached_tokens, metrics=self.metrics(),
            new_token_ids=head.new_token_ids, new_text=head.new_text,
            candidates=first.candidates, samples=samples)

    def metrics(self) -> RequestMetrics:
        """Sample 0's record (its tokens and steps), finished when the last sample finished."""
        first = self.seqs[0].metrics
        if not self.is_finished:
            return first
        return replace(first, finished_time=max(s.metrics.finished_time or 0.0 for s in self.seqs))
