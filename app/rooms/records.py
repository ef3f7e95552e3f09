"""What a room shows of each request and of each engine step, built from engine snapshots.

A Record is one student's request as the presenter sees it: its state (waiting, prefill chunk k
of n, decoding, done, aborted), its token counts and its latencies. It is updated from two
snapshots the engine hands out, never from the engine's internals: the request's outputs (its
listener: tokens, cached tokens, metrics) and the step trace (core/engine/trace.py: which slot
did a prefill chunk or a decode). A step row is the trace's StepTrace as a dict, its slots'
engine request ids replaced by {"request": record id, "student": name, ...}.
"""

import math
import time
from dataclasses import dataclass, field
from enum import Enum

from core.engine.trace import StepKind, StepTrace


class RequestState(str, Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODING = "decoding"
    DONE = "done"
    ABORTED = "aborted"


FINAL = (RequestState.DONE, RequestState.ABORTED)


@dataclass
class Record:
    id: str                        # the room's own id for the request ("r17")
    student: str
    prompt_tokens: int
    engine: int                    # which of the room's engines ran it (a new one per engine setting)
    engine_request_id: str
    state: RequestState = RequestState.WAITING
    prefill_chunk: int | None = None
    prefill_chunks: int | None = None
    prefilled_tokens: int = 0      # prompt tokens computed so far
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    waited_s: float | None = None
    finish_reason: str | None = None
    text: str = ""
    sent_at: float = field(default_factory=time.time)   # wall clock, for the export
    version: int = 0               # the room's update seq when this last changed

    def as_dict(self) -> dict:
        return {"id": self.id, "student": self.student, "state": self.state.value,
                "prefill_chunk": self.prefill_chunk, "prefill_chunks": self.prefill_chunks,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "waited_s": self.waited_s, "finish_reason": self.finish_reason, "text": self.text,
                "engine": self.engine, "sent_at": self.sent_at}

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        return cls(id=d["id"], student=d["student"], prompt_tokens=d["prompt_tokens"], engine=d.get("engine", 0),
                   engine_request_id="", state=RequestState(d["state"]), prefill_chunk=d.get("prefill_chunk"),
                   prefill_chunks=d.get("prefill_chunks"), cached_tokens=d.get("cached_tokens", 0),
                   generated_tokens=d.get("generated_tokens", 0), ttft_s=d.get("ttft_s"), tpot_s=d.get("tpot_s"),
                   waited_s=d.get("waited_s"), finish_reason=d.get("finish_reason"), text=d.get("text", ""),
                   sent_at=d.get("sent_at", 0.0))

    # -- from the engine's snapshots -----------------------------------------------------------
    def saw_step(self, kind: StepKind, num_tokens: int, step_budget: int) -> bool:
        """This request's slot in a step row; True if the record changed."""
        if self.state in FINAL or kind == StepKind.IDLE:
            return False
        if kind == StepKind.PREFILL:
            self.state = RequestState.PREFILL
            self.prefill_chunk = (self.prefill_chunk or 0) + 1
            self.prefilled_tokens += num_tokens
            left = max(0, self.prompt_tokens - self.cached_tokens - self.prefilled_tokens)
            self.prefill_chunks = self.prefill_chunk + math.ceil(left / max(1, step_budget))
        else:
            self.state = RequestState.DECODING
        return True

    def saw_output(self, out) -> None:
        """An engine output of this request (RequestOutput: a token, or the end)."""
        m = out.metrics
        self.cached_tokens = out.num_cached_tokens
        self.generated_tokens = len(out.token_ids)
        self.ttft_s = m.ttft_s
        self.tpot_s = m.tpot_s
        self.waited_s = m.queue_s
        if out.finished:
            aborted = out.finish_reason == "abort" or out.error
            self.state = RequestState.ABORTED if aborted else RequestState.DONE
            self.finish_reason = "error" if out.error else out.finish_reason
            self.text = out.text
        elif self.generated_tokens and self.state != RequestState.DECODING:
            self.state = RequestState.DECODING


def step_row(trace: StepTrace, step: int, engine: int, records: dict) -> dict:
    """A StepTrace as the room shows it: its `step` the room's own count, slots naming requests
    and students. records: engine request id -> Record, every request of this engine the room
    still holds (finished ones too: static batching keeps a finished request's slot idle). A slot
    whose record the room no longer holds (cleared) is left empty, never sent nameless."""
    row = trace.as_dict()
    row["engine_step"], row["step"], row["engine"] = row["step"], step, engine
    slots = []
    for work in trace.slots:
        if work is None:
            slots.append(None)
            continue
        record = records.get(work.request_id)
        if record is None:
            slots.append(None)
            continue
        slots.append({"request": record.id, "student": record.student,
                      "kind": work.kind.value, "num_tokens": work.num_tokens, "output_index": work.output_index,
                      "recompute": work.recompute})
    row["slots"] = slots
    row["preempted"] = [records[r].id for r in trace.preempted if r in records]
    row["finished"] = [records[r].id for r in trace.finished if r in records]
    return row


def busy_slots(row: dict) -> int:
    """Requests that did work in a step (a prefill chunk or a decode): one pass over the weights served them."""
    return sum(1 for s in row["slots"] if s and s["kind"] != StepKind.IDLE.value)
