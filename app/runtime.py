"""The one engine the app owns, started with the app (Flask's init_app pattern).

`init_app` loads the model named by the config, starts an EngineLoop on its own thread with the
job runner as its side work, and keeps both, with the count of open websocket connections, in
`app.extensions["sendlens"]`. Requests from every browser go into this one engine, so they are
batched together. What replicas of one deployment share (job results, seats, rooms' routes) is
`shared` (app/shared): this process's memory for a server alone, Redis with `redis_url`. The app reads the engine only through its read-only view (core/engine/view.py):
the loop's snapshots of it (info, stats) and jobs that run on the loop's thread.
"""

import atexit
import threading
from collections import Counter

from flask import Flask, current_app

from core.engine.engine_loop import EngineLoop
from core.engine.llm_engine import LLMEngine
from core.parallel.workers import ProcessBudget

from . import shared
from .budget import template_bytes
from .clients import Seat, address_seat, client_address, parse_networks
from .config import ServerConfig
from .jobs import JobRunner


class Runtime:
    def __init__(self, config: ServerConfig, loaded=None):
        self.config = config
        engine = LLMEngine(config.engine, loaded)
        engine.warmup()
        self.shared = shared.connect(config)
        self.jobs = JobRunner(config.max_queued_jobs, config.job_cache_entries,
                              None if isinstance(self.shared.cache, shared.LocalCache) else self.shared.cache)
        self.loop = EngineLoop(engine, max_queue=config.max_queue, max_queued_tokens=config.max_queued_tokens,
                               side_work=self.jobs)
        self.jobs.attach(self.loop.wake)
        self.workers = ProcessBudget(config.max_worker_processes)  # the parallelism widgets' processes
        self.loop.start()
        self.info = self.loop.info()
        self.template_bytes = template_bytes(engine.view.tokenizer)  # the chat template's own text (app/budget.py)
        self._count_lock = threading.Lock()
        self.num_connections = 0
        # connections cut off, by the setting that cut them (max_outbox_bytes: it stopped reading;
        # ping_interval_s: it missed a ping); read by tests and operators to tell the two apart
        self.cut_offs: Counter[str] = Counter()
        self.proxies = parse_networks(config.trusted_proxies)
        # request -> the Seat its connection counts against; a deployment may install its own
        # (a classroom room's members against the room), see app/clients.py
        self.seat_for = self.address_seat
        self.stopping = threading.Event()  # set on SIGTERM: connections end, requests are aborted

    @property
    def engine(self) -> LLMEngine:
        """For validation and tokenizing only (thread-safe parts); state is read via the loop."""
        return self.loop.engine

    def client_address(self, request) -> str:
        """The client's address: the TCP peer, or what a trusted proxy says (app/clients.py)."""
        return client_address(request.remote_addr, request.headers, self.proxies, self.config.client_address_header)

    def address_seat(self, request) -> Seat:
        """The default seat: the client's address, under max_connections_per_address."""
        return address_seat(self.client_address(request), self.config)

    def open_connection(self, seat: Seat) -> str | None:
        """Count a new websocket in against its seat (the client's address, or a room's seats for
        a room's student: a classroom shares one address); None if it may stay, else why not (it
        is then closed). max_connections counts this process's connections; a seat's limit
        counts the deployment's (app/shared/seats.py: every replica's, with `redis_url`)."""
        c = self.config
        with self._count_lock:
            if self.stopping.is_set():
                return "the server is shutting down"
            if self.num_connections >= c.max_connections:
                return (f"the server already has {c.max_connections} connections (max_connections); "
                        "try again shortly")
            self.num_connections += 1           # held while the seat is asked for (maybe over the network)
        if not self.shared.seats.acquire(seat):
            with self._count_lock:
                self.num_connections -= 1
            where = "your address" if seat.setting == "max_connections_per_address" else seat.key
            return (f"{seat.limit} connections are already open from {where} ({seat.setting}); "
                    "close some tabs")
        return None

    def close_connection(self, seat: Seat) -> None:
        self.shared.seats.release(seat)
        with self._count_lock:
            self.num_connections -= 1

    def count_cut_off(self, setting: str) -> None:
        with self._count_lock:
            self.cut_offs[setting] += 1

    def begin_shutdown(self) -> None:
        """Refuse new connections; the open ones abort their requests, say goodbye and end. The
        engine's requests end at once, each with its `abort` (a connection's reader notices the
        shutdown only at its next look, up to live.POLL_S later)."""
        self.stopping.set()
        self.loop.abort_all()

    def hello(self) -> dict:
        """What a client is told when it connects: the model's facts and the limits it must keep."""
        from .widgets import MESSAGE_TYPES

        c = self.config
        return {**self.info, "model": c.model,
                "job_types": sorted(t for t, m in MESSAGE_TYPES.items() if m.job),
                "request_types": sorted(t for t, m in MESSAGE_TYPES.items() if m.request), "limits": {
            "max_tokens_limit": c.max_tokens_limit, "default_max_tokens": c.default_max_tokens,
            "max_samples": c.max_samples, "max_beam_width": c.max_beam_width,
            "max_inspect_tokens": c.max_inspect_tokens, "max_messages": c.max_messages,
            "max_message_bytes": c.max_message_bytes,
            "max_requests_per_connection": c.max_requests_per_connection,
            "max_jobs_per_connection": c.max_jobs_per_connection,
            "max_messages_per_second": c.max_messages_per_second, "idle_timeout_s": c.idle_timeout_s,
            "work_tokens_per_second": c.work_tokens_per_second, "work_burst_tokens": c.work_burst_tokens,
        }}

    def facts(self) -> dict:
        """Model facts for the page's prose and templates."""
        return {**self.info, "model": self.config.model, "max_inspect_tokens": self.config.max_inspect_tokens}

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.jobs.close()   # after the loop: ends every job, and any worker processes with it
        self.shared.close()


def init_app(app: Flask, loaded=None) -> Runtime:
    runtime = Runtime(app.config["SENDLENS"], loaded)
    app.extensions["sendlens"] = runtime
    atexit.register(runtime.shutdown)
    replica = runtime.config.replica_id
    if replica:
        @app.after_request
        def name_the_replica(resp):      # which replica answered, seen through the balancer
            resp.headers["X-Sendlens-Replica"] = replica
            return resp
    return runtime


def get_runtime() -> Runtime:
    return current_app.extensions["sendlens"]
