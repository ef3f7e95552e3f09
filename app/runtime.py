"""The one engine the app owns, started with the app (Flask's init_app pattern).

`init_app` loads the model named by the config, starts an EngineLoop on its own thread with the
job runner as its side work, and keeps both, with the count of open websocket connections, in
`app.extensions["sendlens"]`. Requests from every browser go into this one engine, so they are
batched together. The app reads the engine only through the loop's snapshots (info, stats) and
jobs that run on the loop's thread.
"""

import atexit
import threading

from flask import Flask, current_app

from core.engine import LLMEngine
from core.engine_loop import EngineLoop

from .config import ServerConfig
from .jobs import JobRunner


class Runtime:
    def __init__(self, config: ServerConfig, loaded=None):
        self.config = config
        engine = LLMEngine(config.engine, loaded)
        engine.warmup()
        self.jobs = JobRunner(config.max_queued_jobs, config.job_cache_entries)
        self.loop = EngineLoop(engine, max_queue=config.max_queue, side_work=self.jobs)
        self.jobs.attach(self.loop.wake)
        self.loop.start()
        self.info = self.loop.info()
        self._connections = threading.BoundedSemaphore(config.max_connections)
        self._count_lock = threading.Lock()
        self.num_connections = 0

    @property
    def engine(self) -> LLMEngine:
        """For validation and tokenizing only (thread-safe parts); state is read via the loop."""
        return self.loop.engine

    def open_connection(self) -> bool:
        if not self._connections.acquire(blocking=False):
            return False
        with self._count_lock:
            self.num_connections += 1
        return True

    def close_connection(self) -> None:
        with self._count_lock:
            self.num_connections -= 1
        self._connections.release()

    def hello(self) -> dict:
        """What a client is told when it connects: the model's facts and the limits it must keep."""
        from .widgets import MESSAGE_TYPES

        c = self.config
        return {**self.info, "model": c.model,
                "job_types": sorted(t for t, m in MESSAGE_TYPES.items() if m.job), "limits": {
            "max_tokens_limit": c.max_tokens_limit, "default_max_tokens": c.default_max_tokens,
            "max_inspect_tokens": c.max_inspect_tokens, "max_messages": c.max_messages,
            "max_message_bytes": c.max_message_bytes,
            "max_requests_per_connection": c.max_requests_per_connection,
            "max_jobs_per_connection": c.max_jobs_per_connection,
        }}

    def facts(self) -> dict:
        """Model facts for the page's prose and templates."""
        return {**self.info, "model": self.config.model, "max_inspect_tokens": self.config.max_inspect_tokens}

    def shutdown(self) -> None:
        self.loop.shutdown()


def init_app(app: Flask, loaded=None) -> Runtime:
    runtime = Runtime(app.config["SENDLENS"], loaded)
    app.extensions["sendlens"] = runtime
    atexit.register(runtime.shutdown)
    return runtime


def get_runtime() -> Runtime:
    return current_app.extensions["sendlens"]
