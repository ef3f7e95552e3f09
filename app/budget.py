"""A connection's budget of work, in tokens: every message is priced by what it makes the server do.

Counting messages is not enough: one 64 KiB `template` costs thousands of times what a short one
does. So each connection holds a token bucket (the leaky-bucket policer of ATM networks, Turner,
1986) measured in tokens of work, refilled at `work_tokens_per_second` up to `work_burst_tokens`:

- `template` and `tokenize` cost the tokens they tokenize: estimated before any work from the
  text's UTF-8 bytes (byte-level BPE makes at most one token per byte, so the estimate is an upper
  bound), then settled to the real count;
- `generate` costs its prompt's tokens, plus its stop strings' checks: every output token is tested
  against every stop string, `max_tokens * len(stop)` checks, priced STOP_CHECKS_PER_TOKEN to a token;
- a widget job costs `job_slice_tokens` for each slice the job runner gives it while the engine
  serves requests (a slice beside nobody's chat delays nobody).

Work of more than a slice (a text estimated over `work_slice_tokens`: tokenizing_estimate) is not
done on the connection's reader thread but by the job runner, in slices between engine steps
(app/live.py, Call.inline; app/prompt_job.py for a long prompt); its estimate is settled when the
job has counted it.

A message is let in when the bucket holds its estimated cost (or is full, for a cost larger than
the bucket: one large message stays possible, then its debt is paid off before the next). Past
that it is refused with `overloaded` and `retry_after_s`, the time until the bucket holds enough.
Debt from work settled afterwards is floored at one bucket, so a connection never waits longer
than work_burst_tokens / work_tokens_per_second. A job's slices only empty the bucket, never put
it in debt: the page that runs many widgets' experiments over its one connection can still send a
short chat message after waiting for that message's own cost.
"""

import math
import threading
import time

from .protocol import ProtocolError

# A stop-string check is one str.find over the few characters an output token adds, far cheaper
# than tokenizing and labelling a token; this many checks are priced as one token of work.
STOP_CHECKS_PER_TOKEN = 32


def text_estimate(*texts: str) -> int:
    """An upper bound on the tokens the texts tokenize to: their UTF-8 bytes."""
    return sum(len(t.encode("utf-8")) for t in texts)


def template_bytes(tokenizer) -> tuple[int, int]:
    """The chat template's own text, in UTF-8 bytes: (for the whole chat, for each message): what
    it adds around the messages' contents (role wrappers, a default system prompt), so that a
    chat's estimate, contents plus these, stays an upper bound on its tokens."""
    def size(n):
        chat = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * n
        return len(tokenizer.render_template(chat).encode("utf-8"))
    one, two = size(1), size(2)
    per_message = max(0, (two - one) // 2) + 1
    return max(0, one - 2 * per_message) + per_message, per_message


def stop_cost(stop, max_tokens: int) -> int:
    """Tokens of work a request's stop strings cost: max_tokens * len(stop) checks."""
    n = 1 if isinstance(stop, str) else len(stop or ())
    return math.ceil(max_tokens * n / STOP_CHECKS_PER_TOKEN)


def request_cost(seq, params) -> int:
    """What an engine request costs once prepared: its prompt's tokens and its stop strings'
    checks (a beam search has none)."""
    return seq.num_prompt_tokens + stop_cost(getattr(params, "stop", None), params.max_tokens)


def message_estimate(msg: dict, config, template: tuple[int, int]) -> int:
    """An upper bound, before any work, on the tokens of work a message costs: what its text can
    tokenize to (tokenizing_estimate), and a generate request's stop-string checks."""
    estimate = tokenizing_estimate(msg, template)
    if "stop" in msg and isinstance(msg["stop"], (str, list)):
        max_tokens = msg.get("max_tokens", config.default_max_tokens)
        estimate += stop_cost(msg["stop"], max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 1)
    return estimate


def tokenizing_estimate(msg: dict, template: tuple[int, int]) -> int:
    """An upper bound on the tokens a message's text tokenizes to: its bytes, and the chat
    template's own around `messages` (the work done before any engine step)."""
    chat = msg.get("messages") if isinstance(msg.get("messages"), list) else []
    texts = [m.get("content") for m in chat if isinstance(m, dict)]
    texts += [msg[k] for k in ("text", "prompt") if isinstance(msg.get(k), str)]
    estimate = text_estimate(*[t for t in texts if isinstance(t, str)])
    if chat:
        estimate += template[0] + template[1] * len(chat)
    return estimate


class WorkBudget:
    """One connection's bucket of work tokens (thread-safe: the reader takes, a job's slices settle)."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.level = float(burst)
        self.charged = 0             # tokens of work charged in all (for tests and /healthz)
        self._at = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self._at) * self.rate)
        self._at = now

    def take(self, estimate: int, mid=None, what: str = "this message") -> int:
        """Let `estimate` tokens of work in, or raise `overloaded` with retry_after_s. Returns the
        estimate (settle it with the real count once known)."""
        with self._lock:
            self._refill()
            need = min(estimate, self.burst)
            if self.level < need:
                wait = (need - self.level) / self.rate
                raise ProtocolError(
                    "overloaded", f"{what} costs about {estimate} tokens of work and this connection's budget "
                                  f"holds {max(0, int(self.level))} (work_tokens_per_second {self.rate:g}, "
                                  f"work_burst_tokens {self.burst:g}); retry after {wait:.2f} s",
                    "budget", mid, retry_after_s=round(wait + 0.005, 2))
            self.level -= estimate
            self.charged += estimate
            return estimate

    def settle(self, estimate: int, actual: int) -> None:
        """The work turned out to cost `actual`: refund or charge the difference."""
        self.charge(actual - estimate)

    def charge(self, tokens: float, floor: float | None = None) -> None:
        """Work already done: debit it. Without `floor`, the level ends at most one bucket in debt;
        with one, the charge takes the level no lower than `floor` (a level already below stays)."""
        with self._lock:
            self._refill()
            if floor is None:
                self.level = max(-self.burst, self.level - tokens)
            else:
                self.level = max(min(floor, self.level), self.level - tokens)
            self.charged += tokens
