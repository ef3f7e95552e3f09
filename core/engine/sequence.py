"""One request inside the engine: its tokens, how many have KV in the cache, and its blocks.

Invariant: tokens[:num_computed_tokens] have their keys and values in the KV cache, in the blocks
of `block_table`. A step computes tokens[num_computed_tokens : num_computed_tokens + n]; when that
reaches the end of `token_ids` the model's last logits give the next token. More than one token
left to compute means prefill (or recompute after preemption); exactly one means decode.
"""

from enum import Enum

import torch

from core.engine.outputs import Candidate, RequestMetrics, RequestOutput, SpeculationStats
from core.engine.sampling_params import SamplingParams
from core.model.detokenizer import Detokenizer


class SequenceStatus(Enum):
    WAITING = "waiting"    # queued, or preempted and queued again
    RUNNING = "running"    # holds KV blocks and a batch slot
    SWAPPED = "swapped"    # preempted by swapping: its blocks wait in the host pool
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"          # end token, stop token or stop string
    LENGTH = "length"      # max_tokens or the context window
    ABORT = "abort"        # the client gave up


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer, arrival_time: float, prompt: str | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0             # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []    # hashes of the full blocks published so far
        self.slot: int | None = None           # batch slot (a column of the batching trace)
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = Detokenizer(tokenizer, params.stop)
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.generator: torch.Generator | None = None
        self.candidates: list[list[Candidate]] | None = [] if params.top_candidates else None
        self.speculation = (SpeculationStats(params.speculation.value, params.num_speculative_tokens)
                            if params.speculation else None)
        self.index = 0                         # which of its request's n samples (or beams) it is
        self.group = None                      # SequenceGroup of an n > 1 request, BeamGroup of a beam
        self.host_table: list[int] = []        # host-pool blocks while swapped out

    @property
    def num_seats(self) -> int:
        """Batch slots it needs to start: its own, and one per sample still to fork from it."""
        return 1 + (len(self.group.unforked) if self.group is not None and self.index == 0 else 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def output(self, new_token_ids: list[int], new_text: str) -> RequestOutput:
        if self.group is not None:   # one output for all n samples
            return self.group.output({self.index: (new_token_ids, new_text)})
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.token_ids[: self.num_prompt_tokens],
            token_ids=self.output_token_ids,
            text=self.detokenizer.text,
            finished=self.is_finished,
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            stop_reason=self.stop_reason,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            new_token_ids=new_token_ids,
            new_text=new_text,
            candidates=self.candidates,
            speculation=self.speculation,
        )
