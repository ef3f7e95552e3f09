"""bench/load.py: the load command against a live server (tiny model), briefly."""

import pytest

from bench import load
from conftest import healthz, wait_for


def test_a_short_classroom_loses_nothing(live_server):
    report = load.run(live_server.ws, clients=3, seconds=2, max_tokens=8, drop=False)
    assert report["sent"] >= 3 and report["lost"] == 0
    assert report["completed"] + sum(report["errors"].values()) == report["sent"]
    assert set(report["errors"]) <= {"overloaded"}
    assert report["output_tokens_per_s"] > 0 and report["ttft_ms"]["p50"] > 0
    after, before = report["server_after"], report["server_before"]
    assert after["kv"]["free_blocks"] == before["kv"]["free_blocks"] == before["kv"]["total_blocks"]
    assert after["connections"] == 0 and after["process"]["threads"] >= 1


def test_clients_that_drop_mid_answer_leave_no_blocks(live_server):
    report = load.run(live_server.ws, clients=3, seconds=1, max_tokens=32, drop=True)
    assert report["dropped"] >= 1
    after = report["server_after"]
    assert after["kv"]["free_blocks"] == after["kv"]["total_blocks"] and after["running"] == 0


@pytest.mark.parametrize("kind", ["template", "stop", "attention", "generate"])
def test_a_neighbour_flood_is_measured_beside_the_bystanders(live_server, kind):
    """A smoke run with small numbers: both runs complete every bystander request, the flooder
    sent its messages and was answered. The TPOT ratio is reported, never asserted on."""
    from bench.neighbour import run_neighbour
    report = run_neighbour(live_server.ws, kind, clients=1, seconds=1.5, max_tokens=8)
    for phase in ("alone", "beside"):
        r = report[phase]
        assert r["lost"] == 0 and r["completed"] >= 1
        assert r["completed"] + sum(r["errors"].values()) == r["sent"]
    assert report["flooder"]["sent"] >= 1
    answered = {k: v for k, v in report["flooder"].items() if k != "sent"}
    assert sum(answered.values()) >= 1, report["flooder"]                     # served or refused
    assert set(answered) <= {"template", "done", "attention", "overloaded"}, report["flooder"]   # no bad message
    assert set(report["tpot_p50_ms"]) == {"alone", "beside"}
    wait_for(lambda: healthz(live_server)["connections"] == 0, timeout=30, what="the flooder to leave")


@pytest.mark.parametrize("argv", [["--neighbour", "nothing"]])
def test_the_neighbour_must_be_a_known_type(argv):
    with pytest.raises(SystemExit) as exit_:
        load.main(argv)
    assert exit_.value.code == 2


@pytest.mark.parametrize("argv", [["--url", "ws://10.0.0.1:8000/ws"], ["--clients", "0"], ["--seconds", "9999"]])
def test_the_command_stays_on_this_machine_and_bounded(argv):
    with pytest.raises(SystemExit) as exit_:
        load.main(argv)
    assert exit_.value.code == 2
