"""python -m app: the production server (gunicorn), its settings, and a graceful SIGTERM."""

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from simple_websocket import ConnectionClosed

from app import ROOT
from conftest import WS, free_port, get_json


@pytest.fixture(scope="module")
def served(artifacts_dir):
    """`python -m app --model tiny` in a subprocess, one for the module (starting one is most of
    this file's time); yields (process, port). The SIGTERM test ends it, so it runs last."""
    port = free_port()
    log = open(artifacts_dir / "main-server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--model", "tiny", "--port", str(port),
         "--setting", "max_tokens_limit", "4000", "--setting", "num_kv_blocks", "512"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300      # hang-stopping only: a busy machine starts it slowly
        while True:
            try:
                if get_json(f"http://127.0.0.1:{port}/healthz")["status"] == "ok":
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (artifacts_dir / "main-server.log").read_text()
            time.sleep(0.2)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        log.close()


def test_a_production_server_not_a_development_one(served):
    proc, port = served
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/") as resp:
        assert "Werkzeug" not in resp.headers.get("Server", "")
        assert resp.status == 200
    log = (ROOT / "artifacts" / "main-server.log")
    text = log.read_text() if log.exists() else ""
    assert "development server" not in text.lower()


def test_settings_reach_the_server(served):
    proc, port = served
    ws = WS(f"ws://127.0.0.1:{port}/ws")
    assert ws.hello["limits"]["max_tokens_limit"] == 4000
    ws.close()
    assert get_json(f"http://127.0.0.1:{port}/healthz")["kv"]["total_blocks"] == 512


def test_a_stopped_and_resumed_server_recovers(served):
    """SIGSTOP for three seconds under load (a laptop that slept), then SIGCONT: every stream ends."""
    proc, port = served
    clients = [WS(f"ws://127.0.0.1:{port}/ws") for _ in range(3)]
    started = []
    for ws in clients:
        mid = ws.start(prompt="Once upon a time", max_tokens=300)
        started.append((ws, mid, ws.accepted(mid)))
    proc.send_signal(signal.SIGSTOP)
    time.sleep(3)
    proc.send_signal(signal.SIGCONT)
    for ws, mid, acc in started:
        stream = ws.finish(mid, accepted=acc)
        assert stream.done is not None and stream.done["completion_tokens"] >= 1
        ws.close()
    deadline = time.monotonic() + 60   # hang-stopping only
    while True:
        h = get_json(f"http://127.0.0.1:{port}/healthz")
        if h["kv"]["free_blocks"] == h["kv"]["total_blocks"] and h["connections"] == 0:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.2)


def test_sigterm_ends_requests_with_abort_and_exits(served):
    proc, port = served
    ws = WS(f"ws://127.0.0.1:{port}/ws")
    mid = ws.start(prompt="Once upon a time", max_tokens=4000)
    acc = ws.accepted(mid)
    assert ws.recv_for(mid)["type"] == "token"
    proc.send_signal(signal.SIGTERM)
    stream = ws.finish(mid, accepted=acc)
    assert stream.done is not None and stream.done["finish_reason"] == "abort"
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.client.receive(1)
    assert closed.value.reason == 1001
    assert proc.wait(30) == 0                # hang-stopping only: the exit code is what is asserted
