"""app/shared and app/replicas without servers: a server alone keeps today's behaviour in memory;
the job runner asks a second cache level on a miss and fills it; rooms' codes carry their
replica; deploy/'s nginx files are what the generator writes. (With Redis and nginx running:
tests/test_replicas.py.)"""

from pathlib import Path

import pytest

from app.clients import Seat
from app.config import ServerConfig
from app.jobs import JobRunner
from app.replicas import MAX_REPLICAS, code_symbol, http_block, standalone
from app.rooms import codes
from app.shared import LocalCache, LocalSeats, connect
from app.shared.routes import LocalRoutes
from core.errors import InvalidParameter

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)


class DictCache:
    """A second level in a dict, as Redis would keep it (JSON-like values)."""

    def __init__(self, held=None):
        self.held, self.asked, self.put_keys = dict(held or {}), [], []

    def get(self, key):
        self.asked.append(key)
        return self.held.get(key)

    def put(self, key, result):
        self.put_keys.append(key)
        self.held[key] = result


def work(result):
    def run(engine):
        return result
        yield  # noqa: unreachable - a generator of one slice
    return run


def run_all(runner):
    while runner(None):
        pass


def test_a_server_alone_shares_nothing_outside_its_process():
    shared = connect(ServerConfig(model="tiny"))
    assert isinstance(shared.cache, LocalCache) and isinstance(shared.seats, LocalSeats)
    assert shared.link is None and shared.cache.get("k") is None
    shared.close()


def test_a_miss_asks_the_second_level_and_a_result_fills_it():
    second = DictCache()
    runner, sub = JobRunner(shared=second), Recorder()
    assert runner.submit("A", 1, "k", work({"x": 1}), sub) is False
    run_all(runner)
    assert sub.events[-1].result == {"x": 1} and second.put_keys == ["k"] and second.asked == ["k"]
    again = Recorder()
    assert runner.submit("B", 1, "k", work({"x": 2}), again) is True       # the LRU first: no second ask
    assert second.asked == ["k"] and runner.stats()["cache_hits"] == 1 and runner.stats()["shared_hits"] == 0


def test_a_result_another_replica_computed_is_served_without_running():
    runner, sub = JobRunner(shared=DictCache({"k": {"x": 7}})), Recorder()
    assert runner.submit("A", 1, "k", work({"x": 0}), sub) is True
    assert sub.events[0].result == {"x": 7}
    stats = runner.stats()
    assert stats["shared_hits"] == 1 and stats["completed"] == 0 and stats["cached"] == 1
    assert runner.submit("B", 1, "k", work({"x": 0}), Recorder()) is True    # now from the LRU
    assert runner.stats()["cache_hits"] == 1 and runner.stats()["shared_hits"] == 1


def test_uncached_work_and_errors_never_reach_the_second_level():
    second = DictCache()
    runner = JobRunner(shared=second)
    runner.submit("A", 1, "u", work({"x": 1}), Recorder(), cache=False)

    def failing(engine):
        raise InvalidParameter("text", "no")
        yield  # noqa: unreachable
    runner.submit("A", 2, "e", failing, Recorder())
    run_all(runner)
    assert second.asked == ["e"] and second.put_keys == []


def test_a_job_running_here_gets_a_subscriber_not_a_second_level_ask():
    second = DictCache()
    runner = JobRunner(shared=second)
    runner.submit("A", 1, "k", work({"x": 1}), Recorder())
    runner.submit("B", 1, "k", work({"x": 1}), Recorder())
    assert second.asked == ["k"]


def test_local_seats_keep_each_seats_limit():
    seats, seat = LocalSeats(), Seat("address:192.0.2.1", 2, "max_connections_per_address")
    assert seats.acquire(seat) and seats.acquire(seat) and not seats.acquire(seat)
    seats.release(seat)
    assert seats.held(seat) == 1 and seats.acquire(seat)


def test_a_route_is_claimed_once():
    routes = LocalRoutes()
    assert routes.claim("2ABCDEFG", "1") and routes.claim("2ABCDEFG", "1")
    assert not routes.claim("2ABCDEFG", "2") and routes.owner("2ABCDEFG") == "1"


def test_a_replicas_codes_start_with_its_symbol():
    assert code_symbol("") == "" and code_symbol("1") == "2" and code_symbol(str(MAX_REPLICAS)) == "Z"
    made = {codes.new_code(code_symbol("3")) for _ in range(200)}
    assert all(c[0] == "4" and codes.normalize_code(c) == c for c in made) and len(made) == 200


@pytest.mark.parametrize("value", ["0", "32", "a", "1 ", "01x"])
def test_a_bad_replica_id_names_itself(value):
    with pytest.raises(InvalidParameter, match="replica_id"):
        ServerConfig(model="tiny", replica_id=value)


@pytest.mark.parametrize("value", ["localhost:6379", "http://x", "redis://"])
def test_a_bad_redis_url_names_itself(value):
    with pytest.raises(InvalidParameter, match="redis_url"):
        ServerConfig(model="tiny", redis_url=value)


def test_the_nginx_config_routes_each_replicas_symbol_to_its_upstream():
    text = http_block("8080", {"1": "127.0.0.1:8001", "2": "10.0.0.2:8000"})
    assert '"~^2" sendlens_1;' in text and '"~^3" sendlens_2;' in text
    assert "least_conn;" in text and "proxy_set_header Upgrade $http_upgrade;" in text
    assert "X-Forwarded-For $proxy_add_x_forwarded_for" in text
    assert "daemon off;" in standalone("127.0.0.1:1", {"1": "127.0.0.1:2"}, "/tmp/x")
    with pytest.raises(InvalidParameter, match="replicas"):
        http_block("80", {"1": "no port"})


def test_deploy_holds_what_the_generator_writes():
    assert (ROOT / "deploy/nginx-sendlens.conf").read_text() == http_block(
        "80", {"1": "127.0.0.1:8001", "2": "127.0.0.1:8002"})
    assert (ROOT / "deploy/nginx-compose.conf").read_text() == http_block(
        "80", {"1": "replica1:8000", "2": "replica2:8000"})


def test_an_unreachable_redis_stops_the_start_without_naming_its_url():
    from app.shared.redis_link import RedisLink
    with pytest.raises(RuntimeError, match="redis_url: Redis does not answer") as raised:
        RedisLink("redis://:secret@127.0.0.1:1/0", "1", 15)
    assert "secret" not in str(raised.value)


def test_a_redis_that_fails_later_is_a_miss_and_seats_count_on_this_replica(caplog):
    import redis

    from app.shared.cache import RedisCache
    from app.shared.redis_link import client_for
    from app.shared.routes import RedisRoutes
    from app.shared.seats import RedisSeats

    class DeadLink:            # what RedisLink holds, on a port nobody listens on
        client = client_for("redis://127.0.0.1:1/0")
        errors = (redis.RedisError, OSError)
        instance, lease_s = "1-test", 15

        @staticmethod
        def key(kind, name):
            return f"sendlens:{kind}:{name}"
    cache = RedisCache(DeadLink, 60)
    assert cache.get("k") is None
    cache.put("k", {"x": 1})
    cache.flush()
    cache.close()
    seats, seat = RedisSeats(DeadLink), Seat("address:192.0.2.9", 1, "max_connections_per_address")
    assert seats.acquire(seat) and not seats.acquire(seat)
    seats.release(seat)
    assert seats.acquire(seat)
    assert RedisRoutes(DeadLink).claim("2ABCDEFG", "1") and RedisRoutes(DeadLink).owner("2ABCDEFG") is None
    assert any("unreachable" in r.message for r in caplog.records)
