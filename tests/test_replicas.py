"""Replicas behind nginx, sharing Redis (issue 28): two `python -m app` replicas, redis-server and
nginx on loopback (conftest's `replicas`, bench/replicas.py). Everything goes through the
balancer; each replica's own /healthz says what it did (counts, never times):

- a job computed on one replica is served from the shared cache on the other;
- the per-address connection limit holds across both replicas together;
- a room's pages and websocket go to the replica its code names;
- a crashed replica's seats come back when its lease runs out (app/shared/seats.py).
"""

import http.client
import json
from urllib.parse import urlsplit

import pytest
from conftest import WS, assert_writes_its_section, wait_for

from app.clients import Seat
from app.replicas import code_symbol

ATTENTION = {"text": "The replicas share what they computed.", "layer": 1, "head": 2}


def no_connections(replicas) -> bool:
    return all(h["connections"] == 0 for h in replicas.health().values())


def connections(replicas) -> dict[str, int]:
    return {rid: h["connections"] for rid, h in replicas.health().items()}


def through(replicas, address: str, query: str = "") -> WS:
    """A websocket through nginx, as a reader at `address` (nginx appends its own peer after it)."""
    return WS(replicas.ws + query, headers={"X-Forwarded-For": address})


def request(replicas, method: str, path: str, cookie: str = "", body: str = "") -> http.client.HTTPResponse:
    parts = urlsplit(replicas.http)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Cookie": cookie} if cookie else {}
    if body:
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    conn.request(method, path, body=body or None, headers=headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp


@pytest.fixture
def quiet(replicas):
    wait_for(lambda: no_connections(replicas), timeout=30, what="earlier connections to close")
    return replicas


def test_the_balancer_spreads_plain_requests_over_both_replicas(quiet):
    answered = [request(quiet, "GET", "/healthz").getheader("X-Sendlens-Replica") for _ in range(4)]
    assert set(answered) == {"1", "2"}


def test_a_job_computed_on_one_replica_is_served_from_the_shared_cache_on_the_other(quiet):
    before = {rid: h["jobs"] for rid, h in quiet.health().items()}
    first = through(quiet, "198.51.100.1")
    try:
        on = connections(quiet)
        computing = next(rid for rid, n in on.items() if n == 1)
        other = next(rid for rid in on if rid != computing)
        reply = first.job("attention", **ATTENTION)
        assert reply["type"] == "attention", reply
        import redis
        store = redis.Redis.from_url(quiet.redis_url)
        wait_for(lambda: store.keys("sendlens:job:*"), what="the result to reach Redis")
        second = through(quiet, "198.51.100.2")     # least_conn: the replica with no connection
        try:
            assert connections(quiet) == {computing: 1, other: 1}
            again = second.job("attention", **ATTENTION)
        finally:
            second.close()
    finally:
        first.close()
    assert {k: v for k, v in again.items() if k != "id"} == {k: v for k, v in reply.items() if k != "id"}
    after = {rid: h["jobs"] for rid, h in quiet.health().items()}
    assert after[computing]["completed"] - before[computing]["completed"] == 1
    assert after[other]["completed"] - before[other]["completed"] == 0
    assert after[other]["shared_hits"] - before[other]["shared_hits"] == 1
    assert after[computing]["shared_hits"] - before[computing]["shared_hits"] == 0


def test_the_per_address_limit_holds_across_both_replicas(quiet):
    limit = 3                                      # conftest's replicas: max_connections_per_address
    held = [through(quiet, "203.0.113.7") for _ in range(limit)]
    try:
        assert all(ws.hello["type"] == "hello" for ws in held)
        on = connections(quiet)
        assert sum(on.values()) == limit and all(n > 0 for n in on.values())   # both replicas hold some
        refused = through(quiet, "203.0.113.7")
        try:
            assert refused.hello["type"] == "error" and refused.hello["code"] == "overloaded"
            assert "max_connections_per_address" in refused.hello["message"]
        finally:
            refused.close()
        elsewhere = through(quiet, "203.0.113.8")     # another address has its own seats
        try:
            assert elsewhere.hello["type"] == "hello"
        finally:
            elsewhere.close()
        held.pop().close()                         # a place given back on one replica ...
        wait_for(lambda: sum(connections(quiet).values()) == limit - 1, what="the closed socket to count out")
        held.append(through(quiet, "203.0.113.7"))
        assert held[-1].hello["type"] == "hello"   # ... is free on whichever replica gets the next
    finally:
        for ws in held:
            ws.close()


def test_a_rooms_pages_and_websocket_go_to_the_replica_its_code_names(quiet):
    created = request(quiet, "GET", "/room/new")
    assert created.status == 303
    code = created.getheader("Location").split("/")[-2]
    owner = next(rid for rid in quiet.replica_urls if code_symbol(rid) == code[0])
    assert created.getheader("X-Sendlens-Replica") == owner
    presenter = created.getheader("Set-Cookie").split(";")[0]
    for _ in range(4):                             # the balancer alone would alternate
        page = request(quiet, "GET", f"/room/{code}/present", cookie=presenter)
        assert page.status == 200 and page.getheader("X-Sendlens-Replica") == owner
    joined = request(quiet, "POST", f"/room/{code}/join", body="display_name=Ada")
    assert joined.status == 303 and joined.getheader("X-Sendlens-Replica") == owner
    student = joined.getheader("Set-Cookie").split(";")[0]
    sockets = [WS(quiet.ws + f"?room={code}", headers={"Cookie": student}) for _ in range(2)]
    try:
        assert all(ws.hello["type"] == "hello" for ws in sockets)
        on = connections(quiet)
        assert on[owner] == 2 and sum(on.values()) == 2
    finally:
        for ws in sockets:
            ws.close()
    import redis
    assert redis.Redis.from_url(quiet.redis_url).get(f"sendlens:room:{code}") == owner.encode()


def test_a_crashed_replicas_seats_come_back_when_its_lease_runs_out(replicas):
    from app.shared.redis_link import RedisLink
    from app.shared.seats import RedisSeats
    seat = Seat("address:192.0.2.1", 2, "max_connections_per_address")
    crashed, alive = (RedisLink(replicas.redis_url, rid, lease_s=60) for rid in ("8", "9"))
    try:
        a, b = RedisSeats(crashed), RedisSeats(alive)
        assert a.acquire(seat) and b.acquire(seat)
        assert not b.acquire(seat) and b.held(seat) == 2
        crashed._stop.set()                        # it stops renewing, and its lease runs out:
        crashed.client.delete(crashed.lease_key)   # (as EXPIRE would, without waiting for it)
        assert b.acquire(seat) and b.held(seat) == 2
        b.release(seat)
        b.release(seat)
        assert b.held(seat) == 0 and not alive.client.exists(alive.key("seat", seat.key))
    finally:
        crashed.close()
        alive.close()


def test_bench_load_measures_through_the_balancer(quiet):
    from bench import balancer
    row = balancer.measure(quiet, clients=4, seconds=2, max_tokens=4)
    assert row["replicas"] == 2 and row["held"] == 4 and row["refused"] == 0
    assert row["jobs"] >= 4 and row["chats"] >= 4 and "lost" not in row["errors"]
    assert row["computed"] >= 1 and row["computed"] == sum(r["completed"] for r in row["per_replica"].values())
    assert row["shared_hits"] == sum(r["shared_hits"] for r in row["per_replica"].values())


def test_the_comparison_table_goes_between_the_replicas_markers(tmp_path):
    from bench import balancer
    rows = [{"deployment": name, "replicas": n, "clients": 10, "held": held, "refused": 10 - held, "jobs_per_s": 1.5,
             "chats_per_s": 1.0, "computed": 3, "cache_hits": 7, "shared_hits": shared, "errors": errors}
            for name, n, held, shared, errors in (("1 server alone", 1, 8, 0, {}),
                                                  ("2 replicas behind nginx, Redis", 2, 10, 4, {"overloaded": 2}))]
    text = balancer.table({"date": "2026-12-04", "clients": 10, "seconds": 5, "model": "tiny", "max_tokens": 8,
                           "rows": rows})
    assert "| 1 server alone | 8 of 10 | 2 | 1.5 | 1.0 | 3 | 7 | 0 | none |" in text
    assert "| 2 replicas behind nginx, Redis | 10 of 10 | 0 | 1.5 | 1.0 | 3 | 7 | 4 | 2 `overloaded` |" in text
    assert_writes_its_section(balancer.write_readme, balancer.BEGIN, balancer.END, text, tmp_path)
