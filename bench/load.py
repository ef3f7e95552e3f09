"""A classroom in a box: N websocket clients chatting with a sendlens server for M seconds.

    python -m bench.load --clients 50 --seconds 60            # against http://127.0.0.1:8000
    python -m bench.load --clients 30 --seconds 20 --drop     # ... each dropping its TCP connection mid-answer
    python -m bench.load --clients 40 --seconds 60 --room K7QX2M9A   # 40 students join a room and chat in it
    python -m bench.load --clients 8 --seconds 30 --neighbour template   # ... beside one flooding client
    python -m bench.load --replicas 2 --clients 100 --seconds 60   # 2 replicas behind nginx against 1 server
    python -m bench.load --formats fp32,bf16,q8_0,q4_1   # a server of each weight format, one after the other

Each client sends a chat request, reads the stream to `done`, and sends the next, until the time
is up (then it finishes the answer in flight). Reported, in vLLM's serving-benchmark terms:
requests sent and completed, errors by code, lost requests (no `done` and no error), TTFT and
TPOT p50/p99 as the client saw them, output tokens/s; and from the server's /healthz before and
after: KV free blocks, connections, the process's RSS and threads. With `--room CODE` (a room
opened at /room/new), each client first joins the room over HTTP as a student (its cookie then
rides the websocket handshake, so its requests run on the room's engine), and one more
connection watches the room as the first student does and counts the `room_update`s pushed to
it (the presenter's update rate). Loopback only by default:
`--url` must name this machine (a load test never leaves it). `--neighbour TYPE` runs the
classroom twice, alone and beside one client flooding TYPE (bench/neighbour.py), and reports the
bystanders' median TPOT in each. `--replicas N` starts its own deployments instead of using
`--url`: one server alone, then N replicas sharing Redis behind nginx, and plays the same readers
against each (bench/balancer.py); `--readme` writes that table into README.md. `--formats LIST`
also starts its own servers, one per weight format in turn, and plays the classroom against each
(bench/classroom.py); `--readme` writes that table into README.md beside the stored rows.
"""

import argparse
import http.client
import json
import random
import socket
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import simple_websocket

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MAX_CLIENTS = 200
MAX_SECONDS = 600
QUESTIONS = [
    "What is the capital of France?", "Name three colours.", "Why is the sky blue?",
    "Write a haiku about the sea.", "How many legs does a spider have?", "What is 12 times 12?",
    "Give me a tip for learning to cook.", "Explain what a noun is.", "Tell me a fun fact about cats.",
    "What does a teacher do?",
]


class Client(simple_websocket.Client):
    """simple_websocket's client; its handshake can swallow the server's first frame (our hello)."""

    def handshake(self):
        super().handshake()
        self._handle_events()


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    lost: int = 0
    dropped: int = 0
    output_tokens: int = 0
    errors: dict = field(default_factory=dict)
    ttft: list = field(default_factory=list)
    tpot: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, code: str) -> None:
        with self.lock:
            self.errors[code] = self.errors.get(code, 0) + 1


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def healthz(base: str) -> dict:
    with urllib.request.urlopen(base + "/healthz", timeout=10) as resp:
        return json.load(resp)


def join_room(base: str, code: str, name: str) -> dict:
    """Join a room as a student over HTTP: -> the cookie to send with the websocket handshake."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", f"/room/{code}/join", body=f"display_name={name}",
                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    if resp.status != 303:
        raise RuntimeError(f"joining room {code} as {name} answered {resp.status}")
    cookie = resp.getheader("Set-Cookie").split(";")[0]
    return {"Cookie": cookie}


def watch_room(url: str, code: str, headers: dict, deadline: float, counts: dict) -> None:
    """Count the room_update messages one watcher is sent until the deadline."""
    try:
        ws = Client.connect(url, headers=headers)
        ws.receive(30)                                 # hello
        ws.send(json.dumps({"type": "room_watch", "id": "watch", "room": code}))
        while time.monotonic() < deadline:
            raw = ws.receive(1.0)
            if raw and json.loads(raw).get("type") == "room_update":
                counts["updates"] += 1
        ws.close()
    except Exception:
        counts["failed"] = True


def client_loop(url: str, deadline: float, max_tokens: int, drop: bool, tally: Tally, seed: int,
                headers: dict | None = None) -> None:
    rng = random.Random(seed)
    try:
        ws = Client.connect(url, headers=headers)
    except Exception:
        tally.error("connect_failed")
        return
    try:
        hello = json.loads(ws.receive(30) or "{}")
        if hello.get("type") == "error":
            tally.error(hello.get("code", "error"))
            return
        n = 0
        while time.monotonic() < deadline:
            n += 1
            mid = f"q{n}"
            t0 = time.monotonic()
            ws.send(json.dumps({"type": "generate", "id": mid, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}))
            with tally.lock:
                tally.sent += 1
            first = last = None
            tokens = 0
            while True:
                raw = ws.receive(120)
                if raw is None:
                    with tally.lock:
                        tally.lost += 1
                    return
                msg = json.loads(raw)
                if msg.get("id") != mid:
                    continue
                if msg["type"] == "token":
                    tokens += 1
                    now = time.monotonic()
                    first = now if first is None else first
                    last = now
                    if drop and tokens == 3:       # vanish mid-answer: no close frame, a TCP reset
                        ws.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                        ws.sock.close()
                        with tally.lock:
                            tally.dropped += 1
                        return
                elif msg["type"] == "done":
                    with tally.lock:
                        tally.completed += 1
                        tally.output_tokens += msg["completion_tokens"]
                        if first is not None:
                            tally.ttft.append(first - t0)
                        if tokens > 1:
                            tally.tpot.append((last - first) / (tokens - 1))
                    break
                elif msg["type"] == "error":
                    tally.error(msg.get("code", "error"))
                    if msg.get("code") == "overloaded":
                        time.sleep(1.0)               # the retry hint: back off
                    break
    except simple_websocket.ConnectionClosed:
        with tally.lock:
            tally.lost += 1
    finally:
        try:
            ws.close()
        except Exception:
            pass


def run(url: str, clients: int, seconds: float, max_tokens: int, drop: bool, room: str | None = None,
        settle: bool = True) -> dict:
    """The classroom; `room`: the clients join that room first; `settle`: wait for the server to
    have no connection and no request left before reading /healthz after (off while another
    client, a flooder, is still connected)."""
    parts = urlsplit(url)
    base = f"http://{parts.netloc}"
    before = healthz(base)
    tally = Tally()
    seats = [join_room(base, room, f"student-{i + 1}") for i in range(clients)] if room else [None] * clients
    watched = {"updates": 0, "failed": False}
    deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(url, deadline, max_tokens, drop, tally, i, seats[i]),
                                daemon=True) for i in range(clients)]
    if room:
        threads.append(threading.Thread(target=watch_room, args=(url, room, seats[0], deadline, watched), daemon=True))
    for t in threads:
        t.start()
        time.sleep(0.02)                               # a classroom does not press Send in one microsecond
    for t in threads:
        t.join(seconds + 180)
    wall = time.monotonic() - t0
    if settle:
        time.sleep(2.0)                                # let the server notice closed sockets
    until = time.monotonic() + (30 if settle else 0)
    after = healthz(base)
    while (after["connections"] or after["running"]) and time.monotonic() < until:
        time.sleep(0.5)
        after = healthz(base)
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {
        "url": url, "clients": clients, "seconds": seconds, "max_tokens": max_tokens, "drop": drop, "room": room,
        "room_updates_per_s": round(watched["updates"] / seconds, 2) if room and not watched["failed"] else None,
        "wall_s": round(wall, 1), "sent": tally.sent, "completed": tally.completed, "lost": tally.lost,
        "dropped": tally.dropped, "errors": tally.errors,
        "output_tokens_per_s": round(tally.output_tokens / wall, 1),
        "ttft_ms": {"p50": ms(pct(tally.ttft, 50)), "p99": ms(pct(tally.ttft, 99)),
                    "mean": ms(statistics.fmean(tally.ttft)) if tally.ttft else None},
        "tpot_ms": {"p50": ms(pct(tally.tpot, 50)), "p99": ms(pct(tally.tpot, 99))},
        "server_before": {k: before[k] for k in ("kv", "connections", "running", "process") if k in before},
        "server_after": {k: after[k] for k in ("kv", "connections", "running", "process") if k in after},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="ws://127.0.0.1:8000/ws", help="a sendlens websocket on this machine")
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--drop", action="store_true", help="each client drops its TCP connection mid-answer")
    p.add_argument("--room", help="a room's code: each client joins it as a student and chats in it")
    p.add_argument("--neighbour", choices=("template", "stop", "attention", "generate"),
                   help="also run the classroom beside one client flooding this message type; compare TPOT")
    p.add_argument("--replicas", type=int, help="start 1 server, then this many replicas behind nginx and Redis, "
                                                 "and measure both (bench/balancer.py)")
    p.add_argument("--formats", help="start a server of each of these weight formats in turn (comma-separated, "
                                      "e.g. fp32,bf16,q8_0,q4_1) and measure each (bench/classroom.py)")
    p.add_argument("--model", default="smollm2-135m", help="with --replicas or --formats: the model the servers load")
    p.add_argument("--readme", action="store_true", help="with --replicas or --formats: write the table into README.md")
    p.add_argument("--json", help="also write the report to this file")
    args = p.parse_args(argv)
    if args.replicas is not None:
        return replicas_main(p, args)
    if args.formats is not None:
        return formats_main(p, args)
    host = urlsplit(args.url).hostname
    if host not in LOOPBACK:
        p.error(f"--url must be on this machine ({', '.join(sorted(LOOPBACK))}); got {host!r}")
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.seconds <= MAX_SECONDS:
        p.error(f"--clients must be 1..{MAX_CLIENTS} and --seconds 0..{MAX_SECONDS}")
    if args.neighbour:
        from .neighbour import run_neighbour
        report = run_neighbour(args.url, args.neighbour, args.clients, args.seconds, args.max_tokens)
        print(json.dumps(report, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                f.write(json.dumps(report, indent=2) + "\n")
        print(f"bystanders' median TPOT: {report['tpot_p50_ms']['alone']} ms alone, "
              f"{report['tpot_p50_ms']['beside']} ms beside a {args.neighbour} flood ({report['tpot_ratio']}x)")
        lost = report["alone"]["lost"] + report["beside"]["lost"]
        return 0 if lost == 0 else 1
    report = run(args.url, args.clients, args.seconds, args.max_tokens, args.drop, args.room)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    before, after = report["server_before"], report["server_after"]
    ok = (report["lost"] == 0 and set(report["errors"]) <= {"overloaded"}
          and after["kv"]["free_blocks"] == before["kv"]["free_blocks"] and after["connections"] == 0)
    print("OK: nothing lost, every block back" if ok else "NOT OK: see lost, errors and the KV blocks above")
    return 0 if ok else 1


def formats_main(p, args) -> int:
    from . import classroom
    try:
        formats = classroom.parse_formats(args.formats)
    except ValueError as e:
        p.error(str(e))
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.seconds <= MAX_SECONDS:
        p.error(f"--clients must be 1..{MAX_CLIENTS} and --seconds 0..{MAX_SECONDS}")
    report = classroom.measure(formats, args.clients, args.seconds, args.max_tokens, args.model)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    table = classroom.table(report, time.strftime("%Y-%m-%d"))
    print(table)
    if args.readme:
        classroom.write_readme(table)
    lost = sum(r["lost"] for r in report["formats"].values())
    return 0 if lost == 0 else 1


def replicas_main(p, args) -> int:
    from . import balancer
    from .replicas import missing_binaries
    from app.replicas import MAX_REPLICAS
    if not 2 <= args.replicas <= MAX_REPLICAS:
        p.error(f"--replicas must be 2..{MAX_REPLICAS}")
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.seconds <= MAX_SECONDS:
        p.error(f"--clients must be 1..{MAX_CLIENTS} and --seconds 0..{MAX_SECONDS}")
    if missing_binaries():
        p.error(f"--replicas needs Debian's {' and '.join(missing_binaries())} (apt-get install nginx redis-server)")
    report = balancer.compare(args.replicas, args.clients, args.seconds, args.max_tokens, args.model)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
    text = balancer.table(report)
    print(text)
    if args.readme:
        balancer.write_readme(text)
    lost = sum(r["errors"].get("lost", 0) for r in report["rows"])
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
