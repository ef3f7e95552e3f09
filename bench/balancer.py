"""The classroom through a balancer: N replicas behind nginx against one server alone, in one run.

    python -m bench.load --replicas 2 --clients 100 --seconds 60 [--model smollm2-135m] [--readme]

Two deployments on loopback, one after the other (bench/replicas.py starts and stops each): one
`python -m app` alone (no Redis, no nginx), then N replicas sharing Redis behind nginx. The same
clients play the same page against each: every client opens one websocket (as a reader at an
address of its own, which nginx passes on in X-Forwarded-For), then, until the time is up,
asks for an `attention` job (one of 60 inputs: a question of bench.load, layer 0 or 1, head 0 to
2; a class clicks the same few things, so most are answered from a cache) and then sends a short
chat. Both deployments allow `MAX_CLIENTS` connections per address, so what holds the readers
back is each process's `max_connections`. Reported for each: connections held (hellos; the rest
were refused), widget jobs and chats completed per second, and the job cache's hits, local and
(replicas) shared through Redis, from each replica's /healthz before and after. `--readme`
writes the table into README.md between the replicas markers.
"""

import json
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import simple_websocket

from .load import MAX_CLIENTS, QUESTIONS, Client
from .replicas import Deployment

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- replicas:begin -->", "<!-- replicas:end -->"


@dataclass
class Counts:
    held: int = 0
    refused: int = 0
    jobs: int = 0
    chats: int = 0
    errors: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)

    def error(self, code: str) -> None:
        with self.lock:
            self.errors[code] = self.errors.get(code, 0) + 1


def _answer(ws, mid: str) -> dict | None:
    """The final reply to `mid` (past tokens and progress), or None if the socket went."""
    while True:
        raw = ws.receive(120)
        if raw is None:
            return None
        msg = json.loads(raw)
        if msg.get("id") == mid and msg["type"] not in ("token", "progress", "accepted"):
            return msg


def reader(url: str, n: int, deadline: float, max_tokens: int, counts: Counts) -> None:
    """One reader: a job, then a chat, until the deadline."""
    rng = random.Random(n)
    try:
        ws = Client.connect(url, headers={"X-Forwarded-For": f"10.{n // 250}.{n % 250}.1"})
    except Exception:
        counts.error("connect_failed")
        return
    try:
        hello = json.loads(ws.receive(60) or "{}")
        if hello.get("type") != "hello":
            counts.add("refused")
            return
        counts.add("held")
        i = 0
        while time.monotonic() < deadline:
            i += 1
            for kind, msg in (("jobs", {"type": "attention", "text": rng.choice(QUESTIONS),
                                        "layer": rng.randrange(2), "head": rng.randrange(3)}),
                              ("chats", {"type": "generate", "max_tokens": max_tokens,
                                         "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]})):
                mid = f"{kind}{i}"
                ws.send(json.dumps({**msg, "id": mid}))
                reply = _answer(ws, mid)
                if reply is None:
                    counts.error("lost")
                    return
                if reply["type"] == "error":
                    counts.error(reply.get("code", "error"))
                    if reply.get("code") == "overloaded":
                        time.sleep(1.0)
                else:
                    counts.add(kind)
    except simple_websocket.ConnectionClosed:
        counts.error("lost")
    finally:
        try:
            ws.close()
        except Exception:
            pass


def measure(deployment: Deployment, clients: int, seconds: float, max_tokens: int) -> dict:
    before = deployment.health()
    counts = Counts()
    deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    threads = [threading.Thread(target=reader, args=(deployment.ws, i, deadline, max_tokens, counts), daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(seconds + 240)
    wall = time.monotonic() - t0
    after = deployment.health()
    delta = lambda key: sum(after[r]["jobs"][key] - before[r]["jobs"][key] for r in after)  # noqa: E731
    return {"replicas": len(after), "clients": clients, "seconds": seconds, "wall_s": round(wall, 1),
            "held": counts.held, "refused": counts.refused, "jobs": counts.jobs, "chats": counts.chats,
            "jobs_per_s": round(counts.jobs / wall, 2), "chats_per_s": round(counts.chats / wall, 2),
            "computed": delta("completed"), "cache_hits": delta("cache_hits"), "shared_hits": delta("shared_hits"),
            "errors": counts.errors,
            "per_replica": {r: {"completed": after[r]["jobs"]["completed"] - before[r]["jobs"]["completed"],
                                "shared_hits": after[r]["jobs"]["shared_hits"] - before[r]["jobs"]["shared_hits"],
                                "rss_bytes": after[r]["process"]["rss_bytes"]}
                            for r in after}}


def compare(replicas: int, clients: int, seconds: float, max_tokens: int, model: str,
            run_dir: str | None = None) -> dict:
    """One server alone, then `replicas` behind nginx: the same readers against each."""
    settings = {"max_connections_per_address": MAX_CLIENTS}
    base = Path(run_dir or tempfile.mkdtemp(prefix="sendlens-balancer-"))
    rows = []
    for count, balanced in ((1, False), (replicas, True)):
        with Deployment(base / f"{count}-{'balanced' if balanced else 'alone'}", replicas=count, model=model,
                        settings=settings, balanced=balanced) as deployment:
            rows.append({"deployment": f"{count} replicas behind nginx, Redis" if balanced else "1 server alone",
                         **measure(deployment, clients, seconds, max_tokens)})
    return {"model": model, "clients": clients, "seconds": seconds, "max_tokens": max_tokens,
            "date": time.strftime("%Y-%m-%d"), "rows": rows}


def table(report: dict) -> str:
    """The README's table of a comparison."""
    out = [f"Measured {report['date']} by `python -m bench.load --replicas {report['rows'][-1]['replicas']} "
           f"--clients {report['clients']} --seconds {report['seconds']:g} --model {report['model']}` "
           f"({report['max_tokens']} tokens per chat):", "",
           "| deployment | connections held | refused | widget jobs/s | chats/s | jobs computed | "
           "cache hits (local) | cache hits (shared, Redis) | errors |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        errors = ", ".join(f"{n} `{code}`" for code, n in sorted(r["errors"].items())) or "none"
        out.append(f"| {r['deployment']} | {r['held']} of {r['clients']} | {r['refused']} | {r['jobs_per_s']} | "
                   f"{r['chats_per_s']} | {r['computed']} | {r['cache_hits']} | {r['shared_hits']} | {errors} |")
    return "\n".join(out)


def write_readme(text: str, path: Path = README) -> None:
    """Replace the README's replicas section (between its markers) with the table."""
    from .report import write_readme as write_section
    write_section(text, path, BEGIN, END)
