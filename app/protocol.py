"""The websocket protocol: parse and validate client messages, shape server messages.

Every message is a JSON text frame with a "type" and a client-chosen "id" that each reply
echoes. A bad message is answered with {"type": "error", "id", "code", "message", "param"} and the
connection stays open. This module checks the envelope only; each widget checks its own fields
(app/widgets). docs/protocol.md describes every message.
"""

import json
from dataclasses import dataclass

from core.errors import is_int

from .config import ServerConfig

PROTOCOL_VERSION = 1
MAX_ID_LENGTH = 64

TRANSPORT_FIELDS = {"abort": frozenset()}  # the transport's own messages; widgets register the rest


@dataclass
class ProtocolError(Exception):
    code: str       # invalid_request, context_length_exceeded, overloaded, aborted, internal_error
    message: str
    param: str | None = None
    id: object = None
    retry_after_s: float | None = None   # overloaded by a rate or budget: when a retry can succeed

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    @classmethod
    def from_exception(cls, exc: Exception, id=None) -> "ProtocolError":
        return cls(getattr(exc, "code", "invalid_request"), str(exc), getattr(exc, "param", None), id)

    def as_message(self) -> dict:
        msg = {"type": "error", "id": self.id, "code": self.code, "message": self.message, "param": self.param}
        if self.retry_after_s is not None:
            msg["retry_after_s"] = self.retry_after_s
        return msg


def error_reply(id, exc: Exception) -> dict:
    """The error message answering `id` for an exception raised off the reader's thread (in a
    job): its code, message and param if it has them (a ProtocolError, core.errors), else
    internal_error (a bug, which the server logs; its text stays on the server)."""
    if isinstance(exc, ProtocolError):
        return ProtocolError(exc.code, exc.message, exc.param, id, exc.retry_after_s).as_message()
    if hasattr(exc, "code"):
        return ProtocolError.from_exception(exc, id).as_message()
    return ProtocolError("internal_error", "the server failed to compute this", None, id).as_message()


def parse(raw, config: ServerConfig, types: dict) -> dict:
    """A text frame -> a message dict with a known type, a valid id and only known fields.
    types: message type -> its registration (with .fields), from app.widgets."""
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
    known = sorted([*TRANSPORT_FIELDS, *types])
    if not isinstance(kind, str) or kind not in known:
        raise ProtocolError("invalid_request", f"type must be one of {known}, got {kind!r}", "type", mid)
    fields = TRANSPORT_FIELDS[kind] if kind in TRANSPORT_FIELDS else types[kind].fields
    extra = set(msg) - fields - {"type", "id"}
    if extra:
        name = sorted(extra)[0]
        raise ProtocolError("invalid_request", f"{name} is not a field of a {kind} message", name, mid)
    for name, value in msg.items():
        problem = _bad_text(value)
        if problem:
            raise ProtocolError("invalid_request", f"{name} contains {problem}", name, mid)
    return msg


def _bad_text(value) -> str | None:
    """Text no tokenizer should see: a lone surrogate (JSON allows "\\ud800", UTF-8 does not) or NUL."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return "a NUL character"
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "a lone surrogate (not valid Unicode text)"
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None
