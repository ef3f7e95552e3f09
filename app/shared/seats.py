"""Connections held per seat (app/clients.py: a client address, a room), counted for the deployment.

`acquire(seat)` takes one of the seat's `limit` places, or says False when all are held;
`release(seat)` gives one back. LocalSeats counts in this process (a server alone: today's
behaviour). RedisSeats counts in Redis for every replica together: one hash per seat, one field
per replica instance (its connections there), and a place is taken by a Lua script, atomically,
after it has dropped the fields of instances whose lease has run out (redis_link.py), so a
crashed replica's places come back within `shared_lease_s`. A Redis that fails lets the
connection in on this replica's own count (the limit then holds per replica until it is back):
refusing every reader because the shared store hiccuped would be the worse failure.
"""

import logging
import threading
from collections import Counter

log = logging.getLogger(__name__)

# KEYS[1]: the seat's hash; ARGV: instance, limit, lease key prefix, lease seconds
ACQUIRE = """
local held = redis.call('HGETALL', KEYS[1])
local total = 0
for i = 1, #held, 2 do
  if redis.call('EXISTS', ARGV[3] .. held[i]) == 1 then
    total = total + tonumber(held[i + 1])
  else
    redis.call('HDEL', KEYS[1], held[i])
  end
end
if total >= tonumber(ARGV[2]) then return 0 end
redis.call('SET', ARGV[3] .. ARGV[1], '1', 'EX', tonumber(ARGV[4]))
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
return 1
"""

RELEASE = """
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if n <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return n
"""


class LocalSeats:
    """Seats counted in this process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    def acquire(self, seat) -> bool:
        with self._lock:
            if self._held[seat.key] >= seat.limit:
                return False
            self._held[seat.key] += 1
            return True

    def release(self, seat) -> None:
        with self._lock:
            self._held[seat.key] -= 1
            if self._held[seat.key] <= 0:
                del self._held[seat.key]

    def held(self, seat) -> int:
        with self._lock:
            return self._held[seat.key]


class RedisSeats:
    """Seats counted in Redis, across replicas."""

    def __init__(self, link):
        self.link = link
        self._acquire = link.client.register_script(ACQUIRE)
        self._release = link.client.register_script(RELEASE)
        self._local = LocalSeats()          # places taken while Redis failed: given back here

    def _key(self, seat) -> str:
        return self.link.key("seat", seat.key)

    def acquire(self, seat) -> bool:
        try:
            return bool(self._acquire(keys=[self._key(seat)], args=[
                self.link.instance, seat.limit, self.link.key("instance", ""), self.link.lease_s]))
        except self.link.errors as exc:
            log.warning("the shared seat count is unreachable (%s); counting on this replica only", exc)
            return self._local.acquire(seat)

    def release(self, seat) -> None:
        if self._local.held(seat):
            self._local.release(seat)
            return
        try:
            self._release(keys=[self._key(seat)], args=[self.link.instance])
        except self.link.errors as exc:
            log.warning("giving a seat back in Redis failed (%s); it returns with this replica's lease", exc)

    def held(self, seat) -> int:
        """Places held by live instances, all replicas together (for tests and operators)."""
        counts = self.link.client.hgetall(self._key(seat))
        return sum(int(n) for inst, n in counts.items()
                   if self.link.client.exists(self.link.key("instance", inst.decode())))
