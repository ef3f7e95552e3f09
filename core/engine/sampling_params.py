"""SamplingParams: how one request picks its next tokens and when it stops (vLLM's names), and
whether a draft proposes tokens for the model to verify (speculative decoding, speculative.py)."""

from dataclasses import dataclass, field
from enum import Enum

from core.errors import InvalidParameter, is_int

MAX_TOP_CANDIDATES = 20  # the most candidates a request may ask to see per step
MAX_TEMPERATURE = 100.0  # beyond this every distribution is flat anyway
GREEDY_BELOW = 1e-5      # a smaller temperature is greedy (dividing by it would overflow fp32)
MAX_TOKENS = 1 << 30     # an upper bound for max_tokens and top_k (the context ends far sooner)
MAX_SEED = (1 << 63) - 1
MAX_SPECULATIVE_TOKENS = 16  # the most draft tokens one verify pass may check
DEFAULT_SPECULATIVE_TOKENS = 4
MAX_N = 64               # samples per request at most (each needs a batch slot: max_num_seqs bounds it too)


class Speculation(str, Enum):
    """Where a speculative request's draft tokens come from (core/engine/drafts.py)."""
    NGRAM = "ngram"  # prompt lookup: what followed the last n tokens where they occurred before
    SELF = "self"    # the model's own first layers with its shared head (self-speculation)


def derived_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (vLLM's rule: seed + index, here
    wrapped into 0..MAX_SEED). Sample i gives the same tokens as a lone request with this seed."""
    return (seed + index) % (MAX_SEED + 1)


@dataclass
class SamplingParams:
    temperature: float = 1.0       # 0 = greedy (always the most likely token)
    top_k: int = 0                 # keep the k most likely tokens; 0 (or -1) = all
    top_p: float = 1.0             # keep the smallest set whose probability reaches p; 1 = all
    max_tokens: int = 16           # generated tokens at most
    seed: int | None = None        # a seeded request samples the same tokens whatever the batch
    stop: str | list[str] | None = None   # strings that end the text (not included in it)
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end it, besides EOS
    ignore_eos: bool = False       # keep going past the end-of-sequence token
    top_candidates: int = 0        # report the N most likely tokens each step, before/after filters
    speculation: Speculation | str | None = None  # "ngram" or "self": a draft proposes, the model verifies
    num_speculative_tokens: int | None = None     # draft tokens per verify pass (None: 4 with speculation)
    n: int = 1                     # samples of the prompt; they share its KV blocks (parallel sampling)

    def __post_init__(self):
        def number(name, value, lo, hi, integer=False):
            if not (is_int(value) if integer else is_int(value) or isinstance(value, float)):
                raise InvalidParameter(name, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
            if not (lo <= value <= hi) or value != value:
                raise InvalidParameter(name, f"must be between {lo} and {hi}, got {value!r}")

        number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidParameter("top_p", "must be greater than 0")
        number("top_k", self.top_k, -1, MAX_TOKENS, integer=True)
        if self.top_k == -1:
            self.top_k = 0
        number("max_tokens", self.max_tokens, 1, MAX_TOKENS, integer=True)
        number("top_candidates", self.top_candidates, 0, MAX_TOP_CANDIDATES, integer=True)
        number("n", self.n, 1, MAX_N, integer=True)
        if self.seed is not None:
            number("seed", self.seed, 0, MAX_SEED, integer=True)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameter("stop", "must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "must be a list of token ids")
        self._check_speculation(number)

    def _check_speculation(self, number) -> None:
        if self.speculation is None:
            if self.num_speculative_tokens is not None:
                raise InvalidParameter("num_speculative_tokens", "needs speculation (\"ngram\" or \"self\")")
            return
        try:
            self.speculation = Speculation(self.speculation)
        except ValueError:
            raise InvalidParameter("speculation", f"must be one of {[s.value for s in Speculation]} or None, "
                                   f"got {self.speculation!r}") from None
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS
        number("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS, integer=True)
        if self.top_candidates:
            raise InvalidParameter("top_candidates", "cannot be combined with speculation")
        if self.n != 1:
            raise InvalidParameter("n", f"speculation verifies one sample per request: use n=1 (got {self.n})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
