"""Rooms' routes: which replica owns a room's code.

A room lives on the replica that made it (its engine, its SQLite); app/replicas.py makes the
code's first symbol name that replica, so the balancer routes `/room/<code>` and the room's
websocket (`/ws?room=<code>`) without asking anyone. The route kept here makes a code unique
across every replica (`claim` fails for a code another has taken) and says who owns a code
(`owner`), for a replica that is asked about a room it does not hold. LocalRoutes is a dict (a
server alone); RedisRoutes keeps `sendlens:room:<code>` -> replica id, set only if absent (SET NX).
"""

import logging
import threading

log = logging.getLogger(__name__)


class LocalRoutes:
    def __init__(self):
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}

    def claim(self, code: str, replica: str) -> bool:
        """Take `code` for `replica`; False if another replica holds it (its own again: True)."""
        with self._lock:
            return self._owner.setdefault(code, replica) == replica

    def owner(self, code: str) -> str | None:
        with self._lock:
            return self._owner.get(code)


class RedisRoutes:
    """Routes in Redis. A Redis that fails lets the claim through: the code's symbol and this
    replica's own store already keep its codes apart from the other replicas' (a teacher can
    still open a room)."""

    def __init__(self, link):
        self.link = link

    def claim(self, code: str, replica: str) -> bool:
        key = self.link.key("room", code)
        try:
            if self.link.client.set(key, replica, nx=True):
                return True
            held = self.link.client.get(key)
        except self.link.errors as exc:
            log.warning("the rooms' routes are unreachable (%s); room %s is not recorded", exc, code)
            return True
        return held is not None and held.decode() == replica

    def owner(self, code: str) -> str | None:
        try:
            held = self.link.client.get(self.link.key("room", code))
        except self.link.errors:
            return None
        return None if held is None else held.decode()
