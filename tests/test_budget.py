"""app/budget.py: every message priced by its work, in tokens, against its connection's budget.

The bucket's arithmetic on a fake clock; then a server (tiny model) with a small budget: a flood of
templates is refused with `overloaded` and a retry hint while a bystander's chats all complete;
generate pays for its prompt and its stop strings; and large tokenizations run as jobs on the
engine loop's thread in slices, never on a reader thread. Counts and orders, never elapsed time.
"""

import threading
from types import SimpleNamespace

import pytest

from app.budget import STOP_CHECKS_PER_TOKEN, WorkBudget, stop_cost, text_estimate
from app.protocol import ProtocolError
from conftest import WS, healthz, serve_app, wait_for


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


# ---- the bucket --------------------------------------------------------------------------------
def test_a_message_is_let_in_while_the_bucket_holds_its_cost():
    clock = Clock()
    b = WorkBudget(rate=100, burst=1000, clock=clock)
    assert b.take(600) == 600
    with pytest.raises(ProtocolError) as info:
        b.take(500, mid="m")                        # 400 left: short by 100 tokens, one second
    err = info.value.as_message()
    assert err["code"] == "overloaded" and err["param"] == "budget" and err["id"] == "m"
    # app/budget.py sends round(wait + 0.005, 2): never below the wait, at most 0.01 above it
    # (plus float64 rounding far below the second decimal), hence abs=0.01 here and below
    assert err["retry_after_s"] == pytest.approx(1.0, abs=0.01)
    clock.t = 1.0                                   # the hint was right: now it fits
    assert b.take(500) == 500


def test_the_estimate_is_settled_to_the_real_count():
    b = WorkBudget(rate=100, burst=1000, clock=Clock())
    b.take(800)                                     # bytes, an upper bound
    b.settle(800, 200)                              # the tokens it made
    assert b.level == 800 and b.charged == 200


def test_a_message_larger_than_the_bucket_waits_for_a_full_one_and_debt_is_bounded():
    clock = Clock()
    b = WorkBudget(rate=100, burst=1000, clock=clock)
    b.take(5000)                                    # a full bucket lets it in
    b.settle(5000, 5000)
    assert b.level == -1000                         # debt floored at one bucket
    with pytest.raises(ProtocolError) as info:
        b.take(1)
    assert info.value.retry_after_s == pytest.approx(10.01, abs=0.01)   # (1 + 1000) / 100
    clock.t = 20.0
    assert b.take(5000) == 5000


def test_job_slices_are_charged_after_the_fact_and_only_empty_the_bucket():
    clock = Clock()
    b = WorkBudget(rate=100, burst=1000, clock=clock)
    for _ in range(100):
        b.charge(16, floor=0)
    assert b.level == 0 and b.charged == 1600
    with pytest.raises(ProtocolError) as info:
        b.take(50)
    assert info.value.retry_after_s == pytest.approx(0.51, abs=0.01)     # the message's own cost, no debt
    b.charge(100)                                                        # other work may owe
    assert b.level == -100
    b.charge(16, floor=0)                                                # a slice never deepens a debt
    assert b.level == -100


def test_prices():
    assert text_estimate("abc", "é") == 5                          # UTF-8 bytes: at least one per token
    assert stop_cost(["a", "b"], STOP_CHECKS_PER_TOKEN) == 2        # one token per STOP_CHECKS_PER_TOKEN checks
    assert stop_cost("a", 1) == 1 and stop_cost(None, 100) == 0


def test_work_settings_must_be_positive():
    from app.config import ServerConfig
    from core.errors import InvalidParameter
    for name in ("work_tokens_per_second", "work_burst_tokens", "work_slice_tokens", "job_slice_tokens"):
        with pytest.raises(InvalidParameter) as info:
            ServerConfig(model="tiny", **{name: 0})
        assert info.value.param == name


def test_sliced_rendering_and_pieces_equal_the_one_piece_functions(tiny_loaded):
    """A chat with emoji cut across tokens and a typed special token, rendered in slices of 7
    tokens of work: the same tokens, labels and chips as in one piece, in many steps."""
    from app.token_text import pieces, pieces_steps
    from core.model.tokenizer import drain
    t = tiny_loaded.tokenizer
    chat = [{"role": "system", "content": "Be kind 😀 " * 30}, {"role": "user", "content": "héllo <|im_start|> x " * 50},
            {"role": "assistant", "content": "ok 🎉" * 20}]
    steps, whole = t.render_chat_steps(chat, per_step=7), t.render_chat(chat)
    count = 0
    while True:
        try:
            next(steps)
            count += 1
        except StopIteration as stop:
            sliced = stop.value
            break
    assert sliced == whole and count > len(whole.token_ids) // 7
    assert drain(pieces_steps(t, whole.token_ids, 3)) == pieces(t, whole.token_ids)


# ---- on a server ------------------------------------------------------------------------------
SETTINGS = {"model": "tiny", "num_kv_blocks": 128, "testing": True, "max_tokens_limit": 64,
            "default_max_tokens": 4, "work_tokens_per_second": 256, "work_burst_tokens": 2048,
            "work_slice_tokens": 64}


@pytest.fixture(scope="module")
def server(tiny_loaded):
    yield from serve_app(dict(SETTINGS), tiny_loaded)


@pytest.fixture
def fresh(server):
    wait_for(lambda: healthz(server)["connections"] == 0, timeout=15, what="earlier connections to close")
    yield
    wait_for(lambda: healthz(server)["connections"] == 0, timeout=15, what="this test's connections to close")


def final(ws: WS, mid) -> dict:
    """A reply past any progress messages (a long template runs as a job)."""
    while (m := ws.recv_for(mid, timeout=120))["type"] == "progress":
        pass
    return m


def test_a_template_flood_is_refused_by_its_cost_while_a_bystander_chats(server, fresh):
    big = [{"role": "user", "content": "word " * 600}]                 # 3,000 bytes: more than the bucket
    flooder, bystander = WS(server.ws), WS(server.ws)
    replies, done = [], []

    def flood():
        for i in range(12):
            flooder.send({"type": "template", "id": f"f{i}", "messages": big})
            replies.append(final(flooder, f"f{i}"))
    thread = threading.Thread(target=flood)
    thread.start()
    for i in range(4):
        stream = bystander.generate(prompt=f"Bystander question {i}", max_tokens=4)
        done.append(stream.done)
    thread.join(180)
    flooder.close()
    bystander.close()
    assert all(d is not None for d in done)                            # every bystander request completed
    refused = [r for r in replies if r["type"] == "error"]
    served = [r for r in replies if r["type"] == "template"]
    assert len(replies) == 12 and served and refused                   # the flood was served, then refused
    assert all(r["code"] == "overloaded" and r["param"] == "budget" and r["retry_after_s"] > 0 for r in refused)
    assert "work_tokens_per_second" in refused[0]["message"]
    assert served[0]["num_tokens"] > SETTINGS["work_slice_tokens"]


def test_stop_strings_pay_for_their_checks(server, fresh):
    burst = SETTINGS["work_burst_tokens"]
    # stop strings whose checks cost four buckets: let in on a full bucket, then the next message
    # waits for the debt (one bucket at most) to be paid off
    max_tokens = SETTINGS["max_tokens_limit"]
    stop = [f"q{i}" for i in range(4 * burst * STOP_CHECKS_PER_TOKEN // max_tokens)]
    assert stop_cost(stop, max_tokens) == 4 * burst
    ws = WS(server.ws)
    try:
        first = ws.generate(prompt="Once upon a time", max_tokens=max_tokens, stop=stop)
        assert first.done is not None
        err = ws.error({"type": "generate", "id": "again", "prompt": "Once upon a time", "max_tokens": 2},
                       mid="again")
        assert err["code"] == "overloaded" and err["param"] == "budget" and err["retry_after_s"] > 0
    finally:
        ws.close()


def test_a_prompt_is_settled_to_its_tokens(server, fresh, monkeypatch):
    """The estimate (bytes) is settled to the prompt's real token count, plus its stop checks."""
    settled = []
    settle = WorkBudget.settle
    monkeypatch.setattr(WorkBudget, "settle", lambda self, estimate, actual: settled.append((estimate, actual))
                        or settle(self, estimate, actual))
    ws = WS(server.ws)
    try:
        prompt = "The river ran past the old mill. " * 8
        stream = ws.generate(prompt=prompt, max_tokens=4, stop=["never"] * 3)
        prompt_tokens = stream.accepted["prompt_tokens"]
    finally:
        ws.close()
    assert (text_estimate(prompt) + stop_cost(["never"] * 3, 4), prompt_tokens + stop_cost(["never"] * 3, 4)) in settled
    assert prompt_tokens < text_estimate(prompt)


def test_large_tokenizations_run_as_jobs_never_on_a_reader_thread(server, fresh, monkeypatch):
    """Every tokenizer call is recorded with its thread and the tokens it made: on a reader thread
    none makes more than one slice (work_slice_tokens); the long ones ran on the engine loop's."""
    tokenizer = server.runtime.engine.view.tokenizer
    calls: list[tuple[str, int]] = []

    class Recording:
        def __init__(self, hf):
            self.hf = hf

        def __getattr__(self, name):
            return getattr(self.hf, name)

        def encode(self, text, **kw):
            ids = self.hf.encode(text, **kw)
            calls.append((threading.current_thread().name, len(ids)))
            return ids

        def __call__(self, text, **kw):
            enc = self.hf(text, **kw)
            calls.append((threading.current_thread().name, len(enc["input_ids"])))
            return enc

        @property
        def backend_tokenizer(self):                 # the Rust tokenizer itself (render_chat's encoding)
            backend = self.hf.backend_tokenizer

            class Backend:
                def encode(self, text, **kw):
                    enc = backend.encode(text, **kw)
                    calls.append((threading.current_thread().name, len(enc.ids)))
                    return enc
            return Backend()
    monkeypatch.setattr(tokenizer, "hf", Recording(tokenizer.hf))
    ws = WS(server.ws)
    text = "The river ran past the old mill, and the miller counted boats. " * 10   # both fit the bucket
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "Yes. " * 40}]
    ws.send({"type": "tokenize", "id": "t", "text": text})
    tokens = final(ws, "t")
    ws.send({"type": "template", "id": "c", "messages": messages})
    chat = final(ws, "c")
    short = ws.call("tokenize", text="hello there")
    ws.close()
    monkeypatch.undo()
    # the same answers as the one-piece functions give
    assert tokens["type"] == "tokenize" and [t["id"] for t in tokens["tokens"]] == tokenizer.encode(text)
    assert "".join(t["text"] for t in tokens["tokens"]) == text
    rendered = tokenizer.render_chat(messages)
    assert chat["type"] == "template" and [t["id"] for t in chat["tokens"]] == rendered.token_ids
    assert [t["kind"] for t in chat["tokens"]] == [t.kind.value for t in rendered.tokens]
    assert short["num_tokens"] == 2
    slice_tokens = SETTINGS["work_slice_tokens"]
    on_readers = [n for name, n in calls if name != "sendlens-engine"]
    on_engine = [n for name, n in calls if name == "sendlens-engine"]
    assert on_readers and max(on_readers) <= slice_tokens, calls
    assert len([n for n in on_engine if n > slice_tokens]) == 2, calls     # the tokenize and the template


def test_the_retry_hint_is_honoured(server, fresh):
    """After `overloaded`, waiting retry_after_s lets the same message in (the hint is the
    server's own arithmetic; the sleep here only follows it)."""
    import time
    ws = WS(server.ws)
    big = {"type": "tokenize", "text": "word " * 500}                    # 2,500 bytes: needs a full bucket
    ws.send({**big, "id": "b0"})
    assert final(ws, "b0")["type"] == "tokenize"
    ws.send({**big, "id": "b1"})
    refused = final(ws, "b1")
    assert refused["type"] == "error" and refused["code"] == "overloaded" and refused["param"] == "budget"
    time.sleep(refused["retry_after_s"])
    ws.send({**big, "id": "b2"})
    assert final(ws, "b2")["type"] == "tokenize"
    ws.close()


def test_a_job_is_charged_for_each_slice_it_runs_beside_a_chat():
    """The runner charges a slice to its owner only while the serving engine has requests."""
    from app.jobs import JobRunner

    class Owner:
        charged = 0

        def charge_slice(self):
            self.charged += 1

    class Engine:
        busy = False

        def has_unfinished_requests(self):
            return self.busy

    def work(engine):
        for _ in range(6):
            yield None
        return {}
    runner, owner, engine = JobRunner(), Owner(), Engine()
    runner.submit(owner, 1, "k", work, lambda event: None)
    for i in range(7):
        engine.busy = i % 2 == 0                       # slices 0, 2, 4, 6 beside a chat
        assert runner(engine)
    assert owner.charged == 4 and runner.stats()["slices"] == 7
