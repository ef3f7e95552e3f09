"""The one engine the app owns, started with the app (Flask's init_app pattern).

`init_app` loads the model named by the config, starts an EngineLoop on its own thread and keeps
it, with the count of open websocket connections, in `app.extensions["sendlens"]`. Requests from
every browser go into this one engine, so they are batched together.
"""

import atexit
import threading

from flask import Flask, current_app

from core.engine import LLMEngine
from core.engine_loop import EngineLoop

from .config import ServerConfig


class Runtime:
    def __init__(self, config: ServerConfig, loaded=None):
        self.config = config
        self.engine = LLMEngine(config.engine, loaded)
        self.engine.warmup()
        self.loop = EngineLoop(self.engine, max_queue=config.max_queue).start()
        self._connections = threading.BoundedSemaphore(config.max_connections)
        self._count_lock = threading.Lock()
        self.num_connections = 0

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

    def model_info(self) -> dict:
        mc = self.engine.model_config
        return {
            "model": self.config.model,
            "model_source": self.engine.model_source,
            "context_window": self.engine.max_model_len,
            "num_layers": mc.num_layers,
            "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "hidden_size": mc.hidden_size,
            "vocab_size": mc.vocab_size,
            "block_size": self.engine.config.block_size,
            "max_tokens_limit": self.config.max_tokens_limit,
            "default_max_tokens": self.config.default_max_tokens,
            "max_inspect_tokens": self.config.max_inspect_tokens,
            "max_messages": self.config.max_messages,
        }

    def shutdown(self) -> None:
        self.loop.shutdown()


def init_app(app: Flask, loaded=None) -> Runtime:
    runtime = Runtime(app.config["SENDLENS"], loaded)
    app.extensions["sendlens"] = runtime
    atexit.register(runtime.shutdown)
    return runtime


def get_runtime() -> Runtime:
    return current_app.extensions["sendlens"]
