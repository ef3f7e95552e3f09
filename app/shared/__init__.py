"""What the replicas of one deployment share: job results, connection seats and rooms' routes.

One server alone keeps all three in its own memory (today's behaviour, no Redis). Replicas behind
a load balancer (docs/deploy.md) name one Redis with the `redis_url` setting and keep them there:

- `cache` (cache.py): widget results by the job runner's key, a second level under each
  replica's own LRU (app/jobs.py), so a result computed on one replica is served by the others.
- `seats` (seats.py): connections held per seat (a client address, a room) across replicas, so
  `max_connections_per_address` holds for the deployment, not per process; a crashed replica's
  seats come back when its lease runs out (`shared_lease_s`).
- `routes` (routes.py): which replica owns a room's code (the code carries it, app/replicas.py;
  the route makes codes unique across replicas and names the owner).

The pattern is a repository behind a small interface with an in-memory and a Redis
implementation, chosen once when the app starts (`connect`).
"""

from dataclasses import dataclass

from .cache import LocalCache, RedisCache
from .routes import LocalRoutes, RedisRoutes
from .seats import LocalSeats, RedisSeats


@dataclass
class Shared:
    cache: LocalCache | RedisCache
    seats: LocalSeats | RedisSeats
    routes: LocalRoutes | RedisRoutes
    link: object = None        # the RedisLink the three use, or None alone

    def close(self) -> None:
        """The server stops: its lease ends at once, so the others stop counting its seats."""
        self.cache.close()
        if self.link is not None:
            self.link.close()


def connect(config) -> Shared:
    """The shared state `config` names: in memory without `redis_url`, else in that Redis."""
    if not config.redis_url:
        return Shared(LocalCache(), LocalSeats(), LocalRoutes())
    from .redis_link import RedisLink
    link = RedisLink(config.redis_url, config.replica_id or "0", config.shared_lease_s)
    return Shared(RedisCache(link, config.shared_cache_ttl_s), RedisSeats(link), RedisRoutes(link), link)
