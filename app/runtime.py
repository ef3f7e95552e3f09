"""The one engine the app owns, started with the app (Flask's init_app pattern).

`init_app` loads the model named by the config, starts an EngineLoop on its own thread with the
job runner as its side work, and keeps both, with the count of open websocket connections, in
`app.extensions["sendlens"]`. Requests from every browser go into this one engine, so they are
batched together. The app reads the engine only through its read-only view (core/engine/view.py):
the loop's snapshots of it (info, stats) and jobs that run on the loop's thread.
"""

import atexit
import threading
from collections import Counter

from flask import Flask, current_app

from core.engine.engine_loop import EngineLoop
from core.engine.llm_engine import LLMEngine
from core.parallel.workers import ProcessBudget

from .config import ServerConfig
from .jobs import JobRunner


class Runtime:
    def __init__(self, config: ServerConfig, loaded=None):
        self.config = config
        engine = LLMEngine(config.engine, loaded)
        engine.warmup()
        self.jobs = JobRunner(config.max_queued_jobs, config.job_cache_entries)
        self.loop = EngineLoop(engine, max_queue=config.max_queue, max_queued_tokens=config.max_queued_tokens,
                               side_work=self.jobs)
        self.jobs.attach(self.loop.wake)
        self.workers = ProcessBudget(config.max_worker_processes)  # the parallelism widgets' processes
        self.loop.start()
        self.info = self.loop.info()
        self._count_lock = threading.Lock()
        self._by_address: Counter[str] = Counter()
        self.num_connections = 0
        self.stopping = threading.Event()  # set on SIGTERM: connections end, requests are aborted

    @property
    def engine(self) -> LLMEngine:
        """For validation and tokenizing only (thread-safe parts); state is read via the loop."""
        return self.loop.engine

    def open_connection(self, address: str, per_address: bool = True) -> str | None:
        """Count a new websocket in; None if it may stay, else why not (it is then closed).
        per_address False: a room's student, who counts against the room's seats instead
        (a classroom shares one address)."""
        c = self.config
        with self._count_lock:
            if self.stopping.is_set():
                return "the server is shutting down"
            if self.num_connections >= c.max_connections:
                return (f"the server already has {c.max_connections} connections (max_connections); "
                        "try again shortly")
            if per_address and self._by_address[address] >= c.max_connections_per_address:
                return (f"{c.max_connections_per_address} connections are already open from your address "
                        "(max_connections_per_address); close some tabs")
            self.num_connections += 1
            self._by_address[address] += 1
        return None

    def close_connection(self, address: str) -> None:
        with self._count_lock:
            self.num_connections -= 1
            self._by_address[address] -= 1
            if self._by_address[address] <= 0:
                del self._by_address[address]

    def begin_shutdown(self) -> None:
        """Refuse new connections; the open ones abort their requests, say goodbye and end."""
        self.stopping.set()

    def hello(self) -> dict:
        """What a client is told when it connects: the model's facts and the limits it must keep."""
        from .widgets import MESSAGE_TYPES

        c = self.config
        return {**self.info, "model": c.model,
                "job_types": sorted(t for t, m in MESSAGE_TYPES.items() if m.job),
                "request_types": sorted(t for t, m in MESSAGE_TYPES.items() if m.request), "limits": {
            "max_tokens_limit": c.max_tokens_limit, "default_max_tokens": c.default_max_tokens,
            "max_samples": c.max_samples,
            "max_inspect_tokens": c.max_inspect_tokens, "max_messages": c.max_messages,
            "max_message_bytes": c.max_message_bytes,
            "max_requests_per_connection": c.max_requests_per_connection,
            "max_jobs_per_connection": c.max_jobs_per_connection,
            "max_messages_per_second": c.max_messages_per_second, "idle_timeout_s": c.idle_timeout_s,
        }}

    def facts(self) -> dict:
        """Model facts for the page's prose and templates."""
        return {**self.info, "model": self.config.model, "max_inspect_tokens": self.config.max_inspect_tokens}

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.jobs.close()   # after the loop: ends every job, and any worker processes with it


def init_app(app: Flask, loaded=None) -> Runtime:
    runtime = Runtime(app.config["SENDLENS"], loaded)
    app.extensions["sendlens"] = runtime
    atexit.register(runtime.shutdown)
    return runtime


def get_runtime() -> Runtime:
    return current_app.extensions["sendlens"]
