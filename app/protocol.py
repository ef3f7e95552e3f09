"""The websocket protocol: parse and validate client messages, shape server messages.

Every message is a JSON text frame with a "type" and a client-chosen "id" that each reply
echoes. A bad message is answered with {"type": "error", "id", "code", "message", "param"} and the
connection stays open. docs/protocol.md describes every message; this module is its checker.
"""

import json
from dataclasses import dataclass

from core.errors import InvalidParameter, is_int
from core.tokenizer import validate_messages
from core.outputs import RequestOutput
from core.sampling_params import SamplingParams

from .config import ServerConfig

PROTOCOL_VERSION = 1
MAX_ID_LENGTH = 64

# Fields each client message may carry besides "type" and "id".
FIELDS = {
    "generate": {"messages", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop"},
    "abort": set(),
    "attention": {"text", "layer", "head"},
    "template": {"messages"},
}


@dataclass
class ProtocolError(Exception):
    code: str       # invalid_request, context_length_exceeded, overloaded, internal_error
    message: str
    param: str | None = None
    id: object = None

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    @classmethod
    def from_exception(cls, exc: Exception, id=None) -> "ProtocolError":
        return cls(getattr(exc, "code", "invalid_request"), str(exc), getattr(exc, "param", None), id)

    def as_message(self) -> dict:
        return {"type": "error", "id": self.id, "code": self.code, "message": self.message, "param": self.param}


def parse(raw, config: ServerConfig) -> dict:
    """A text frame -> a message dict with a known type, a valid id and only known fields."""
    if not isinstance(raw, str):
        raise ProtocolError("invalid_request", "messages must be JSON text frames", "message")
    if len(raw.encode("utf-8")) > config.max_message_bytes:
        raise ProtocolError("invalid_request", f"message is larger than {config.max_message_bytes} bytes "
                                               "(max_message_bytes)", "message")
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("invalid_request", f"message is not valid JSON: {exc}", "message") from None
    if not isinstance(msg, dict):
        raise ProtocolError("invalid_request", "message must be a JSON object", "message")
    mid = msg.get("id")
    if not (isinstance(mid, str) and 0 < len(mid) <= MAX_ID_LENGTH) and not is_int(mid):
        raise ProtocolError("invalid_request", f"id must be a string of 1 to {MAX_ID_LENGTH} characters "
                                               "or an integer", "id")  # no usable id: the reply says null
    kind = msg.get("type")
    if kind not in FIELDS:
        raise ProtocolError("invalid_request", f"type must be one of {sorted(FIELDS)}, got {kind!r}", "type", mid)
    extra = set(msg) - FIELDS[kind] - {"type", "id"}
    if extra:
        name = sorted(extra)[0]
        raise ProtocolError("invalid_request", f"{name} is not a field of a {kind} message", name, mid)
    return msg


def chat_messages(msg: dict, config: ServerConfig) -> list[dict]:
    if "messages" not in msg:
        raise InvalidParameter("messages", "is required")
    messages = validate_messages(msg["messages"])
    if len(messages) > config.max_messages:
        raise InvalidParameter("messages", f"has {len(messages)} messages; the most this server takes is "
                                           f"{config.max_messages} (max_messages)")
    return messages


def generate_prompt(msg: dict, config: ServerConfig) -> tuple[str | None, list[dict] | None]:
    """(prompt, messages): exactly one of them is given."""
    has_messages, has_prompt = "messages" in msg, "prompt" in msg
    if has_messages == has_prompt:
        raise InvalidParameter("messages", "give either messages or prompt, not both or neither")
    if has_prompt:
        if not isinstance(msg["prompt"], str) or not msg["prompt"]:
            raise InvalidParameter("prompt", "must be a non-empty string")
        return msg["prompt"], None
    return None, chat_messages(msg, config)


def sampling_params(msg: dict, config: ServerConfig) -> SamplingParams:
    max_tokens = msg.get("max_tokens", config.default_max_tokens)
    if is_int(max_tokens) and max_tokens > config.max_tokens_limit:
        raise InvalidParameter("max_tokens", f"must be at most {config.max_tokens_limit} on this server")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=msg.get("temperature", 0.0),
        top_k=msg.get("top_k", 0),
        top_p=msg.get("top_p", 1.0),
        seed=msg.get("seed"),
        stop=msg.get("stop"),
    )


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def token_message(mid, out: RequestOutput) -> dict:
    index = len(out.token_ids) - 1
    # metrics is the request's live record, which may have moved on: index it, never [-1]
    return {"type": "token", "id": mid, "index": index, "token_id": out.new_token_ids[-1],
            "text": out.new_text, "t_ms": ms(out.metrics.token_times[index] - out.metrics.arrival_time)}


def done_message(mid, out: RequestOutput, tokenizer) -> dict:
    m = out.metrics
    t0 = m.arrival_time
    stop = out.stop_reason
    return {
        "type": "done", "id": mid,
        "finish_reason": out.finish_reason,
        "stop_reason": stop,
        "stop_reason_text": tokenizer.token_texts([stop])[0] if isinstance(stop, int) else stop,
        "num_cached_tokens": out.num_cached_tokens,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "text": out.text,
        "metrics": {"queue_ms": ms(m.queue_s), "ttft_ms": ms(m.ttft_s), "tpot_ms": ms(m.tpot_s),
                    "e2e_ms": ms(m.e2e_s)},
        "timeline": {
            "first_scheduled_ms": ms(m.first_scheduled_time - t0) if m.first_scheduled_time else None,
            "first_token_ms": ms(m.ttft_s),
            "finished_ms": ms(m.e2e_s),
            "steps": [{"step": s.step, "start_ms": ms(s.start_time - t0), "duration_ms": ms(s.duration_s),
                       "kind": s.kind, "num_tokens": s.num_tokens, "batch_seqs": s.batch_seqs,
                       "batch_tokens": s.batch_tokens} for s in m.steps],
        },
    }


def template_message(mid, rendered, context_window: int) -> dict:
    return {
        "type": "template", "id": mid, "text": rendered.text, "num_tokens": len(rendered.token_ids),
        "context_window": context_window,
        "tokens": [{"id": t.id, "text": t.text, "kind": t.kind.value, "role": t.role, "message": t.message}
                   for t in rendered.tokens],
    }
