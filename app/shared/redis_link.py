"""One replica's link to the deployment's Redis: the client, the key names, and the replica's lease.

A replica process is an *instance*: its `replica_id` and a random suffix, new at every start, so
counts a crashed process left behind are never taken for a restarted one's. The instance holds a
lease key (`sendlens:instance:<id>`, expiring after `shared_lease_s`) that a thread renews three
times per lease; whatever the instance counted in Redis (seats.py) counts only while its lease
lives. That is the heartbeat-lease pattern of failure detectors (Gray & Cheriton's leases, 1989).
"""

import logging
import secrets
import threading

log = logging.getLogger(__name__)

PREFIX = "sendlens:"


def client_for(url: str):
    """A redis-py client that fails fast: short timeouts and one immediate retry (for a pooled
    socket a restarted Redis closed), not the client's default of ten retries with backoff, so a
    Redis that is down costs a reader milliseconds, not seconds (then: a cache miss, local seats)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0, retry=Retry(NoBackoff(), 1))


class RedisLink:
    def __init__(self, url: str, replica_id: str, lease_s: int):
        try:
            import redis
        except ImportError:
            raise RuntimeError("the redis_url setting needs the redis client: pip install 'sendlens[replicas]'") from None
        self.client = client_for(url)
        self.errors = (redis.RedisError, OSError)
        self.instance = f"{replica_id}-{secrets.token_hex(4)}"
        self.lease_s = lease_s
        try:
            self.client.ping()                     # a wrong redis_url fails the start, not the first reader
        except self.errors as exc:
            raise RuntimeError(f"redis_url: Redis does not answer ({exc})") from None
        self._stop = threading.Event()
        self.renew()
        self._thread = threading.Thread(target=self._run, name="sendlens-lease", daemon=True)
        self._thread.start()

    @staticmethod
    def key(kind: str, name: str) -> str:
        return f"{PREFIX}{kind}:{name}"

    @property
    def lease_key(self) -> str:
        return self.key("instance", self.instance)

    def renew(self) -> None:
        self.client.set(self.lease_key, "1", ex=self.lease_s)

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.renew()
            except self.errors as exc:
                log.warning("renewing this replica's lease in Redis failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.client.delete(self.lease_key)     # our seats stop counting at once
        except self.errors:
            pass
        self.client.close()
