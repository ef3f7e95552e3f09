"""Rooms' routes: which replica owns a room's code.

A room lives on the replica that made it (its engine, its SQLite); app/replicas.py makes the
code's first symbol name that replica, so the balancer routes `/room/<code>` and the room's
websocket (`/ws?room=<code>`) without asking anyone. The route kept here makes a code unique
across every replica (`claim` fails for a code another has taken) and says who owns a code
(`owner`), for a replica that is asked about a room it does not hold. LocalRoutes is a dict (a
server alone); RedisRoutes keeps `sendlens:room:<code>` -> replica id, set only if absent (SET NX).
"""

import threading


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
    def __init__(self, link):
        self.link = link

    def claim(self, code: str, replica: str) -> bool:
        key = self.link.key("room", code)
        if self.link.client.set(key, replica, nx=True):
            return True
        held = self.link.client.get(key)
        return held is not None and held.decode() == replica

    def owner(self, code: str) -> str | None:
        held = self.link.client.get(self.link.key("room", code))
        return None if held is None else held.decode()
