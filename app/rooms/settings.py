"""A room's settings: what the teacher's controls set, each checked with a named error.

Four of them shape the room's engine (scheduling, batch slots, prefix caching, chunked prefill):
changing one gives the room a fresh sibling engine for its next requests (room_engine.py). The
rest (paused, max_tokens, one request at a time) are the room's own rules at admission.
"""

from dataclasses import asdict, dataclass, fields

from core.config import Scheduling
from core.errors import InvalidParameter, is_int

MAX_SLOTS = 64          # the most batch slots a teacher may set
ENGINE_FIELDS = ("scheduling", "max_num_seqs", "prefix_caching", "chunked_prefill")


@dataclass(frozen=True)
class RoomSettings:
    paused: bool = False
    scheduling: str = Scheduling.CONTINUOUS.value
    max_num_seqs: int = 16            # batch slots of the room's engine
    max_tokens: int = 64              # every student's requests generate at most this many tokens
    one_at_a_time: bool = True        # a student may have one request in flight
    prefix_caching: bool = True
    chunked_prefill: bool = True

    def as_dict(self) -> dict:
        return asdict(self)

    def engine_settings(self) -> dict:
        """The EngineConfig fields of the room's engine."""
        return {"scheduling": self.scheduling, "max_num_seqs": self.max_num_seqs,
                "enable_prefix_caching": self.prefix_caching, "enable_chunked_prefill": self.chunked_prefill}

    def changes_engine(self, other: "RoomSettings") -> bool:
        return any(getattr(self, f) != getattr(other, f) for f in ENGINE_FIELDS)


def defaults(max_tokens_limit: int) -> RoomSettings:
    return RoomSettings(max_tokens=min(RoomSettings.max_tokens, max_tokens_limit))


def updated(current: RoomSettings, changes, max_tokens_limit: int, param: str = "settings") -> RoomSettings:
    """current with `changes` (any subset of the fields) applied; each value checked by name."""
    if not isinstance(changes, dict):
        raise InvalidParameter(param, "must be an object of room settings")
    known = {f.name for f in fields(RoomSettings)}
    values = current.as_dict()
    for name, value in changes.items():
        if name not in known:
            raise InvalidParameter(name, f"is not a room setting (one of {sorted(known)})")
        if name == "scheduling":
            if value not in [s.value for s in Scheduling]:
                raise InvalidParameter(name, f"must be one of {[s.value for s in Scheduling]}, got {value!r}")
        elif name == "max_num_seqs":
            if not is_int(value) or not 1 <= value <= MAX_SLOTS:
                raise InvalidParameter(name, f"must be an integer from 1 to {MAX_SLOTS}, got {value!r}")
        elif name == "max_tokens":
            if not is_int(value) or not 1 <= value <= max_tokens_limit:
                raise InvalidParameter(name, f"must be an integer from 1 to {max_tokens_limit} "
                                             f"(max_tokens_limit), got {value!r}")
        elif not isinstance(value, bool):
            raise InvalidParameter(name, f"must be true or false, got {value!r}")
        values[name] = value
    return RoomSettings(**values)


def from_stored(values: dict, max_tokens_limit: int) -> RoomSettings:
    """Settings read back from the store (a field it lacks keeps its default)."""
    known = {f.name for f in fields(RoomSettings)}
    return updated(defaults(max_tokens_limit), {k: v for k, v in values.items() if k in known}, max_tokens_limit)
