"""The second level of the job runner's result cache: results shared by every replica.

The runner (app/jobs.py) keeps its own LRU of results and merges identical jobs in flight; on an
LRU miss it asks this cache (`get`) before running the job, and gives it each result (`put`). A
server alone has nothing to share: LocalCache holds nothing (its LRU is today's whole cache). The
Redis cache keeps each result as JSON under a hash of its key for `shared_cache_ttl_s`; puts go
through a writer thread, so the engine loop's thread, which finishes jobs, never waits on the
network. A Redis that fails is a miss, never an error: the job is computed here instead.
"""

import hashlib
import json
import logging
import queue
import threading

log = logging.getLogger(__name__)

MAX_PENDING_PUTS = 256     # results waiting for the writer; beyond, a put is dropped (a cache may forget)


class LocalCache:
    """One server alone: no second level (the runner's LRU is the cache)."""

    hits = 0

    def get(self, key: str):
        return None

    def put(self, key: str, result) -> None:
        pass

    def close(self) -> None:
        pass


class RedisCache:
    def __init__(self, link, ttl_s: int):
        self.link, self.ttl_s = link, ttl_s
        self.hits = 0
        self._pending: queue.Queue = queue.Queue(MAX_PENDING_PUTS)
        self._thread = threading.Thread(target=self._write, name="sendlens-shared-cache", daemon=True)
        self._thread.start()

    def _key(self, key: str) -> str:
        return self.link.key("job", hashlib.sha256(key.encode()).hexdigest())

    def get(self, key: str):
        """The result another replica (or this one) computed for `key`, or None."""
        try:
            raw = self.link.client.get(self._key(key))
        except self.link.errors as exc:
            log.warning("the shared cache is unreachable (%s); computing here", exc)
            return None
        if raw is None:
            return None
        self.hits += 1
        return json.loads(raw)

    def put(self, key: str, result) -> None:
        """Keep `result` for every replica (later, on the writer thread)."""
        try:
            self._pending.put_nowait((key, result))
        except queue.Full:
            pass

    def flush(self) -> None:
        """Wait until every put so far is written (for tests and shutdown)."""
        self._pending.join()

    def _write(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                key, result = item
                self.link.client.set(self._key(key), json.dumps(result, separators=(",", ":")), ex=self.ttl_s)
            except (TypeError, ValueError) as exc:
                log.warning("a job result is not JSON, not shared: %s", exc)
            except self.link.errors as exc:
                log.warning("writing to the shared cache failed: %s", exc)
            finally:
                self._pending.task_done()

    def close(self) -> None:
        self._pending.put(None)
        self._thread.join(timeout=5)
