"""What a widget is on the server: the message types it answers, each with its fields and handler.

A widget module (app/widgets/<name>.py) defines `WIDGET = Widget(name, messages=(...))`. Each
MessageType names the fields a client message of that type may carry (besides "type" and "id")
and a handler `handle(call)`, run on the connection's reader thread. The handler validates the
message (raising core.errors.InvalidParameter with the field's name) and answers through the
Call: at once (`call.reply`), as a job run fairly beside serving (`call.job`), or as an engine
request and the stream of its outputs (`call.submit`, for chat). Connection (app/live.py) only
dispatches. What several widgets share lives in seam.py; a widget never imports another widget.

Message types are snake_case (docs/protocol.md, "Names"). A type renamed to that case stays
accepted under its old name for one release: `alias(old, of=message)` registers the old name with
the same fields and handler; the reply carries the type the client sent.
"""

from dataclasses import dataclass, replace
from typing import Callable

from core.errors import InvalidParameter, is_int


@dataclass(frozen=True)
class MessageType:
    type: str                        # the "type" of the client message
    fields: frozenset[str]           # fields it may carry besides type and id
    handle: Callable[["object"], None]  # handle(call: app.live.Call): validate, then answer
    job: bool = False                # answered through the job runner (counts toward the job limits)
    request: bool = False            # runs an engine request (counts toward max_requests_per_connection)
    alias_of: str | None = None      # an old name: the type it stands for (accepted for one release)

    @property
    def canonical(self) -> str:
        """The type's current name (itself, unless this is an old name kept as an alias)."""
        return self.alias_of or self.type


@dataclass(frozen=True)
class Widget:
    name: str                        # the embed name, /embed/<name>
    messages: tuple[MessageType, ...] = ()


def message(type: str, fields, handle, job: bool = False, request: bool = False) -> MessageType:
    return MessageType(type, frozenset(fields), handle, job, request)


def alias(old: str, of: MessageType) -> MessageType:
    """The old name of a renamed message type: the same fields and handler, accepted for one release."""
    return replace(of, type=old, alias_of=of.type)


# ---- checks shared by the widgets' handlers ----------------------------------------------------

def required(msg: dict, name: str):
    if name not in msg:
        raise InvalidParameter(name, "is required")
    return msg[name]


def integer(msg: dict, name: str, lo: int, hi: int, default=None) -> int:
    value = msg.get(name, default)
    if value is None:
        raise InvalidParameter(name, "is required")
    if not is_int(value) or not lo <= value <= hi:
        raise InvalidParameter(name, f"must be an integer from {lo} to {hi}, got {value!r}")
    return value


def number(msg: dict, name: str, lo: float, hi: float, default=None) -> float:
    value = msg.get(name, default)
    if value is None:
        raise InvalidParameter(name, "is required")
    if not (is_int(value) or isinstance(value, float)) or not lo <= value <= hi:
        raise InvalidParameter(name, f"must be a number from {lo} to {hi}, got {value!r}")
    return float(value)


def text(msg: dict, name: str = "text") -> str:
    value = required(msg, name)
    if not isinstance(value, str) or not value:
        raise InvalidParameter(name, "must be a non-empty string")
    return value


def encode(call, value: str, name: str = "text") -> list[int]:
    """Tokenize a widget's text, bounded by the server's max_inspect_tokens."""
    ids = call.tokenizer.encode(value)
    limit = call.config.max_inspect_tokens
    if not ids:
        raise InvalidParameter(name, "has no tokens")
    if len(ids) > limit:
        raise InvalidParameter(name, f"is {len(ids)} tokens; the most this view takes is {limit} "
                                     "(max_inspect_tokens)")
    return ids


def rounded(values, digits: int = 6) -> list:
    """A tensor or nested list as plain JSON numbers, rounded (replies stay small)."""
    data = values.tolist() if hasattr(values, "tolist") else values
    if isinstance(data, list):
        return [rounded(v, digits) for v in data]
    return round(float(data), digits)
