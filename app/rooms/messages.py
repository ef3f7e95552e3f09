"""The rooms' websocket messages, dispatched by app/live.py beside the widgets' own.

- `room_watch` {room}: a presenter (the handshake's presenter cookie for that room) or a member
  (its student cookie) is sent `room_update`s with this message's id, at most ten a second,
  while something changes (updates.py; the registry's ticker sends them).
- `room_unwatch` {room?}: stops them (one room, or every room this connection watches).
- `room_control` {room, action, settings?, prompt?}: the teacher's controls, presenter only
  (else `not_presenter`, param `action`): pause, resume, settings (any subset, each checked by
  name), send_all (every member's seat sends `prompt` at once, as that student), clear. Answered
  with `room_control_ok` {action, settings}; every watcher sees the change in its next update.

A member's `generate` (app/widgets/chat.py) runs on its room's engine: start_request below is
what the connection calls instead of the serving engine's queue (and `ready` first, for a prompt
long enough to be tokenized by a job: app/prompt_job.py).
"""

from core.engine.sampling_params import SamplingParams
from core.errors import InvalidParameter

from ..budget import request_cost
from ..widgets.base import message
from . import codes
from .errors import RoomError, not_found
from .settings import updated

ACTIONS = ("pause", "resume", "settings", "send_all", "clear")
PRESENTER_COOKIE = "sendlens_presenter_{}"
STUDENT_COOKIE = "sendlens_student_{}"


def room_of(call, param: str = "room"):
    registry = call.conn.rooms
    if registry is None:
        raise not_found(param)
    return registry.get(call.msg.get(param))


def is_presenter(conn, room) -> bool:
    return codes.same_secret(conn.cookies.get(PRESENTER_COOKIE.format(room.code)), room.presenter_key)


def watch(call) -> None:
    room = room_of(call)
    student = room.member(call.conn.cookies.get(STUDENT_COOKIE.format(room.code)))
    if student is None and not is_presenter(call.conn, room):
        raise not_found()                     # a stranger learns nothing about the room
    call.conn.rooms.watch(room, call.conn, call.id)


def unwatch(call) -> None:
    call.conn.rooms and call.conn.rooms.unwatch(call.conn)
    call.reply({})


def control(call) -> None:
    msg = call.msg
    room = room_of(call)
    action = msg.get("action")
    if not is_presenter(call.conn, room):
        raise RoomError("not_presenter", "action", "only the room's presenter may use its controls")
    if action not in ACTIONS:
        raise InvalidParameter("action", f"must be one of {list(ACTIONS)}, got {action!r}")
    limit = call.config.max_tokens_limit
    extra = {}
    if action in ("pause", "resume"):
        room.apply(updated(room.settings, {"paused": action == "pause"}, limit))
    elif action == "settings":
        room.apply(updated(room.settings, msg.get("settings"), limit))
    elif action == "send_all":
        extra = send_all(call, room)
    else:
        room.clear()
    call.reply({"action": action, "settings": room.settings.as_dict(), **extra}, type="room_control_ok")


def send_all(call, room) -> dict:
    """Every member sends `prompt` now, as themselves; a member the room's rules hold back is skipped."""
    text = call.msg.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise InvalidParameter("prompt", "must be a non-empty string")
    prompt = call.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    if room.settings.paused:
        raise RoomError("room_paused", "action", "the room is paused; resume it first")
    sent, skipped = [], []
    for name in list(room.members.values()):
        try:
            engine, seq, record = room.prepare(call.runtime.engine, name, prompt, SamplingParams(temperature=0.0))
            room.enqueue(engine, seq, record)
            sent.append(name)
        except InvalidParameter as exc:
            skipped.append({"student": name, "code": exc.code, "message": str(exc)})
    return {"sent": len(sent), "skipped": skipped}


def ready(conn, room, student: str) -> None:
    """Before a member's long prompt is tokenized by a job (app/prompt_job.py): the room's rules
    now, and the room's engine started here, on the reader's thread (building an engine is no
    slice's work on the serving engine's thread, where the request is later prepared)."""
    room.ready(conn.runtime.engine, student)


def start_request(conn, room, student: str, call, prompt, params, format_output, accepted) -> None:
    """A member's generate: the room's rules, then its engine; outputs stream to the connection."""
    engine, seq, record = room.prepare(conn.runtime.engine, student, prompt, params)
    call.charge(request_cost(seq, params))        # priced as any request (app/budget.py)
    in_room = None if accepted is None else (lambda s: {"room": room.code, "request": record.id, **accepted(s)})
    try:
        conn.hold_request(call, seq, in_room, format_output,
                          lambda listener: room.enqueue(engine, seq, record, listener), engine.loop)
    except Exception:
        room.forget(record, engine)
        raise


MESSAGES = (
    message("room_watch", {"room"}, watch),
    message("room_unwatch", {"room"}, unwatch),
    message("room_control", {"room", "action", "settings", "prompt"}, control),
)
