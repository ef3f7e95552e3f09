"""The one seam between widgets: what more than one widget needs, so that no widget imports another.

A widget module (app/widgets/<name>.py) imports only this module, base.py (what a widget is and
its field checks) and the app's and core's infrastructure (app.jobs, app.token_text, core.*).
What lives here:

- `machine()`, `worker_machine()`: where and when a measurement ran, one schema for every figure.
- `ms()`: seconds as milliseconds, rounded to the microsecond.
- `remeasure()`: the reader's "measure again" counter (the protocol's `run` field): a new value
  is a new job, where the same inputs are answered from the job cache.
- `run_request()`, `step_until_finished()`, `with_progress()`: a request on a sibling engine (an
  engine of the job's own beside the serving one, LLMEngine.sibling), one engine step per
  `next()`, so a job runs one step per slice of the job runner.
- `filler_ids()`, `read_bandwidth()`: a prompt of plain prose of any length; memory read bandwidth.
- `token_list()`, `pieces()`, `pieces_steps()`, `lone_piece()`: tokens as {id, text} for a reply
  (pieces_steps: in slices, for a job).
- `chat_prompt_steps()`: a message's prompt as token ids, from `messages` (the chat template) or
  `prompt`, in steps (Call.submit runs them: a long prompt as a job, never on the reader's thread).
"""

import os
import platform
import time

import torch

from core.engine.sampling_params import SamplingParams
from core.errors import InvalidParameter
from core.model.tokenizer import validate_messages

from ..token_text import lone_piece, pieces, pieces_steps  # noqa: F401  (the widgets' token helpers, re-offered here)
from .base import integer

REMEASURE_FIELD = "run"            # the protocol's name for the "measure again" counter
MAX_REMEASURE = 1_000_000
BANDWIDTH_VALUES = 32 << 20        # 32 Mi float32 = 128 MiB, far past any CPU cache
FILLER = ("The river ran past the old mill, where the miller kept his books of grain and weather, "
          "and every spring the children counted the boats that came down with the melting snow. ")


# -- measurements ---------------------------------------------------------------------------------

def machine(started: float | None = None) -> dict:
    """Where and when a measurement ran (`started`: time.time() at its start; None: now), shown
    beside every measured figure. measured_at reads "YYYY-MM-DD HH:MM:SS UTC"."""
    at = time.time() if started is None else started
    return {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(), "system": platform.system(),
            "torch": torch.__version__, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))}


def worker_machine(workers: int, threads: int) -> dict:
    """Where and when worker processes (app/processes.py) ran: machine() with their count and threads."""
    return {**machine(), "threads": threads, "workers": workers, "threads_per_worker": threads,
            "load_average": round(os.getloadavg()[0], 2)}


def ms(seconds: float | None) -> float | None:
    """Seconds -> milliseconds rounded to the microsecond (None stays None)."""
    return None if seconds is None else round(seconds * 1000.0, 3)


def remeasure(msg: dict) -> int:
    """The reader's "measure again" counter: part of a job's inputs only so that a new value
    misses the job cache."""
    return integer(msg, REMEASURE_FIELD, 0, MAX_REMEASURE, default=0)


def read_bandwidth() -> float:
    """Bytes read per second by a sum over BANDWIDTH_VALUES float32 values (memory-bound)."""
    x = torch.ones(BANDWIDTH_VALUES)                 # (V,) 128 MiB
    x.sum()                                          # touch the pages first
    t0 = time.perf_counter()
    x.sum()
    return x.nbytes / (time.perf_counter() - t0)


# -- stepping a sibling engine --------------------------------------------------------------------

def step_until_finished(sibling, request_ids):
    """Step `sibling` one engine step per `next()` until every request in `request_ids` has
    finished; returns {request id: its final RequestOutput}."""
    waiting = set(request_ids)
    finished = {}
    while waiting:
        for out in sibling.step():
            if out.finished and out.request_id in waiting:
                finished[out.request_id] = out
                waiting.discard(out.request_id)
        if waiting and not sibling.has_unfinished_requests():
            raise RuntimeError("the sibling engine stopped before its requests finished")
        yield None
    return finished


def run_request(sibling, ids: list[int], max_tokens: int, ignore_eos: bool = True):
    """One greedy request on a sibling engine, one engine step per `next()`; returns its final
    RequestOutput (whose metrics hold every step's duration and token count)."""
    seq = sibling.add_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    finished = yield from step_until_finished(sibling, [seq.request_id])
    return finished[seq.request_id]


def with_progress(gen, progress):
    """Drive a step generator, yielding progress() after each step; returns its result."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value
        yield progress()


def filler_ids(tokenizer, length: int) -> list[int]:
    """`length` tokens of plain prose (the filler text tokenized and repeated)."""
    base = tokenizer.encode(FILLER)
    return (base * (length // len(base) + 1))[:length]


# -- tokens and prompts ---------------------------------------------------------------------------

def token_list(tokenizer, ids: list[int]) -> list[dict]:
    """Each token id with its text: [{id, text}]."""
    return [{"id": i, "text": t} for i, t in zip(ids, tokenizer.token_texts(ids))]


def chat_messages(msg: dict, config) -> list[dict]:
    """The message's `messages`, checked, at most config.max_messages of them."""
    if "messages" not in msg:
        raise InvalidParameter("messages", "is required")
    messages = validate_messages(msg["messages"])
    if len(messages) > config.max_messages:
        raise InvalidParameter("messages", f"has {len(messages)} messages; the most this server takes is "
                                           f"{config.max_messages} (max_messages)")
    return messages


def chat_prompt_steps(call):
    """The token ids of a message's prompt, `messages` (rendered by the chat template) or
    `prompt`, in steps: the fields are checked now; the generator it returns renders the chat
    template (one step), then encodes the text about `work_slice_tokens` tokens of work a step
    (Tokenizer.encode_steps), and returns the ids. Call.submit runs it, at once or as a job."""
    msg = call.msg
    has_messages, has_prompt = "messages" in msg, "prompt" in msg
    if has_messages == has_prompt:
        raise InvalidParameter("messages", "give either messages or prompt, not both or neither")
    if has_prompt and (not isinstance(msg["prompt"], str) or not msg["prompt"]):
        raise InvalidParameter("prompt", "must be a non-empty string")
    messages = None if has_prompt else chat_messages(msg, call.config)
    tokenizer, per_step = call.tokenizer, call.config.work_slice_tokens

    def steps():
        text = msg["prompt"] if messages is None else tokenizer.render_template(messages)
        if messages is not None:
            yield None                         # the template rendered: a step of its own
        return (yield from tokenizer.encode_steps(text, per_step))
    return steps()
