"""EngineLoop: the engine on a background thread, fed from many threads (tiny model)."""

import threading

import pytest

from core import EngineLoop, EngineOverloaded, InvalidParameter, SamplingParams

TIMEOUT = 60


def long_params(n=40) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture
def make_loop(make_tiny_engine):
    loops = []

    def make(max_queue=1024, start=True, **settings):
        loop = EngineLoop(make_tiny_engine(**settings), max_queue=max_queue)
        loops.append(loop)
        return loop.start() if start else loop
    yield make
    for loop in loops:
        loop.shutdown()


def test_two_threads_submit_and_share_steps(make_loop, assert_pool_clean):
    loop = make_loop()
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def client(name, prompt):
        try:
            barrier.wait(TIMEOUT)
            stream = loop.submit(prompt, long_params(100))
            outputs = list(stream)
            results[name] = (stream.request_id, outputs)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(n, p)) for n, p in (("a", "Once upon a time"),
                                                                         ("b", "The weather today"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors
    assert set(results) == {"a", "b"}
    ids = {results[n][0] for n in results}
    assert len(ids) == 2
    for rid, outputs in results.values():
        final = outputs[-1]
        assert final.finished and final.finish_reason == "length" and final.request_id == rid
        assert len(final.token_ids) == 100
        assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
        assert "".join(o.new_text for o in outputs) == final.text
        assert all(not o.finished for o in outputs[:-1])
    trace = loop.call(lambda engine: list(engine.view.trace)).result(TIMEOUT)
    shared = [row for row in trace if ids <= {w.request_id for w in row.slots if w is not None}]
    assert shared, "the two requests never ran in the same step"
    loop.call(assert_pool_clean).result(TIMEOUT)


def test_the_same_tokens_as_the_engine_alone(make_loop, make_tiny_engine):
    engine = make_tiny_engine()
    params = SamplingParams(temperature=0.0, max_tokens=12)
    seq = engine.add_request("The weather today", params)
    while engine.has_unfinished_requests():
        engine.step()
    loop = make_loop()
    out = loop.submit("The weather today", params).result(TIMEOUT)
    assert out.token_ids == seq.output_token_ids


def test_call_runs_on_the_loop_thread(make_loop):
    loop = make_loop()
    caller = threading.current_thread().name
    name = loop.call(lambda engine: threading.current_thread().name).result(TIMEOUT)
    assert name == "sendlens-engine" != caller
    assert loop.call(lambda engine: engine.view.kv_stats()["block_size"]).result(TIMEOUT) == 16

    def boom(engine):
        raise KeyError("inside")
    with pytest.raises(KeyError):
        loop.call(boom).result(TIMEOUT)
    assert loop.alive


def test_a_listener_that_raises_does_not_stop_the_loop(make_loop, caplog):
    loop = make_loop()
    calls = []

    def bad_listener(output):
        calls.append(output)
        raise RuntimeError("listener bug")

    loop.submit("Hello", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), listener=bad_listener)
    out = loop.submit("Good morning", SamplingParams(temperature=0.0, max_tokens=5)).result(TIMEOUT)
    assert out.finished
    loop.call(lambda engine: None).result(TIMEOUT)   # the loop still takes commands
    assert loop.alive
    assert calls and calls[-1].finished and len(calls[-1].token_ids) == 5   # kept getting outputs
    assert any("listener" in r.getMessage() for r in caplog.records)


def test_invalid_input_raises_in_the_callers_thread(make_loop):
    loop = make_loop()
    with pytest.raises(InvalidParameter) as exc:
        loop.submit("", SamplingParams())
    assert exc.value.param == "prompt"
    with pytest.raises(InvalidParameter) as exc:
        loop.submit([1, 2, 10**7])
    assert exc.value.param == "prompt"
    with pytest.raises(InvalidParameter) as exc:
        loop.submit("Hi", SamplingParams(max_tokens=0))
    assert exc.value.param == "max_tokens"
    assert loop.call(lambda engine: engine.has_unfinished_requests()).result(TIMEOUT) is False


def test_overloaded_when_the_queue_is_full(make_loop):
    loop = make_loop(max_queue=2, start=False)   # not started: submissions stay pending
    params = SamplingParams(temperature=0.0, max_tokens=3)
    first, second = loop.submit("one", params), loop.submit("two", params)
    with pytest.raises(EngineOverloaded) as exc:
        loop.submit("three", params)
    assert exc.value.code == "overloaded" and exc.value.param == "queue"
    loop.start()
    assert first.result(TIMEOUT).finished and second.result(TIMEOUT).finished
    assert loop.submit("four", params).result(TIMEOUT).finished   # room again


def test_abort_mid_stream_frees_the_blocks(make_loop, assert_pool_clean):
    loop = make_loop()
    stream = loop.submit("Once upon a time", long_params(500))
    other = loop.submit("The weather today", long_params(20))
    outputs = []
    for output in stream:
        outputs.append(output)
        if len(outputs) == 3:
            loop.abort(stream.request_id)
    final = outputs[-1]
    assert final.finished and final.finish_reason == "abort"
    assert 3 <= len(final.token_ids) < 500
    assert other.result(TIMEOUT).finish_reason == "length"
    loop.call(assert_pool_clean).result(TIMEOUT)
    loop.abort("no-such-request")                     # harmless
    assert loop.call(lambda engine: engine.view.kv_stats()["used_blocks"]).result(TIMEOUT) == 0


def test_abort_all_ends_every_request_and_the_loop_goes_on(make_loop, assert_pool_clean):
    """A server shutting down (app/runtime.py: begin_shutdown) ends every request between two
    steps, running or waiting, each with its abort; the loop itself keeps serving."""
    loop = make_loop()
    running = loop.submit("Once upon a time", long_params(1000))
    assert not next(iter(running)).finished                 # it has its first token
    gate = threading.Event()
    loop.call(lambda engine: gate.wait(TIMEOUT))  # hold the loop: the second is queued before the abort
    streams = [running, loop.submit([5, 6, 7], long_params(1000))]
    loop.abort_all()
    gate.set()
    for stream in streams:
        final = stream.result(TIMEOUT)
        assert final.finished and final.finish_reason == "abort" and len(final.token_ids) < 1000
    loop.call(assert_pool_clean).result(TIMEOUT)
    assert loop.submit([5, 6, 7], long_params(3)).result(TIMEOUT).finish_reason == "length"


def test_shutdown_aborts_what_is_running(make_loop, assert_pool_clean):
    loop = make_loop()
    stream = loop.submit("Once upon a time", long_params(1000))
    first = next(iter(stream))
    assert not first.finished
    loop.shutdown()
    assert not loop.alive
    final = stream.result(TIMEOUT)
    assert final.finished and final.finish_reason == "abort"
    assert_pool_clean(loop.engine)


def test_widget_jobs_run_one_per_step(make_loop):
    """A burst of jobs cannot stall the streams: at most one job runs between two steps."""
    loop = make_loop()
    gate = threading.Event()
    loop.call(lambda engine: gate.wait(TIMEOUT))  # hold the loop while the burst queues up
    stream = loop.submit([5, 6, 7], long_params(20))
    futures = [loop.call(lambda engine: engine.view.num_steps) for _ in range(5)]
    gate.set()
    steps_seen = [f.result(TIMEOUT) for f in futures]
    assert stream.result(TIMEOUT).finish_reason == "length"
    assert steps_seen == sorted(steps_seen) and len(set(steps_seen)) == len(steps_seen)


def test_a_failing_step_ends_the_requests_in_flight_with_an_error(make_loop, assert_pool_clean):
    loop = make_loop(start=False)
    engine = loop.engine
    step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a bug")
        return step()
    engine.step = failing_step
    loop.start()
    out = loop.submit([5, 6, 7], long_params(20)).result(TIMEOUT)
    assert out.finished and out.error and "a bug" not in out.error
    after = loop.submit([5, 6, 7], long_params(4)).result(TIMEOUT)  # the loop goes on
    assert after.error is None and after.finish_reason == "length"
    loop.call(lambda e: None).result(TIMEOUT)
    assert_pool_clean(engine)


def chunk_flops(cfg, start: int, tokens: int) -> float:
    """Multiply-adds x 2 of a prefill chunk of `tokens` tokens at positions start..start+tokens-1:
    every linear layer once per token, plus attention's QK and PV over the keys each token sees."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    linear = 2 * cfg.num_layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size)
    per_key = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    keys = tokens * start + tokens * (tokens + 1) // 2
    return tokens * linear + per_key * keys


@pytest.mark.real_model
def test_a_long_prompt_stalls_other_streams_by_about_one_first_chunk(smollm_loaded):
    """A 4,000-token prompt arrives while a chat decodes (default settings: chunked prefill,
    256-token steps, chunks shrinking with their context). It is prefilled in chunks, the chat
    gets a token in every one of those steps, and no chunk does more work than a first chunk:
    with a budget counted in tokens only, the last chunks (attending to ~3,700 keys) took 3.4
    times as long as the first. Counted in the model's arithmetic, not timed (the durations are
    printed). The bound, derived: a chunk of t tokens at position c costs t(A + Bc) + Bt(t+1)/2
    (A: linear work per token, B: attention work per key), and the scheduler keeps
    t(1 + c/C) within the budget N (C = chunk_context_tokens), so t(A + Bc) <= N max(A, BC)
    and t <= N: no chunk costs more than max(1, BC/A) times a chunk of N tokens at position 0."""
    from core import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="smollm2-135m"), smollm_loaded)
    engine.warmup()
    loop = EngineLoop(engine, max_queue=8).start()
    try:
        chat = loop.submit("Tell me about lighthouses.", SamplingParams(temperature=0.0, max_tokens=200,
                                                                         ignore_eos=True))
        next(iter(chat))                                                 # the chat is decoding
        long_ids = (engine.tokenizer.encode(" the quick brown fox jumps over the lazy dog") * 500)[:4000]
        long = loop.submit(long_ids, SamplingParams(temperature=0.0, max_tokens=1))
        long_out = long.result(timeout=600)
        loop.abort(chat.request_id)
        chat_out = chat.result(timeout=600)
    finally:
        loop.shutdown()
    prefill = [s for s in long_out.metrics.steps if s.kind == "prefill"]
    budget = engine.config.max_num_batched_tokens
    assert len(prefill) >= 4000 // budget and all(s.batch_tokens <= budget for s in prefill)
    assert sum(s.num_tokens for s in prefill) == 4000
    chat_steps = {s.step for s in chat_out.metrics.steps}
    assert all(s.step in chat_steps for s in prefill)                         # decoded beside every chunk
    cfg, C = smollm_loaded.config, engine.config.chunk_context_tokens
    B = chunk_flops(cfg, 1, 1) - chunk_flops(cfg, 0, 1)                       # one more key
    A = chunk_flops(cfg, 0, 1) - B                                            # the rest of a token
    bound = max(1.0, B * C / A) * chunk_flops(cfg, 0, budget)
    starts = [sum(s.num_tokens for s in prefill[:i]) for i in range(len(prefill))]
    costs = [chunk_flops(cfg, c, s.num_tokens) for c, s in zip(starts, prefill)]
    print(f"{len(prefill)} chunks, costs {min(costs) / 1e9:.0f}-{max(costs) / 1e9:.0f} GFLOP against {bound / 1e9:.0f}; "
          f"durations {[round(s.duration_s * 1000) for s in prefill]} ms")
    assert max(costs) <= bound           # a budget of tokens alone: the last chunks cost 2.1x the bound
