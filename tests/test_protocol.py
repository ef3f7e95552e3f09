"""The websocket protocol of docs/protocol.md, against a real server on loopback (tiny model).

The `live_server` fixture (conftest.py) has small limits: 4 connections, 2 requests per
connection, a queue of 3, 4096-byte messages, max_tokens at most 64 (16 by default), 64 tokens
for the looking-inside views. Every error test then sends a valid request on the same socket.
"""

import json
import threading
import time
from simple_websocket import ConnectionClosed
from contextlib import contextmanager

import pytest

from bounds import U64, decimal_half
from conftest import TIMEOUT, WS, Client, Stream, healthz, wait_for
from core import LLM
from core.engine.sampling_params import SamplingParams

KINDS = {"content", "wrapper", "inserted", "generation_prompt", "special"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def assert_works(ws: WS) -> None:
    """The connection still serves a valid request."""
    s = ws.generate(prompt="Still there?", max_tokens=2)
    assert s.error is None and s.done is not None
    assert s.done["completion_tokens"] == len(s.tokens) >= 1


def check_stream(s: Stream, max_tokens: int) -> None:
    """The invariants of one generate stream (docs/protocol.md)."""
    assert s.error is None, s.error
    acc, done, toks = s.accepted, s.done, s.tokens
    assert acc["max_tokens"] == max_tokens
    assert [t["index"] for t in toks] == list(range(len(toks)))
    assert all(t["id"] == acc["id"] for t in toks)
    assert all(isinstance(t["token_id"], int) and isinstance(t["text"], str) for t in toks)
    assert done["completion_tokens"] == len(toks)
    assert done["prompt_tokens"] == acc["prompt_tokens"]
    assert s.text == done["text"]
    t_ms = [t["t_ms"] for t in toks]
    assert t_ms == sorted(t_ms)
    assert done["finish_reason"] in {"stop", "length"}
    if done["finish_reason"] == "length":
        assert len(toks) == max_tokens and done["stop_reason"] is None
    else:
        assert len(toks) <= max_tokens and done["stop_reason"] is not None

    m = done["metrics"]
    assert set(m) == {"queue_ms", "ttft_ms", "tpot_ms", "e2e_ms"}
    assert m["ttft_ms"] == t_ms[0]
    assert 0 <= m["queue_ms"] <= m["ttft_ms"] <= m["e2e_ms"]
    if len(toks) > 1:
        # the server rounds each time to the microsecond (ms(): 3 places): t_ms[-1] - t_ms[0] is off by
        # two half-units, divided by n - 1, and tpot_ms by one; the float64 roundings of those ms
        # values (x 1000, the rounding, the differences, the divide: 8, of numbers at most e2e_ms) add u each
        n = len(toks)
        assert m["tpot_ms"] == pytest.approx((t_ms[-1] - t_ms[0]) / (n - 1), rel=0,
                                             abs=decimal_half(3) * (1 + 2 / (n - 1)) + 8 * U64 * m["e2e_ms"])
    tl = done["timeline"]
    assert tl["first_token_ms"] == m["ttft_ms"] and tl["finished_ms"] == m["e2e_ms"]
    assert 0 <= tl["first_scheduled_ms"] <= tl["first_token_ms"]
    steps = tl["steps"]
    # the first step's start is the very clock reading that set first_scheduled_time (step_recorder), same ms(): exact
    assert steps[0]["kind"] == "prefill" and steps[0]["start_ms"] == tl["first_scheduled_ms"]
    assert [st["step"] for st in steps] == sorted(set(st["step"] for st in steps))
    starts = [st["start_ms"] for st in steps]
    assert starts == sorted(starts)
    prefill = [st for st in steps if st["kind"] == "prefill"]
    decode = [st for st in steps if st["kind"] == "decode"]
    assert len(prefill) + len(decode) == len(steps)
    assert sum(st["num_tokens"] for st in prefill) == done["prompt_tokens"] - done["num_cached_tokens"]
    assert len(decode) == len(toks) - 1 and all(st["num_tokens"] == 1 for st in decode)
    for st in steps:
        assert st["duration_ms"] >= 0
        assert st["batch_seqs"] >= 1 and st["batch_tokens"] >= st["num_tokens"]
        assert st["start_ms"] + st["duration_ms"] <= tl["finished_ms"] + 0.01


# ---- helpers on the server side --------------------------------------------------------------
def all_blocks_free(server) -> dict:
    def check():
        h = healthz(server)
        return h if (h["kv"]["free_blocks"] == h["kv"]["total_blocks"] and h["running"] == 0
                     and h["waiting"] == 0) else None
    return wait_for(check, what="every KV block to be free")


@contextmanager
def engine_paused(server):
    """Hold the engine loop between steps, so requests sent meanwhile start together."""
    loop = server.runtime.loop
    gate, entered = threading.Event(), threading.Event()

    def hold(engine):
        entered.set()
        gate.wait(60)

    future = loop.call(hold)
    assert entered.wait(TIMEOUT), "the engine loop did not take the pause"
    try:
        yield
    finally:
        gate.set()
        future.result(TIMEOUT)


@pytest.fixture
def job_type(monkeypatch):
    """A job message type registered for one test: test_job {n} -> {"n": n, "steps": <engine steps>}.
    Set job_type["work"] to a function of the engine to replace the default work."""
    from app.widgets import MESSAGE_TYPES
    from app.widgets.base import integer, message

    control = {"work": None}

    def handle(call):
        n = integer(call.msg, "n", 0, 10**6)

        def work(engine):
            if control["work"] is not None:
                return control["work"](engine)
            return {"n": n, "steps": engine.view.num_steps}
        call.job({"n": n, "nonce": id(control), "custom": control["work"] is not None}, work)

    monkeypatch.setitem(MESSAGE_TYPES, "test_job", message("test_job", {"n"}, handle, job=True))
    return control


def wait_pending(server, n: int) -> None:
    """The accepted requests reached the engine loop's queue (accepted is sent just before)."""
    wait_for(lambda: server.runtime.loop._num_pending == n, what=f"{n} queued requests")


def wait_aborts_queued(server, n: int) -> None:
    """n aborts sent over the socket reached the paused engine loop's command queue, behind its
    queued requests (the server reads a message on its own thread): the loop takes them before
    its next step."""
    loop = server.runtime.loop
    wait_for(lambda: loop._commands.qsize() >= loop._num_pending + n, what=f"{n} queued aborts")


@pytest.fixture
def slow_engine(live_server, monkeypatch):
    """Each engine step takes 20 ms longer: time to act while a request streams."""
    engine = live_server.runtime.engine
    step = engine.step

    def slow_step():
        time.sleep(0.02)
        return step()
    monkeypatch.setattr(engine, "step", slow_step)
    return engine


@pytest.fixture
def connect(live_server):
    """Open more connections; all are closed at teardown."""
    opened = []

    def open_one():
        c = WS(live_server.ws)
        opened.append(c)
        return c
    yield open_one
    for c in opened:
        c.close()


@pytest.fixture(scope="module")
def reference_llm(tiny_loaded):
    """The same tiny model run directly by the engine, in the server's weight format, to compare
    the socket's tokens with."""
    from app.config import ServerConfig
    return LLM("tiny", loaded=tiny_loaded, num_kv_blocks=256, weight_format=ServerConfig().engine.weight_format)


# ---- hello -----------------------------------------------------------------------------------
def test_hello_comes_first_and_describes_the_model(live_server, ws):
    h = ws.hello
    assert h["type"] == "hello" and h["protocol"] == 1
    info = live_server.runtime.loop.info()
    assert {k: h[k] for k in info if k != "model"} == {k: v for k, v in info.items() if k != "model"}
    assert set(h) == set(info) | {"type", "protocol", "limits", "job_types", "request_types"}
    mc = live_server.runtime.engine.model_config
    assert h["model"] == "tiny"
    assert h["num_layers"] == mc.num_layers and h["num_heads"] == mc.num_heads
    assert h["num_kv_heads"] == mc.num_kv_heads and h["head_dim"] == mc.head_dim
    assert h["context_window"] == mc.max_position_embeddings == 2048
    assert h["block_size"] == 16
    # how the serving products round activations: each linear layer's own kernel says the same
    from core.model.model import Linear
    kernels = [m.kernel for m in live_server.runtime.engine.view.model.modules() if isinstance(m, Linear) and m.kernel]
    assert kernels and {k.activation_rounding for k in kernels} == {h["activation_rounding"]}
    # and attention's operands: each layer's attention says the same
    layers = live_server.runtime.engine.view.model.layers
    assert {"bf16" if layer.attn.bf16_operands else "fp32" for layer in layers} == {h["attention_operands"]}
    limits = h["limits"]
    assert limits["max_tokens_limit"] == 64 and limits["default_max_tokens"] == 16
    assert limits["max_inspect_tokens"] == 64
    assert limits["max_jobs_per_connection"] == live_server.runtime.config.max_jobs_per_connection
    from app.widgets import MESSAGE_TYPES
    assert h["job_types"] == sorted(t for t, m in MESSAGE_TYPES.items() if m.job)
    assert h["request_types"] == sorted(t for t, m in MESSAGE_TYPES.items() if m.request)
    assert "generate" in h["request_types"] and "generate" not in h["job_types"]
    assert ws.quiet(), "the server says hello once, then waits"


# ---- generate --------------------------------------------------------------------------------
def test_generate_with_messages(live_server, ws, reference_llm):
    s = ws.generate(messages=QUESTION, max_tokens=12)
    check_stream(s, 12)
    tokenizer = live_server.runtime.engine.tokenizer
    prompt_ids = tokenizer.apply_chat_template(QUESTION)
    assert s.accepted["prompt_tokens"] == len(prompt_ids)
    assert s.accepted["context_window"] == 2048
    # The same greedy request run directly on the engine gives the same tokens.
    ref = reference_llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert s.token_ids == ref.token_ids
    assert s.done["text"] == ref.text
    assert s.done["finish_reason"] == ref.finish_reason


def test_generate_with_prompt_uses_no_template(live_server, ws, reference_llm):
    prompt = "Once upon a time"
    s = ws.generate(prompt=prompt)  # default max_tokens
    check_stream(s, 16)
    assert s.accepted["prompt_tokens"] == len(live_server.runtime.engine.tokenizer.encode(prompt))
    ref = reference_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert s.token_ids == ref.token_ids


def test_generate_integer_id_is_echoed(ws):
    s = ws.finish(ws.start(mid=7, prompt="Hello", max_tokens=3))
    assert s.error is None
    assert s.accepted["id"] == 7 and s.done["id"] == 7
    assert all(t["id"] == 7 for t in s.tokens)


def test_generate_sampling_fields_are_accepted(ws):
    s = ws.generate(prompt="The weather today", max_tokens=6, temperature=0.8, top_k=50, top_p=0.9, seed=3)
    check_stream(s, 6)


def test_second_request_reuses_the_prefix_cache(ws):
    messages = [{"role": "system", "content": "You are a terse assistant who answers in one word."},
                {"role": "user", "content": "Name a colour of the rainbow, please."}]
    first = ws.generate(messages=messages, max_tokens=3)
    again = ws.generate(messages=messages, max_tokens=3)
    check_stream(first, 3)
    check_stream(again, 3)
    cached = again.done["num_cached_tokens"]
    assert cached > 0 and cached % 16 == 0
    assert cached <= again.done["prompt_tokens"] - 1
    assert again.done["timeline"]["steps"][0]["num_tokens"] == again.done["prompt_tokens"] - cached
    assert again.token_ids == first.token_ids  # the cache changes the work, not the answer


def test_stop_strings_end_the_text(ws):
    prompt = "The cat sat on the mat"
    plain = ws.generate(prompt=prompt, max_tokens=24)
    check_stream(plain, 24)
    text = plain.done["text"]
    assert len(text) >= 6, "the tiny model should say something"
    stop = text[len(text) // 2: len(text) // 2 + 3]
    expected = text[: text.find(stop)]

    s = ws.generate(prompt=prompt, max_tokens=24, stop=stop)
    check_stream(s, 24)
    assert s.done["finish_reason"] == "stop"
    assert s.done["stop_reason"] == s.done["stop_reason_text"] == stop
    assert s.done["text"] == expected == s.text
    assert stop not in s.text

    listed = ws.generate(prompt=prompt, max_tokens=24, stop=["\u2603never-in-the-text\u2603", stop])
    assert listed.done["stop_reason"] == stop and listed.done["text"] == expected

    absent = ws.generate(prompt=prompt, max_tokens=24, stop="\u2603never-in-the-text\u2603")
    assert absent.done["finish_reason"] == "length" and absent.done["text"] == text


def test_seed_reproducible_over_the_socket(live_server, ws, connect):
    fields = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 3.0}
    first = ws.generate(seed=1234, **fields)
    again = ws.generate(seed=1234, **fields)
    check_stream(first, 10)
    assert again.token_ids == first.token_ids and again.done["text"] == first.done["text"]

    # The same seed with another request in the same steps samples the same tokens.
    other = connect()
    with engine_paused(live_server):
        a = ws.start(seed=1234, **fields)
        ws.accepted(a)
        b = other.start(prompt="A different prompt, a different length", max_tokens=10, temperature=1.0)
        other.accepted(b)
        wait_pending(live_server, 2)
    batched = ws.finish(a, accepted={})
    other.finish(b, accepted={})
    assert max(st["batch_seqs"] for st in batched.done["timeline"]["steps"]) >= 2
    assert batched.token_ids == first.token_ids

    runs = {tuple(ws.generate(seed=seed, **fields).token_ids) for seed in range(4)}
    assert len(runs) > 1, "different seeds should be able to sample differently"


# ---- abort -----------------------------------------------------------------------------------
def test_abort_mid_stream(live_server, ws, slow_engine):
    mid = ws.start(prompt="Once upon a time", max_tokens=64)
    acc = ws.accepted(mid)
    tokens = [ws.recv_for(mid), ws.recv_for(mid)]
    assert [t["type"] for t in tokens] == ["token", "token"]
    ws.send({"type": "abort", "id": mid})
    s = ws.finish(mid, accepted=acc)
    s.tokens[:0] = tokens
    assert s.done["finish_reason"] == "abort" and s.done["stop_reason"] is None
    assert 2 <= s.done["completion_tokens"] == len(s.tokens) < 64
    assert [t["index"] for t in s.tokens] == list(range(len(s.tokens)))
    assert s.text == s.done["text"]
    m = s.done["metrics"]
    assert m["ttft_ms"] == tokens[0]["t_ms"] and m["e2e_ms"] >= m["ttft_ms"]
    all_blocks_free(live_server)
    assert_works(ws)


def test_abort_before_the_first_token(live_server, ws):
    with engine_paused(live_server):
        mid = ws.start(prompt="Once upon a time", max_tokens=64)
        ws.accepted(mid)
        wait_pending(live_server, 1)
        ws.send({"type": "abort", "id": mid})
        wait_aborts_queued(live_server, 1)       # behind the request, before the loop resumes
    done = ws.recv_for(mid)
    assert done["type"] == "done" and done["finish_reason"] == "abort"
    assert done["completion_tokens"] == 0 and done["text"] == ""
    assert done["metrics"]["ttft_ms"] is None and done["metrics"]["tpot_ms"] is None
    assert done["timeline"]["first_token_ms"] is None and done["timeline"]["steps"] == []
    all_blocks_free(live_server)
    assert_works(ws)


def test_abort_of_an_unknown_id(ws):
    err = ws.error({"type": "abort", "id": "ghost"}, mid="ghost")
    assert err["code"] == "invalid_request" and err["param"] == "id"
    s = ws.generate(prompt="Hi", max_tokens=2)
    err = ws.error({"type": "abort", "id": s.accepted["id"]}, mid=s.accepted["id"])  # already done
    assert err["param"] == "id"
    assert_works(ws)


def test_duplicate_running_id(live_server, ws):
    with engine_paused(live_server):
        ws.start(mid="dup", prompt="Once upon a time", max_tokens=5)
        acc = ws.accepted("dup")
        err = ws.error({"type": "generate", "id": "dup", "prompt": "again"}, mid="dup")
        assert err["code"] == "invalid_request" and err["param"] == "id"
    s = ws.finish("dup", accepted=acc)
    check_stream(s, 5)
    # Once done, the id may be used again.
    again = ws.generate(mid="dup", prompt="Once upon a time", max_tokens=5)
    assert again.token_ids == s.token_ids


# ---- template --------------------------------------------------------------------------------
def test_template_matches_the_engine_tokenizer(live_server, ws):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "What is 2 + 2?"}]
    t = ws.call("template", messages=messages)
    assert t["type"] == "template"
    tokenizer = live_server.runtime.engine.tokenizer
    ids = tokenizer.apply_chat_template(messages)
    assert [tok["id"] for tok in t["tokens"]] == ids
    assert t["num_tokens"] == len(ids)
    assert t["text"] == tokenizer.render_template(messages)
    assert "".join(tok["text"] for tok in t["tokens"]) == t["text"]
    assert t["context_window"] == 2048
    kinds = [tok["kind"] for tok in t["tokens"]]
    assert set(kinds) <= KINDS
    assert {"content", "wrapper", "special", "generation_prompt"} <= set(kinds)
    assert kinds[-1] == "generation_prompt"
    for tok in t["tokens"]:
        if tok["kind"] == "special":
            assert tok["id"] in tokenizer.special_ids
        if tok["kind"] == "content":
            assert messages[tok["message"]]["role"] == tok["role"]
    for i, m in enumerate(messages):
        content = "".join(tok["text"] for tok in t["tokens"] if tok["kind"] == "content" and tok["message"] == i)
        assert content.strip() == m["content"]


def test_template_shows_the_inserted_default_system_prompt(live_server, ws):
    t = ws.call("template", messages=QUESTION)
    inserted = [tok for tok in t["tokens"] if tok["kind"] == "inserted"]
    assert inserted, "SmolLM2's template adds a system message when none is given"
    assert all(tok["message"] is None for tok in inserted)
    assert [tok["id"] for tok in t["tokens"]] == live_server.runtime.engine.tokenizer.apply_chat_template(QUESTION)


def test_template_errors(ws):
    err = ws.error({"type": "template", "id": "t"}, mid="t")
    assert err["param"] == "messages"
    err = ws.error({"type": "template", "id": "t", "messages": [{"role": "bot", "content": "x"}]}, mid="t")
    assert err["param"] == "messages[0].role"
    assert ws.call("template", messages=QUESTION)["type"] == "template"


# ---- attention -------------------------------------------------------------------------------
def test_internal_error_leaves_the_connection_working(ws, job_type):
    def broken(engine):
        raise RuntimeError("a bug")
    job_type["work"] = broken
    err = ws.error({"type": "test_job", "id": "a", "n": 1}, mid="a")
    assert err["code"] == "internal_error" and "a bug" not in err["message"]
    job_type["work"] = None
    assert ws.call("test_job", n=2)["type"] == "test_job"
    assert_works(ws)


def test_a_handler_bug_answers_internal_error(ws, job_type, monkeypatch):
    def handler_bug(call):
        raise KeyError("oops")
    from app.widgets import MESSAGE_TYPES
    from app.widgets.base import message
    monkeypatch.setitem(MESSAGE_TYPES, "test_job", message("test_job", {"n"}, handler_bug, job=True))
    err = ws.error({"type": "test_job", "id": "b", "n": 1}, mid="b")
    assert err["code"] == "internal_error" and err["id"] == "b"
    monkeypatch.undo()
    assert_works(ws)


# ---- errors ----------------------------------------------------------------------------------
GOOD = {"type": "generate", "prompt": "Hello"}


@pytest.mark.parametrize("raw,param", [
    ("{oops", "message"),
    ("", "message"),
    ("[1, 2]", "message"),
    ('"generate"', "message"),
    ("null", "message"),
    (b'{"type": "generate", "id": "b", "prompt": "binary"}', "message"),
    (json.dumps({"prompt": "Hello"}), "id"),
    (json.dumps({"type": "generate", "id": 1.5, "prompt": "Hello"}), "id"),
    (json.dumps({"type": "generate", "id": None, "prompt": "Hello"}), "id"),
    (json.dumps({"type": "generate", "id": ["x"], "prompt": "Hello"}), "id"),
    (json.dumps({"type": "generate", "id": {"x": 1}, "prompt": "Hello"}), "id"),
    (json.dumps({**GOOD, "id": "x", "prompt": "y" * 5000}), "message"),
])
def test_unusable_message_is_refused_without_an_id(ws, raw, param):
    err = ws.error(raw, mid=None)
    assert err["code"] == "invalid_request" and err["param"] == param and err["id"] is None
    assert isinstance(err["message"], str) and err["message"]
    assert_works(ws)


@pytest.mark.parametrize("bad_id", ["", "x" * 65, True, False])
def test_bad_id_is_refused_with_a_null_id(ws, bad_id):
    """A string out of 1..64 characters or a boolean is no usable id: the error's id is null."""
    err = ws.error({**GOOD, "id": bad_id}, mid=None)
    assert err["code"] == "invalid_request" and err["param"] == "id" and err["id"] is None
    assert "id" in err["message"]
    assert_works(ws)


def test_id_limits(ws):
    for good_id in ["x" * 64, "é", 0, -3, 2 ** 40]:
        s = ws.finish(ws.start(mid=good_id, prompt="Hi", max_tokens=1))
        assert s.error is None and s.done["id"] == good_id


@pytest.mark.parametrize("msg,param", [
    ({"type": "dance", "id": "x"}, "type"),
    ({"id": "x", "prompt": "Hello"}, "type"),
    ({"type": 3, "id": "x"}, "type"),
    ({**GOOD, "id": "x", "temperatur": 0.5}, "temperatur"),
    ({"type": "abort", "id": "x", "reason": "bored"}, "reason"),
    ({"type": "template", "id": "x", "messages": QUESTION, "prompt": "Hi"}, "prompt"),
    ({"type": "generate", "id": "x", "messages": QUESTION, "prompt": "Hi"}, "messages"),
    ({"type": "generate", "id": "x"}, "messages"),
    ({"type": "generate", "id": "x", "messages": []}, "messages"),
    ({"type": "generate", "id": "x", "messages": "Hi"}, "messages"),
    ({"type": "generate", "id": "x", "messages": [{"role": "user"}]}, "messages[0]"),
    ({"type": "generate", "id": "x", "messages": [{"role": "user", "content": "a", "name": "b"}]}, "messages[0]"),
    ({"type": "generate", "id": "x", "messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    ({"type": "generate", "id": "x", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"type": "generate", "id": "x", "prompt": ""}, "prompt"),
    ({"type": "generate", "id": "x", "prompt": 42}, "prompt"),
    ({**GOOD, "id": "x", "temperature": -1}, "temperature"),
    ({**GOOD, "id": "x", "temperature": 101}, "temperature"),
    ({**GOOD, "id": "x", "temperature": "hot"}, "temperature"),
    ({**GOOD, "id": "x", "temperature": None}, "temperature"),
    ({**GOOD, "id": "x", "top_p": 0}, "top_p"),
    ({**GOOD, "id": "x", "top_p": 1.5}, "top_p"),
    ({**GOOD, "id": "x", "top_p": True}, "top_p"),
    ({**GOOD, "id": "x", "top_k": -2}, "top_k"),
    ({**GOOD, "id": "x", "top_k": 2.5}, "top_k"),
    ({**GOOD, "id": "x", "seed": -1}, "seed"),
    ({**GOOD, "id": "x", "seed": "42"}, "seed"),
    ({**GOOD, "id": "x", "seed": 1.5}, "seed"),
    ({**GOOD, "id": "x", "stop": 5}, "stop"),
    ({**GOOD, "id": "x", "stop": ""}, "stop"),
    ({**GOOD, "id": "x", "stop": [""]}, "stop"),
    ({**GOOD, "id": "x", "stop": ["ok", 1]}, "stop"),
    ({**GOOD, "id": "x", "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "id": "x", "max_tokens": 65}, "max_tokens"),
    ({**GOOD, "id": "x", "max_tokens": "5"}, "max_tokens"),
    ({**GOOD, "id": "x", "max_tokens": True}, "max_tokens"),
    ({**GOOD, "id": "x", "max_tokens": 2.0}, "max_tokens"),
])
def test_bad_message_is_refused_naming_the_field(ws, msg, param):
    err = ws.error(msg, mid="x")
    assert err == {"type": "error", "id": "x", "code": "invalid_request", "message": err["message"], "param": param}
    assert param.split("[")[0] in err["message"]
    assert_works(ws)


def test_max_tokens_at_the_limit_is_accepted(ws):
    s = ws.generate(prompt="Count with me:", max_tokens=64)
    check_stream(s, 64)


def test_message_at_max_message_bytes(ws):
    """The limit counts UTF-8 bytes of the whole frame: just under is served, just over refused."""
    head = json.dumps({"type": "template", "id": "big", "messages": [{"role": "user", "content": ""}]})
    fill = 4096 - len(head.encode())
    under = json.dumps({"type": "template", "id": "big", "messages": [{"role": "user", "content": "é" * (fill // 2)}]},
                       ensure_ascii=False)
    assert len(under.encode()) <= 4096
    ws.send(under)
    assert ws.recv_for("big")["type"] == "template"
    over = under.replace("é", "éé", 1) + " "
    assert len(over.encode()) > 4096 and len(over) < 4096
    err = ws.error(over, mid=None)
    assert err["param"] == "message" and "4096" in err["message"]
    assert_works(ws)


def test_context_length_exceeded(live_server, ws):
    tokenizer = live_server.runtime.engine.tokenizer
    window = ws.hello["context_window"]
    prompt = "1" * (window + 10)  # SmolLM2's tokenizer gives every digit its own token
    assert len(tokenizer.encode(prompt)) > window
    err = ws.error({"type": "generate", "id": "long", "prompt": prompt}, mid="long")
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert str(window) in err["message"]
    exact = "1" * window  # fills the window exactly: no room for one token
    assert len(tokenizer.encode(exact)) == window
    err = ws.error({"type": "generate", "id": "long", "prompt": exact}, mid="long")
    assert err["code"] == "context_length_exceeded"
    # One token short of the window: one token is generated, then the window ends it.
    s = ws.generate(prompt="1" * (window - 1), max_tokens=64)
    assert s.error is None
    assert s.done["prompt_tokens"] == window - 1
    assert s.done["completion_tokens"] == 1 and s.done["finish_reason"] == "length"
    prefill = [st for st in s.done["timeline"]["steps"] if st["kind"] == "prefill"]
    assert sum(st["num_tokens"] for st in prefill) == window - 1 - s.done["num_cached_tokens"]
    assert_works(ws)


# ---- overloaded ------------------------------------------------------------------------------
def test_overloaded_per_connection(live_server, ws):
    with engine_paused(live_server):
        a = ws.start(prompt="Once upon a time", max_tokens=4)
        b = ws.start(prompt="Once upon a time", max_tokens=4)
        acc = {a: ws.accepted(a), b: ws.accepted(b)}
        err = ws.error({"type": "generate", "id": "third", "prompt": "Hi"}, mid="third")
        assert err["code"] == "overloaded" and err["param"] == "connection"
        assert "max_requests_per_connection" in err["message"]
        # Other kinds of message are not limited.
        assert ws.call("template", messages=QUESTION)["type"] == "template"
    for mid in (a, b):
        check_stream(ws.finish(mid, accepted=acc[mid]), 4)
    assert_works(ws)


def test_overloaded_queue(live_server, ws, connect):
    other = connect()
    with engine_paused(live_server):
        mine = [ws.start(prompt="Once upon a time", max_tokens=4) for _ in range(2)]
        for mid in mine:
            ws.accepted(mid)
        wait_pending(live_server, 2)
        theirs = other.start(prompt="Once upon a time", max_tokens=4)
        other.accepted(theirs)
        wait_pending(live_server, 3)
        err = other.error({"type": "generate", "id": "fourth", "prompt": "Hi"}, mid="fourth")
        assert err["code"] == "overloaded" and err["param"] == "queue"
        for mid in mine:
            ws.send({"type": "abort", "id": mid})
        wait_aborts_queued(live_server, 2)       # before the loop resumes and runs them to the end
    for mid in mine:
        assert ws.finish(mid, accepted={}).done["finish_reason"] == "abort"
    assert other.finish(theirs, accepted={}).done["finish_reason"] in {"stop", "length"}
    assert_works(other)
    assert_works(ws)


def test_overloaded_connections_then_closed(live_server, connect):
    wait_for(lambda: healthz(live_server)["connections"] == 0, what="earlier connections to close")
    limit = live_server.app.config["SENDLENS"].max_connections
    clients = [connect() for _ in range(limit)]
    assert all(c.hello["type"] == "hello" for c in clients)
    assert healthz(live_server)["connections"] == limit

    extra = Client.connect(live_server.ws)
    try:
        err = json.loads(extra.receive(TIMEOUT))
        assert err["type"] == "error" and err["code"] == "overloaded" and err["param"] == "connections"
        assert err["id"] is None and "max_connections" in err["message"]
        with pytest.raises(ConnectionClosed):
            extra.receive(TIMEOUT)
    finally:
        try:
            extra.close()
        except ConnectionClosed:
            pass
    assert healthz(live_server)["connections"] == limit

    # The others are unaffected, and a freed place can be taken.
    assert_works(clients[0])
    clients.pop().close()
    wait_for(lambda: healthz(live_server)["connections"] == limit - 1, what="the connection count to drop")
    newcomer = connect()
    assert newcomer.hello["type"] == "hello"
    assert_works(newcomer)


# ---- the one engine --------------------------------------------------------------------------
def test_two_clients_share_engine_steps(live_server, ws, connect):
    other = connect()
    engine = live_server.runtime.engine
    first_step = engine.view.num_steps
    with engine_paused(live_server):
        a = ws.start(messages=QUESTION, max_tokens=8)
        ws.accepted(a)
        b = other.start(prompt="Once upon a time there was a", max_tokens=8)
        other.accepted(b)
        wait_pending(live_server, 2)
    sa, sb = ws.finish(a, accepted={}), other.finish(b, accepted={})
    assert sa.done["finish_reason"] != "abort" and sb.done["finish_reason"] != "abort"
    shared_a = {st["step"] for st in sa.done["timeline"]["steps"] if st["batch_seqs"] >= 2}
    shared_b = {st["step"] for st in sb.done["timeline"]["steps"] if st["batch_seqs"] >= 2}
    assert shared_a and shared_a == shared_b
    for st in sa.done["timeline"]["steps"]:
        if st["step"] in shared_a:
            assert st["batch_tokens"] > st["num_tokens"]

    rows = [r for r in list(engine.view.trace) if r.step >= first_step]
    requests = {w.request_id for r in rows for w in r.slots if w is not None}
    assert len(requests) == 2, "only these two requests ran"
    together = [r for r in rows
                if {w.request_id for w in r.slots if w is not None and w.kind != "idle"} == requests]
    assert together, "a step whose slots hold both requests"
    assert {r.step for r in together} == shared_a


def test_closing_the_socket_aborts_its_requests(live_server, connect, slow_engine):
    engine = live_server.runtime.engine
    first_step = engine.view.num_steps
    c = connect()
    mids = [c.start(prompt="Once upon a time", max_tokens=64),
            c.start(messages=QUESTION, max_tokens=64)]
    for mid in mids:
        c.accepted(mid)
        assert c.recv_for(mid)["type"] == "token"
    assert healthz(live_server)["running"] == 2
    c.close()
    all_blocks_free(live_server)
    rows = [r for r in list(engine.view.trace) if r.step >= first_step]
    produced = {}
    for r in rows:
        for w in r.slots:
            if w is not None and w.output_index is not None:
                produced[w.request_id] = max(produced.get(w.request_id, 0), w.output_index)
        assert not r.finished, "no request ran to its end"
    assert len(produced) == 2 and all(n < 64 for n in produced.values())
    wait_for(lambda: healthz(live_server)["connections"] == 0, what="the connection to close")


# ---- review fixes: one client must not be able to hurt the others ------------------------------

def test_a_vanishing_temperature_is_greedy_and_harms_no_one(live_server, ws, connect, reference_llm):
    """1e-45 rounds to 0 in float32: it must be served as greedy, not crash the step for everyone."""
    other = connect()
    with engine_paused(live_server):
        victim = other.start(prompt="Once upon a time", max_tokens=12)
        tiny = ws.start(prompt="Once upon a time", max_tokens=12, temperature=1e-45)
        odd_p = ws.start(prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=1e-46, seed=1)
    v, t, p = other.finish(victim), ws.finish(tiny), ws.finish(odd_p)
    for s in (v, t, p):
        assert s.error is None and s.done["finish_reason"] == "length"
    greedy = reference_llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert t.token_ids == greedy.token_ids == v.token_ids
    assert p.token_ids == greedy.token_ids  # a vanishing top_p keeps only the most likely token
    all_blocks_free(live_server)


def test_a_failing_step_reports_an_error_and_the_server_goes_on(live_server, ws, monkeypatch):
    engine = live_server.runtime.engine
    step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a bug in a step")
        return step()
    monkeypatch.setattr(engine, "step", failing_step)
    s = ws.generate(prompt="Once upon a time", max_tokens=32)
    assert s.error is not None and s.error["code"] == "internal_error"
    assert "a bug" not in s.error["message"]
    monkeypatch.undo()
    all_blocks_free(live_server)
    assert healthz(live_server)["status"] == "ok"
    assert_works(ws)


def test_abort_keeps_streamed_text_equal_to_the_final_text(live_server, ws, slow_engine):
    """Text held back near a stop string is dropped on abort, not sent only in done."""
    stop = "a stop string far longer than anything the tiny model will say"
    mid = ws.start(prompt="Once upon a time", max_tokens=64, stop=stop)
    acc = ws.accepted(mid)
    tokens = [ws.recv_for(mid) for _ in range(4)]
    ws.send({"type": "abort", "id": mid})
    s = ws.finish(mid, accepted=acc)
    s.tokens[:0] = tokens
    assert s.done["finish_reason"] == "abort"
    assert s.text == s.done["text"]
    all_blocks_free(live_server)


def test_jobs_are_limited_per_connection(live_server, ws, job_type):
    limit = live_server.runtime.config.max_jobs_per_connection
    with engine_paused(live_server):
        for i in range(limit + 1):
            ws.send({"type": "test_job", "id": f"job{i}", "n": 100 + i})
        err = ws.recv_for(f"job{limit}")
        assert err["type"] == "error" and err["code"] == "overloaded" and err["param"] == "connection"
    for i in range(limit):
        assert ws.recv_for(f"job{i}")["type"] == "test_job"
    assert_works(ws)


def test_too_many_messages_in_a_chat(live_server, ws):
    n = live_server.runtime.config.max_messages + 1
    err = ws.error({"type": "template", "id": "t", "messages": [{"role": "user", "content": ""}] * n}, mid="t")
    assert err["code"] == "invalid_request" and err["param"] == "messages"
    assert_works(ws)


def test_deeply_nested_json_is_an_invalid_request(ws):
    err = ws.error("[" * 2000 + "]" * 2000, mid=None)
    assert err["code"] == "invalid_request" and err["param"] == "message"
    assert_works(ws)


def test_zz_every_kv_block_is_free_at_the_end(live_server):
    h = all_blocks_free(live_server)
    assert h["status"] == "ok"
    engine = live_server.runtime.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


# ---- n samples -------------------------------------------------------------------------------
def test_generate_n_streams_each_samples_tokens_with_its_index(live_server, ws, reference_llm):
    from core.engine.sampling_params import derived_seed
    prompt = "Once upon a time"
    s = ws.generate(prompt=prompt, max_tokens=5, n=3, temperature=8.0, seed=4)
    assert s.error is None and s.accepted["n"] == 3
    by_sample = {i: [m for m in s.tokens if m["sample"] == i] for i in range(3)}
    assert set(m["sample"] for m in s.tokens) == {0, 1, 2}
    for i, tokens in by_sample.items():
        assert [m["index"] for m in tokens] == list(range(5))
        lone = reference_llm.generate(prompt, SamplingParams(temperature=8.0, seed=derived_seed(4, i), max_tokens=5))[0]
        assert [m["token_id"] for m in tokens] == lone.token_ids
        assert "".join(m["text"] for m in tokens) == s.done["samples"][i]["text"] == lone.text
    assert [d["sample"] for d in s.done["samples"]] == [0, 1, 2]
    assert all(d["finish_reason"] == "length" and d["completion_tokens"] == 5 for d in s.done["samples"])
    assert s.done["text"] == s.done["samples"][0]["text"]


def test_generate_n_over_max_samples_is_refused_by_name(live_server, ws):
    limit = live_server.runtime.config.max_samples
    for n in (limit + 1, 0):
        err = ws.error({"type": "generate", "id": "n", "prompt": "Hi", "n": n}, mid="n")
        assert err["code"] == "invalid_request" and err["param"] == "n", err
    assert_works(ws)
