"""The live-data websocket (/ws): one Connection per browser, all feeding the one engine.

Each connection has a reader (the request thread: receives, validates, submits) and a writer
thread that owns every send, so engine outputs, replies and errors never interleave on the wire.
The engine loop's thread only puts outputs in the connection's outbox; it never waits on a
browser. When a browser goes away, its requests are aborted and their KV blocks freed.
"""

import json
import logging
import queue
import threading

from flask import Blueprint
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from core import probes
from core.errors import EngineOverloaded, InvalidParameter

from . import protocol
from .protocol import ProtocolError
from .runtime import Runtime, get_runtime

log = logging.getLogger(__name__)

bp = Blueprint("live", __name__)
sock = Sock()


@sock.route("/ws", bp=bp)
def websocket(ws):
    runtime = get_runtime()
    if not runtime.open_connection():
        ws.send(json.dumps(ProtocolError(
            "overloaded", f"the server already has {runtime.config.max_connections} connections "
                          "(max_connections); try again shortly", "connections").as_message()))
        return
    try:
        Connection(ws, runtime).serve()
    finally:
        runtime.close_connection()


class Connection:
    def __init__(self, ws, runtime: Runtime):
        self.ws = ws
        self.runtime = runtime
        self.config = runtime.config
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.inflight: dict[object, str] = {}  # client id -> engine request id
        self.jobs = 0                          # looking-inside jobs in flight
        self.lock = threading.Lock()
        self.writer = threading.Thread(target=self._write, name="sendlens-ws-writer", daemon=True)

    # -- reading (the request thread) --------------------------------------------------------
    def serve(self) -> None:
        self.writer.start()
        self.outbox.put({"type": "hello", "protocol": protocol.PROTOCOL_VERSION, **self.runtime.model_info()})
        try:
            while True:
                raw = self.ws.receive()
                if raw is None:
                    continue
                msg = None
                try:
                    msg = protocol.parse(raw, self.config)
                    self.handle(msg)
                except ProtocolError as exc:
                    self.outbox.put(exc.as_message())
                except Exception:  # a bug answers this message, not the whole connection
                    log.exception("handling a websocket message failed")
                    self.outbox.put(ProtocolError("internal_error", "the server failed to handle this message",
                                                  None, msg.get("id") if msg else None).as_message())
        except ConnectionClosed:
            pass
        finally:
            with self.lock:
                leftover = list(self.inflight.values())
                self.inflight.clear()
            for request_id in leftover:
                self.runtime.loop.abort(request_id)
            self.outbox.put(None)
            self.writer.join(timeout=5)

    def handle(self, msg: dict) -> None:
        mid = msg["id"]
        try:
            getattr(self, "on_" + msg["type"])(mid, msg)
        except ProtocolError as exc:
            exc.id = mid
            raise
        except (InvalidParameter, EngineOverloaded) as exc:
            raise ProtocolError.from_exception(exc, mid) from None

    def on_generate(self, mid, msg) -> None:
        with self.lock:
            if mid in self.inflight:
                raise ProtocolError("invalid_request", f"a request with id {mid!r} is still running", "id")
            if len(self.inflight) >= self.config.max_requests_per_connection:
                raise ProtocolError("overloaded", f"{self.config.max_requests_per_connection} requests are already "
                                                  "running on this connection (max_requests_per_connection)",
                                    "connection")
        prompt, messages = protocol.generate_prompt(msg, self.config)
        params = protocol.sampling_params(msg, self.config)
        engine = self.runtime.engine
        if messages is not None:
            prompt = engine.tokenizer.apply_chat_template(messages)
        seq = self.runtime.loop.prepare(prompt, params)
        with self.lock:
            self.inflight[mid] = seq.request_id
        self.outbox.put({"type": "accepted", "id": mid, "prompt_tokens": seq.num_prompt_tokens,
                         "max_tokens": params.max_tokens, "context_window": engine.max_model_len})
        self.runtime.loop.enqueue(seq, lambda out: self.outbox.put(("output", mid, out)))

    def on_abort(self, mid, msg) -> None:
        with self.lock:
            request_id = self.inflight.get(mid)
        if request_id is None:
            raise ProtocolError("invalid_request", f"no running request has id {mid!r}", "id")
        self.runtime.loop.abort(request_id)

    def on_attention(self, mid, msg) -> None:
        for name in ("text", "layer", "head"):
            if name not in msg:
                raise ProtocolError("invalid_request", f"{name} is required", name)
        limit = self.config.max_inspect_tokens
        self._job(mid, lambda engine: _attention(engine, msg["text"], msg["layer"], msg["head"], limit),
                  lambda r: {"type": "attention", "id": mid, "layer": msg["layer"], "head": msg["head"], **r})

    def on_template(self, mid, msg) -> None:
        messages = protocol.chat_messages(msg, self.config)
        engine = self.runtime.engine
        rendered = engine.tokenizer.render_chat(messages)
        self.outbox.put(protocol.template_message(mid, rendered, engine.max_model_len))

    def _job(self, mid, fn, shape) -> None:
        """Run fn(engine) on the engine's thread (one job per step) and reply with shape(result)."""
        with self.lock:
            if self.jobs >= self.config.max_jobs_per_connection:
                raise ProtocolError("overloaded", f"{self.config.max_jobs_per_connection} requests to look inside "
                                                  "the model are already running on this connection "
                                                  "(max_jobs_per_connection)", "connection")
            self.jobs += 1
        self.runtime.loop.call(fn).add_done_callback(lambda f: self._reply(mid, f, shape))

    def _reply(self, mid, future, shape) -> None:
        with self.lock:
            self.jobs -= 1
        exc = future.exception()
        if exc is None:
            self.outbox.put(shape(future.result()))
        elif hasattr(exc, "code"):
            self.outbox.put(ProtocolError.from_exception(exc, mid).as_message())
        else:
            log.error("job for %r failed", mid, exc_info=exc)
            self.outbox.put(ProtocolError("internal_error", "the server failed to compute this", None, mid).as_message())

    # -- writing (the writer thread) ---------------------------------------------------------
    def _write(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            try:
                for message in self._messages(item):
                    self.ws.send(json.dumps(message))
            except ConnectionClosed:
                return
            except Exception:  # never leave a silent connection: close it, the reader then ends
                log.exception("websocket send failed; closing the connection")
                try:
                    self.ws.close()
                except Exception:
                    pass
                return

    def _messages(self, item) -> list[dict]:
        if not isinstance(item, tuple):
            return [item]
        _, mid, out = item
        if out.finished:
            with self.lock:
                self.inflight.pop(mid, None)
        messages = []
        if out.new_token_ids:
            messages.append(protocol.token_message(mid, out))
        if out.error:
            messages.append(ProtocolError("internal_error", out.error, None, mid).as_message())
        elif out.finished:
            messages.append(protocol.done_message(mid, out, self.runtime.engine.tokenizer))
        return messages


def _attention(engine, text, layer, head, limit):  # temporary: moves to app/widgets/attention.py
    cfg = engine.model_config
    probes.check_index("layer", layer, cfg.num_layers)
    probes.check_index("head", head, cfg.num_heads)
    if not isinstance(text, str) or not text:
        raise InvalidParameter("text", "must be a non-empty string")
    ids = engine.tokenizer.encode(text)
    if len(ids) > limit:
        raise InvalidParameter("text", f"is {len(ids)} tokens; the most this view takes is {limit}")
    rec = [r for r in probes.layers(engine.model, ids, {layer}) if r.layer == layer][0]
    return {"token_ids": ids, "tokens": engine.tokenizer.token_texts(ids),
            "weights": [[round(w, 6) for w in row] for row in rec.attention[head].tolist()],
            "kv_head": head // (cfg.num_heads // cfg.num_kv_heads)}
