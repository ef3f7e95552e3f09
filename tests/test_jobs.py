"""app/jobs.py: the job runner is fair, bounded, cached, cancellable and reports progress."""

import time

import pytest

from app import jobs
from app.jobs import Event, JobRunner, Progress
from core.errors import EngineOverloaded, InvalidParameter


class Recorder:
    def __init__(self):
        self.events: list[Event] = []

    def __call__(self, event):
        self.events.append(event)

    @property
    def results(self):
        return [e.result for e in self.events if e.kind == "result"]


def slices(n, tag, log):
    """A job of n slices that logs each one as (tag, i)."""
    def work(engine):
        for i in range(n):
            log.append((tag, i))
            yield Progress(i + 1, n)
        return {"tag": tag}
    return work


def drain(runner, engine=None, limit=1000):
    count = 0
    while runner(engine) and count < limit:
        count += 1
    return count


def test_one_slice_per_call_and_the_result_at_the_end():
    runner, log, sub = JobRunner(), [], Recorder()
    runner.submit("a", 1, "k1", slices(3, "a", log), sub)
    assert runner(None) and log == [("a", 0)] and sub.results == []
    drain(runner)
    assert sub.results == [{"tag": "a"}]
    assert runner(None) is False                       # nothing left
    assert runner.stats()["completed"] == 1


def test_slices_alternate_between_connections():
    """Fair queueing: A's three jobs do not hold B's one back."""
    runner, log = JobRunner(), []
    for i in range(3):
        runner.submit("A", i, f"a{i}", slices(2, f"a{i}", log), Recorder())
    runner.submit("B", 0, "b0", slices(2, "b0", log), Recorder())
    drain(runner)
    owners = [tag[0] for tag, _ in log]
    assert owners[:4] == ["a", "b", "a", "b"]          # B's job is done after 4 slices, not 8
    assert [t for t, _ in log if t.startswith("a")] == ["a0", "a0", "a1", "a1", "a2", "a2"]  # A's in order


def test_the_same_inputs_compute_once():
    runner, log = JobRunner(), []
    first, second, third = Recorder(), Recorder(), Recorder()
    runner.submit("A", 1, "same", slices(2, "x", log), first)
    runner.submit("B", 1, "same", slices(2, "x", log), second)   # joins the running job
    drain(runner)
    assert len(log) == 2 and first.results == second.results == [{"tag": "x"}]
    assert runner.submit("C", 1, "same", slices(2, "x", log), third) is True  # from the cache
    assert third.results == [{"tag": "x"}] and len(log) == 2
    assert runner.stats()["cache_hits"] == 1


def test_the_cache_is_bounded():
    runner = JobRunner(cache_entries=2)
    for i in range(3):
        runner.submit("A", i, f"k{i}", lambda engine, i=i: {"i": i}, Recorder())
        drain(runner)
    assert runner.stats()["cached"] == 2
    assert runner.submit("A", 9, "k0", lambda engine: {"i": "again"}, Recorder()) is False  # evicted


def test_cancel_stops_a_job_nobody_waits_for():
    runner, log, a, b = JobRunner(), [], Recorder(), Recorder()
    runner.submit("A", 1, "k", slices(5, "x", log), a)
    runner(None)
    assert runner.cancel("A", 1) is True
    runner.submit("B", 1, "other", slices(1, "y", log), b)
    drain(runner)
    assert a.events == [] and b.results == [{"tag": "y"}]
    assert [t for t, _ in log].count("x") == 1          # stopped after its first slice
    assert runner.stats()["jobs"] == 0


def test_a_job_with_two_subscribers_survives_one_cancel():
    runner, log, a, b = JobRunner(), [], Recorder(), Recorder()
    runner.submit("A", 1, "k", slices(3, "x", log), a)
    runner.submit("B", 1, "k", slices(3, "x", log), b)
    runner.cancel_owner("A")
    drain(runner)
    assert a.events == [] and b.results == [{"tag": "x"}]


def test_errors_reach_every_subscriber_and_are_not_cached():
    runner, sub = JobRunner(), Recorder()

    def bad(engine):
        raise InvalidParameter("layer", "must be an integer from 0 to 29, got 99")
    runner.submit("A", 1, "k", bad, sub)
    drain(runner)
    assert [e.kind for e in sub.events] == ["error"] and sub.events[0].error.param == "layer"
    assert runner.stats()["cached"] == 0


def test_a_bug_in_a_job_is_an_error_event(caplog):
    runner, sub = JobRunner(), Recorder()

    def bug(engine):
        yield
        raise ZeroDivisionError("a bug")
    runner.submit("A", 1, "k", bug, sub)
    drain(runner)
    assert sub.events[-1].kind == "error" and isinstance(sub.events[-1].error, ZeroDivisionError)
    assert "job k failed" in caplog.text


def test_the_runner_is_bounded():
    runner = JobRunner(max_queued_jobs=2)
    runner.submit("A", 1, "k1", slices(1, "a", []), Recorder())
    runner.submit("B", 1, "k2", slices(1, "b", []), Recorder())
    runner.submit("C", 1, "k1", slices(1, "a", []), Recorder())       # joins: no new job
    with pytest.raises(EngineOverloaded) as err:
        runner.submit("C", 2, "k3", slices(1, "c", []), Recorder())
    assert "max_queued_jobs" in str(err.value)


def test_progress_after_a_second(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(jobs.time, "monotonic", lambda: clock[0])
    runner, sub = JobRunner(), Recorder()
    runner.submit("A", 1, "k", slices(6, "x", []), sub)
    runner(None)                                          # at 0 s: too early to report
    clock[0] = 1.2
    runner(None)                                          # reported
    clock[0] = 1.3
    runner(None)                                          # within half a second: not reported
    clock[0] = 1.9
    runner(None)                                          # reported
    progress = [e.progress for e in sub.events if e.kind == "progress"]
    assert [(p.done, p.total) for p in progress] == [(2, 6), (4, 6)]


def test_wake_is_called_when_work_arrives():
    runner, woken = JobRunner(), []
    runner.attach(lambda: woken.append(1))
    runner.submit("A", 1, "k", slices(1, "x", []), Recorder())
    assert woken == [1]


def test_slice_time_is_recorded(monkeypatch):
    """On a clock of the test's own (the slice moves it by 20 ms), so the figure is exact."""
    import types

    from app import jobs
    clock = [100.0]
    monkeypatch.setattr(jobs, "time", types.SimpleNamespace(**{**vars(time), "perf_counter": lambda: clock[0]}))
    runner = JobRunner()

    def slow(engine):
        clock[0] += 0.02
        return {}
    runner.submit("A", 1, "k", slow, Recorder())
    runner(None)
    assert runner.stats()["max_slice_ms"] == pytest.approx(20.0, abs=1e-9)   # 100.02 - 100.0 in binary64


# ---- beside a real chat ------------------------------------------------------------------------
@pytest.mark.real_model
def test_a_long_job_runs_one_slice_between_a_chats_steps(smollm_loaded):
    """A chat streams on the real model while a long probe job (a 1,000-token text, attention
    weights of every layer) runs beside it: the loop never runs two of the job's slices in a row
    while the chat is in flight, so the chat waits at most one slice between its tokens. The order
    of slices and steps is checked, not their times (times on a shared machine are noise)."""
    import statistics

    from core.config import EngineConfig
    from core.engine.engine_loop import EngineLoop
    from core.engine.llm_engine import LLMEngine
    from core.engine.sampling_params import SamplingParams
    from core.inspect import probes

    engine = LLMEngine(EngineConfig(model="smollm2-135m"), smollm_loaded)
    engine.warmup()
    runner = JobRunner()
    order: list[str] = []                              # "slice" and "step", as the loop ran them

    def side_work(engine):
        did = runner(engine)
        if did:
            order.append("slice")
        return did

    engine_step = engine.step

    def step():
        order.append("step")
        return engine_step()

    engine.step = step
    loop = EngineLoop(engine, max_queue=8, side_work=side_work)
    runner.attach(loop.wake)
    loop.start()
    try:
        text = " ".join(f"word{i % 97}" for i in range(600))
        ids = engine.tokenizer.encode(text)[:1000]
        assert len(ids) >= 900
        done = Recorder()

        def work(engine):
            layers = 0
            for item in probes.slices(engine.view.model, ids, attention=True):
                if item is not None:
                    layers += 1
                yield Progress(layers, engine.model_config.num_layers)
            return {"layers": layers}

        stream = loop.submit("Tell me a long story about a lighthouse keeper.",
                             SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        while "step" not in order:                         # the chat is in flight
            time.sleep(0.01)
        runner.submit("reader", 1, "long-probe", work, done)
        out = stream.result(timeout=300)
        chat = list(order)                                 # everything up to the chat's last step
        deadline = time.monotonic() + 300
        while not done.results and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done.results == [{"layers": engine.model_config.num_layers}]
        assert len(out.token_ids) == 48
        during = chat[chat.index("step"):len(chat) - chat[::-1].index("step")]
        assert during.count("step") == len(out.metrics.steps)   # one recorded step per engine step
        assert during.count("slice") >= during.count("step") // 2   # the job ran beside the chat
        pairs = list(zip(during, during[1:]))
        assert ("slice", "slice") not in pairs             # never two slices between two steps
        assert runner.stats()["slices"] > during.count("slice")   # and went on after it
        times = out.metrics.token_times
        gaps = [b - a for a, b in zip(times[1:], times[2:])]
        decode = statistics.median(s.duration_s for s in out.metrics.steps if s.kind == "decode")
        print(f"decode step median {decode * 1000:.1f} ms, largest gap {max(gaps) * 1000:.1f} ms, "
              f"largest job slice {runner.stats()['max_slice_ms']:.1f} ms")   # for the log, not asserted
    finally:
        loop.shutdown()


class FakeEngine:
    def __init__(self, busy: bool):
        self.busy = busy

    def has_unfinished_requests(self) -> bool:
        return self.busy


def test_an_exclusive_slice_waits_for_an_idle_engine():
    """A job's long slice (after EXCLUSIVE) runs only while no request is being served; other
    jobs go on meanwhile."""
    runner, log, a, b = JobRunner(), [], Recorder(), Recorder()

    def long_job(engine):
        log.append("before")
        yield jobs.EXCLUSIVE
        log.append("long slice")
        return {"done": True}

    runner.submit("A", 1, "long", long_job, a)
    runner.submit("B", 1, "short", slices(2, "short", log), b)
    busy = FakeEngine(True)
    for _ in range(6):
        runner(busy)
    assert "long slice" not in log and b.results == [{"tag": "short"}]
    assert runner(busy) is False                     # only the exclusive slice is left: nothing runs
    runner(FakeEngine(False))
    assert log[-1] == "long slice"
    drain(runner, FakeEngine(False))
    assert a.results == [{"done": True}]


def test_a_job_keeps_the_thread_count_it_began_with(monkeypatch):
    """The serving engine may change torch's thread count between any two slices (cpu_share.py);
    each slice of a job runs on the count the job began with, and the engine's count is put back."""
    counts = {"now": 2}
    monkeypatch.setattr(jobs.torch, "get_num_threads", lambda: counts["now"])
    monkeypatch.setattr(jobs.torch, "set_num_threads", lambda n: counts.update(now=n))
    seen = []

    def work(engine):
        for _ in range(3):
            seen.append(counts["now"])
            yield None
        return seen

    runner, sub = JobRunner(), Recorder()
    runner.submit("a", 1, "k", work, sub)
    for serving in (2, 1, 1, 2):               # what the engine set before each of its steps
        counts["now"] = serving
        runner(None)
        assert counts["now"] == serving, "the engine's count is back after the slice"
    assert sub.results == [[2, 2, 2]]
