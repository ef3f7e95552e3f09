"""bench/load.py: the load command against a live server (tiny model), briefly."""

import pytest

from bench import load


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


@pytest.mark.parametrize("argv", [["--url", "ws://10.0.0.1:8000/ws"], ["--clients", "0"], ["--seconds", "9999"]])
def test_the_command_stays_on_this_machine_and_bounded(argv):
    with pytest.raises(SystemExit) as exit_:
        load.main(argv)
    assert exit_.value.code == 2
