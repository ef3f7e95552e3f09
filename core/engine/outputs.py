"""What the engine hands back: RequestOutput (vLLM's shape), the timings of a request, and what a
speculative request's drafts proposed and kept."""

from dataclasses import dataclass, field

from core.engine.trace import StepKind
from core.model.sampler import Candidate


def mean_gap(times: list[float]) -> float | None:
    """The mean gap between consecutive times (TPOT over token times); None for fewer than two."""
    n = len(times)
    return None if n < 2 else (times[-1] - times[0]) / (n - 1)


def gaps(times: list[float]) -> list[float]:
    """Every gap between consecutive times (inter-token latencies)."""
    return [b - a for a, b in zip(times, times[1:])]

@dataclass
class StepRecord:
    """One engine step as one request saw it."""

    step: int
    start_time: float     # time.perf_counter() when the step began
    duration_s: float
    kind: StepKind        # prefill or decode
    num_tokens: int       # this request's tokens in the step
    batch_seqs: int       # requests in the step, this one included
    batch_tokens: int     # tokens in the step, all requests


@dataclass
class RequestMetrics:
    """Engine timestamps of one request (time.perf_counter seconds) and what follows from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was ready
    steps: list["StepRecord"] = field(default_factory=list)  # every engine step that worked on it

    @property
    def queue_s(self) -> float | None:
        """Waiting before the first step that worked on it."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: the mean gap between tokens."""
        return mean_gap(self.token_times)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: every gap between consecutive tokens."""
        return gaps(self.token_times)

    @property
    def e2e_s(self) -> float | None:
        """End to end: arrival to finish."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def as_dict(self) -> dict:
        return {"queue_s": self.queue_s, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s}


@dataclass
class VerifyPass:
    """One verify pass of a speculative request: the draft's tokens, how many the model kept,
    and the token the model added itself (the correction at the first rejection, or one more)."""

    proposed: list[int]
    accepted: int
    token: int


@dataclass
class SpeculationStats:
    """Counters of a speculative request (speculative.py). Every decode step is a verify pass,
    also one whose draft proposed nothing; each pass adds its accepted tokens plus one."""

    draft: str                     # "ngram" or "self"
    num_speculative_tokens: int    # k, the most tokens a pass may check
    proposed_per_position: list[int] = field(default_factory=list)  # [i]: passes with a draft token at i
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: ... whose token i was kept
    passes: list[VerifyPass] = field(default_factory=list)

    def __post_init__(self):
        self.proposed_per_position = self.proposed_per_position or [0] * self.num_speculative_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    def add(self, proposed: list[int], accepted: int, token: int) -> None:
        for i in range(len(proposed)):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted
        self.passes.append(VerifyPass(list(proposed), accepted, token))

    verify_passes = property(lambda self: len(self.passes))
    proposed = property(lambda self: sum(self.proposed_per_position))   # draft tokens proposed in all
    accepted = property(lambda self: sum(self.accepted_per_position))   # ... and kept

    @property
    def acceptance_rate(self) -> float | None:
        """Kept draft tokens over proposed ones; None before any was proposed."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """[i]: the share of passes with a draft token at position i that kept it."""
        return [a / p if p else None for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def tokens_per_pass(self) -> float | None:
        """Tokens each verify pass added on average (1 is plain decoding)."""
        return (self.accepted + self.verify_passes) / self.verify_passes if self.passes else None

    def as_dict(self) -> dict:
        return {"draft": self.draft, "num_speculative_tokens": self.num_speculative_tokens,
                "proposed": self.proposed, "accepted": self.accepted, "verify_passes": self.verify_passes,
                "proposed_per_position": list(self.proposed_per_position),
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": self.acceptance_rate, "tokens_per_pass": self.tokens_per_pass}


@dataclass
class CompletionOutput:
    """One of a request's n samples, as vLLM lays it out; new_* is what this step added to it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    metrics: "RequestMetrics | None" = None   # this sample's own timings (n > 1)
    cum_logprob: float | None = None          # a beam's cumulative log-probability (beam search)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]             # generated so far
    text: str                        # generated so far, detokenized (stop string removed)
    finished: bool
    finish_reason: str | None        # "stop", "length" or "abort"
    stop_reason: int | str | None    # the stop token id or stop string, when it was one of those
    num_cached_tokens: int           # prompt tokens whose KV came from the prefix cache
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)  # what this step added
    new_text: str = ""               # text released by this step (held back near a stop string)
    candidates: list[list[Candidate]] | None = None  # per generated token, if asked for
    error: str | None = None         # set when the engine failed on this request (a bug)
    speculation: SpeculationStats | None = None  # a speculative request's counters

    samples: list[CompletionOutput] | None = None  # n > 1: every sample (the fields above: sample 0's)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's layout: the request's completions, by index (one when n = 1)."""
        if self.samples is not None:
            return self.samples
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason,
                                 self.new_token_ids, self.new_text)]
