"""app/prompt_job.py: a `generate` whose prompt is longer than a slice is rendered and tokenized
by the job runner, between engine steps, then submitted as a short prompt is.

On a server (tiny model) with small slices: the replies equal the same request's run inline (a
larger `work_slice_tokens`) and the engine's own; errors name the same parameters; a bystander's
engine steps interleave with the prompt's pieces; an abort or a closed connection while the
prompt is tokenized (or being submitted) drops it with no request made and every KV block free;
a tokenizing request counts against max_requests_per_connection; the work estimate is settled to
the real tokens. The engine loop's thread is held at chosen points with events, never timed.
"""

import threading

import pytest

from app.budget import WorkBudget, stop_cost
from core.engine.sampling_params import SamplingParams
from core.model.tokenizer import CHARS_PER_TOKEN
from conftest import WS, healthz, serve_app, wait_for

SETTINGS = {"model": "tiny", "num_kv_blocks": 128, "testing": True, "max_tokens_limit": 64,
            "default_max_tokens": 8, "work_slice_tokens": 32, "max_requests_per_connection": 1}
ENGINE_THREAD = "sendlens-engine"
LONG = ("The river ran past the old mill, and the miller counted the boats.\nEach one carried "
        "grain, 12 sacks or 30, to the town; the children waved (\u00e9t\u00e9 \U0001f389). ") * 12
SAME = ("finish_reason", "stop_reason", "stop_reason_text", "prompt_tokens", "completion_tokens", "text")


@pytest.fixture(scope="module")
def server(tiny_loaded):
    yield from serve_app(dict(SETTINGS), tiny_loaded)


@pytest.fixture
def fresh(server, assert_pool_clean):
    """No connections before; after: none, no job left in the runner, every KV block free."""
    wait_for(lambda: healthz(server)["connections"] == 0, timeout=15, what="earlier connections to close")
    yield
    wait_for(lambda: healthz(server)["connections"] == 0, timeout=15, what="this test's connections to close")
    wait_for(lambda: server.runtime.jobs.stats()["jobs"] == 0, timeout=15, what="the jobs to end")
    server.runtime.loop.call(assert_pool_clean).result(timeout=30)


class EngineLog:
    """What the engine loop's thread did, in order: ("piece", engine busy) for each tokenizer
    call, ("step",) for each engine step, ("prepare",) and ("enqueue",) for each request.
    `hold(kind)` makes the first event of that kind wait until `release()`."""

    def __init__(self, runtime, monkeypatch):
        self.events: list[tuple] = []
        self.reached, self.released, self.held = threading.Event(), threading.Event(), None
        engine, loop, tok = runtime.loop.engine, runtime.loop, runtime.engine.view.tokenizer
        self.engine = engine
        for owner, name, kind in ((tok, "encode", "piece"), (engine, "step", "step"),
                                  (loop, "prepare", "prepare"), (loop, "enqueue", "enqueue")):
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), kind))

    def _wrap(self, fn, kind):
        def wrapped(*args, **kwargs):
            if threading.current_thread().name == ENGINE_THREAD:
                self.events.append(("piece", self.engine.has_unfinished_requests()) if kind == "piece" else (kind,))
                if kind == self.held and not self.reached.is_set():
                    self.reached.set()
                    self.released.wait(60)              # hang-stopping only: the test releases it
            return fn(*args, **kwargs)
        return wrapped

    def hold(self, kind: str) -> None:
        self.held = kind

    def release(self) -> None:
        self.released.set()

    def count(self, kind: str) -> int:
        return sum(1 for e in self.events if e[0] == kind)


@pytest.fixture
def log(server, monkeypatch):
    return EngineLog(server.runtime, monkeypatch)


def compare(a, b) -> None:
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert {k: a.done[k] for k in SAME} == {k: b.done[k] for k in SAME}
    assert {k: v for k, v in a.accepted.items() if k != "id"} == {k: v for k, v in b.accepted.items() if k != "id"}


@pytest.mark.parametrize("field", ["prompt", "messages"])
def test_a_long_prompt_is_tokenized_in_slices_and_answered_as_inline(server, fresh, log, monkeypatch, field):
    runtime = server.runtime
    body = {"prompt": LONG} if field == "prompt" else {"messages": [{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": LONG}]}
    ws = WS(server.ws)
    try:
        sliced = ws.generate(**body, max_tokens=12, temperature=0.0)
        pieces = log.count("piece")
        monkeypatch.setattr(runtime.config, "work_slice_tokens", 1 << 20)     # the same request, inline
        inline = ws.generate(**body, max_tokens=12, temperature=0.0)
    finally:
        ws.close()
    compare(sliced, inline)
    # many pieces (at least half of one every work_slice_tokens * CHARS_PER_TOKEN characters), on the engine's thread
    assert pieces >= len(LONG) // (SETTINGS["work_slice_tokens"] * CHARS_PER_TOKEN * 2)
    assert log.count("piece") == pieces                                        # ... and none for the inline run
    assert log.events.index(("prepare",)) > max(i for i, e in enumerate(log.events) if e[0] == "piece")
    tok = runtime.engine.view.tokenizer
    ids = tok.encode(LONG) if field == "prompt" else tok.apply_chat_template(body["messages"])
    ref = runtime.loop.submit(ids, SamplingParams(temperature=0.0, max_tokens=12)).result(timeout=60)
    assert sliced.token_ids == ref.token_ids and sliced.accepted["prompt_tokens"] == len(ids)


def test_errors_that_need_the_tokens_name_the_same_parameters(server, fresh, monkeypatch):
    runtime = server.runtime
    too_long = "word " * 2100                                  # over the tiny model's 2048-token window
    ws = WS(server.ws)
    try:
        sliced = ws.error({"type": "generate", "id": "a", "prompt": too_long}, mid="a")
        monkeypatch.setattr(runtime.config, "work_slice_tokens", 1 << 20)
        inline = ws.error({"type": "generate", "id": "b", "prompt": too_long}, mid="b")
        assert ws.generate(prompt="Once upon a time", max_tokens=2).done is not None   # nothing held
    finally:
        ws.close()
    assert (sliced["code"], sliced["param"]) == (inline["code"], inline["param"])
    assert (sliced["code"], sliced["param"]) == ("context_length_exceeded", "prompt")
    assert sliced["message"] == inline["message"]


def test_a_bystanders_steps_interleave_with_the_prompts_pieces(server, fresh, log):
    """The job runner gives the prompt one slice a turn of the engine loop: once the bystander is
    in the engine, an engine step comes between any two of the prompt's pieces."""
    log.hold("piece")
    long_ws, bystander = WS(server.ws), WS(server.ws)
    try:
        mid = long_ws.start(prompt=LONG, max_tokens=4)
        assert log.reached.wait(30), "the prompt's first piece never ran"
        b = bystander.start(prompt="Once upon a time", max_tokens=64, temperature=0.0)
        accepted = bystander.accepted(b)                       # queued before the loop can take it
        log.release()
        stream = long_ws.finish(mid)
        other = bystander.finish(b, accepted)
    finally:
        long_ws.close()
        bystander.close()
    assert stream.done is not None and other.done is not None
    pieces = [i for i, e in enumerate(log.events) if e[0] == "piece"]
    assert log.events[pieces[0]] == ("piece", False)           # the first: before the bystander came in
    busy = [(a, b) for a, b in zip(pieces, pieces[1:]) if log.events[a] == ("piece", True)]
    assert len(busy) >= 8, log.events                          # the bystander's 64 steps outlast the pieces
    for a, b in busy:                                          # a piece beside a running request: a step next
        assert ("step",) in log.events[a:b], log.events[a:b + 1]


@pytest.mark.parametrize("when", ["tokenizing", "submitting"])
@pytest.mark.parametrize("how", ["abort", "close"])
def test_an_abort_or_close_while_the_prompt_is_tokenized_makes_no_request(server, fresh, log, how, when):
    """Held on the engine's thread in a piece of the prompt (its job then dropped between slices)
    or in its last slice, after tokenizing (EngineLoop.prepare): the client gets `aborted`, no
    request is enqueued, the connection's place is free and every KV block stays free."""
    log.hold("piece" if when == "tokenizing" else "prepare")
    ws = WS(server.ws)
    try:
        ws.start(mid="x", prompt=LONG, max_tokens=4)
        assert log.reached.wait(30), "the prompt never reached the engine's thread"
        if how == "abort":
            ws.send({"type": "abort", "id": "x"})
            err = ws.recv_for("x")
            assert err["type"] == "error" and err["code"] == "aborted" and "tokenized" in err["message"]
        else:
            ws.close()
            wait_for(lambda: healthz(server)["connections"] == 0, timeout=15, what="the connection to close")
        log.release()
        wait_for(lambda: server.runtime.jobs.stats()["jobs"] == 0, timeout=15, what="the job to be dropped")
        if how == "abort":                                     # the id and the request's place are free again
            again = ws.generate(mid="x", prompt="Once upon a time", max_tokens=2)
            assert again.done is not None and ws.quiet(0.2)    # nothing more for the aborted one
    finally:
        ws.close()
    enqueued = log.count("enqueue")
    assert enqueued == 0, log.events                           # the inline `again` enqueues on the reader's thread
    assert log.count("prepare") == (1 if when == "submitting" else 0)


def test_a_tokenizing_request_counts_against_max_requests_per_connection(server, fresh, log):
    log.hold("piece")
    ws = WS(server.ws)
    try:
        ws.start(mid="long", prompt=LONG, max_tokens=4)
        assert log.reached.wait(30)
        short = ws.error({"type": "generate", "id": "short", "prompt": "Hi", "max_tokens": 2}, mid="short")
        second = ws.error({"type": "generate", "id": "long2", "prompt": LONG, "max_tokens": 2}, mid="long2")
        dup = ws.error({"type": "generate", "id": "long", "prompt": "Hi"}, mid="long")
        log.release()
        stream = ws.finish("long")
        after = ws.generate(prompt="Hi", max_tokens=2)
    finally:
        ws.close()
    for err in (short, second):
        assert (err["code"], err["param"]) == ("overloaded", "connection")
        assert "max_requests_per_connection" in err["message"]
    assert (dup["code"], dup["param"]) == ("invalid_request", "id")
    assert stream.done is not None and after.done is not None


def test_the_estimate_is_settled_to_the_prompts_tokens_by_the_job(server, fresh, monkeypatch):
    settled = []
    settle = WorkBudget.settle
    monkeypatch.setattr(WorkBudget, "settle", lambda self, estimate, actual: settled.append(
        (estimate, actual, threading.current_thread().name)) or settle(self, estimate, actual))
    stop = ["never"] * 3
    ws = WS(server.ws)
    try:
        stream = ws.generate(prompt=LONG, max_tokens=4, stop=stop)
        refused = ws.error({"type": "generate", "id": "big", "prompt": "word " * 2100}, mid="big")   # over the window
    finally:
        ws.close()
    prompt_tokens = stream.accepted["prompt_tokens"]
    estimate = len(LONG.encode("utf-8")) + stop_cost(stop, 4)
    assert settled[0] == (estimate, prompt_tokens + stop_cost(stop, 4), ENGINE_THREAD)
    assert prompt_tokens < len(LONG.encode("utf-8"))
    assert refused["code"] == "context_length_exceeded"        # refused once tokenized: its tokens are paid
    big = "word " * 2100
    big_tokens = len(server.runtime.engine.view.tokenizer.encode(big))
    assert settled[1] == (len(big.encode("utf-8")), big_tokens, ENGINE_THREAD)
