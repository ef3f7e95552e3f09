"""`room_update` messages: what a watcher has not seen yet, from the room's snapshots.

A watcher remembers the room's `seq` and step count as of its last update. Its first update
(and the first after a clear) is full: every record, the last FULL_STEPS steps, `full: true`.
Later ones carry only the records that changed and the step rows that are new; the settings,
students, waiting queue, KV pool and totals always come whole (they are small).
"""

from .records import RequestState
from .room import FULL_STEPS, Room


class Watcher:
    def __init__(self, conn, mid):
        self.conn, self.id = conn, mid
        self.seq = -1                # the room's seq as of the last update sent (-1: none yet)
        self.steps = 0               # the room's step count as of the last update sent
        self.sent = 0                # updates sent (the presenter's update rate, for bench.load)

    @property
    def gone(self) -> bool:
        return self.conn.closed or self.conn.dropped


def build(room: Room, watcher: Watcher) -> dict | None:
    """The next update for `watcher`, or None if nothing changed since its last."""
    with room.lock:
        if watcher.seq >= room.seq:
            return None
        full = watcher.seq < 0 or watcher.seq < getattr(room, "cleared_at", 0)
        if full:
            records = list(room.records.values())
            steps = list(room.steps)[-FULL_STEPS:]
        else:
            records = [r for r in room.records.values() if r.version > watcher.seq]
            new = min(room.num_steps - watcher.steps, len(room.steps), FULL_STEPS)
            steps = list(room.steps)[len(room.steps) - new:] if new > 0 else []
        watcher.seq, watcher.steps = room.seq, room.num_steps
        engine = room.engine
        kv = engine.kv() if engine is not None else {"used": 0, "total": room.config.room_kv_blocks}
        return {
            "room": room.code, "seq": room.seq, "full": full, "state": room.state.value,
            "settings": room.settings.as_dict(),
            "students": [{"name": n, "kv_blocks": room.kv_by_student.get(n, 0)} for n in room.members.values()],
            "requests": [r.as_dict() for r in records],
            "steps": steps,
            "waiting": [r.id for r in room.records.values() if r.state == RequestState.WAITING],
            "kv": kv,
            "totals": totals(room),
        }


def totals(room: Room) -> dict:
    return {"students": len(room.members), "requests": len(room.records), "engine_steps": room.num_steps,
            "mean_requests_per_step": room.busy_sum / room.num_steps if room.num_steps else 0.0}
