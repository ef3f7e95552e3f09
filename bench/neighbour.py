"""A noisy neighbour: one client floods one message type while the others chat.

    python -m bench.load --neighbour template --clients 8 --seconds 30

Two runs of bench.load's classroom, one after the other, against the same server: first the
bystanders alone, then the bystanders beside one flooding client. Reported: the bystanders' median
TPOT in each run and their ratio (issue 30's goal: at most 1.5x with the default settings), and
what the flooder sent and was answered (how many served, how many refused, by code).

What each flood sends, as large as the server's hello allows and as fast as its message rate:
- `template`: a chat whose one message fills `max_message_bytes`;
- `stop`: `generate` requests whose stop strings fill the message (every output token checks them);
- `attention`: `attention` jobs on a text of about `max_inspect_tokens` tokens, each a new one;
- `generate`: `generate` requests whose prompt fills the message.
The flooder reads every reply on its own thread (a client that stops reading is cut off, which
would end the flood early) and never backs off: it is a hostile neighbour, not a polite page.
"""

import json
import threading
import time

from .load import Client, run

KINDS = ("template", "stop", "attention", "generate")
WORD = "word "


def flood_messages(kind: str, limits: dict):
    """An endless stream of flood messages of `kind` sized by the server's limits."""
    room = int(limits.get("max_message_bytes", 65536) * 0.9)          # the envelope's share aside
    max_tokens = limits.get("max_tokens_limit", 64)
    n = 0
    while True:
        n += 1
        mid = f"n{n}"
        if kind == "template":
            yield {"type": "template", "id": mid, "messages": [{"role": "user", "content": WORD * (room // 5)}]}
        elif kind == "stop":
            stops = [f"never-{n}-{i}-" + "x" * 16 for i in range(room // 40)]   # about 35 bytes each, quoted
            yield {"type": "generate", "id": mid, "prompt": "Tell me a story.", "max_tokens": max_tokens,
                   "stop": stops}
        elif kind == "attention":
            words = min(room // 8, limits.get("max_inspect_tokens", 1024) // 2)
            yield {"type": "attention", "id": mid, "text": f"Flood {n}: " + WORD * words, "layer": 0,
                   "head": "all"}
        else:
            yield {"type": "generate", "id": mid, "prompt": f"Flood {n}: " + WORD * (room // 5 - 4),
                   "max_tokens": max_tokens}


def flood_loop(url: str, kind: str, stop: threading.Event, counts: dict) -> None:
    """One client sending `kind` at its message rate until `stop`; replies counted by type or code."""
    ws = Client.connect(url)
    try:
        hello = json.loads(ws.receive(30) or "{}")
        limits = hello.get("limits", {})
        interval = 1.0 / max(1, limits.get("max_messages_per_second", 20) - 1)
        lock = threading.Lock()

        def read():
            while not stop.is_set():
                raw = ws.receive(0.5)
                if raw is None:
                    if not ws.connected:
                        return
                    continue
                msg = json.loads(raw)
                key = msg.get("code") if msg.get("type") == "error" else msg.get("type")
                if key in ("token", "accepted", "progress"):
                    continue
                with lock:
                    counts[key] = counts.get(key, 0) + 1
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for msg in flood_messages(kind, limits):
            if stop.is_set() or not ws.connected:
                break
            ws.send(json.dumps(msg))
            with lock:
                counts["sent"] = counts.get("sent", 0) + 1
            stop.wait(interval)
        reader.join(5)
    finally:
        try:
            ws.close()
        except Exception:
            pass


def run_neighbour(url: str, kind: str, clients: int, seconds: float, max_tokens: int) -> dict:
    """The bystanders alone, then beside a flood of `kind`: their TPOT in each, and the ratio."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    alone = run(url, clients, seconds, max_tokens, drop=False)
    counts: dict = {}
    stop = threading.Event()
    flooder = threading.Thread(target=flood_loop, args=(url, kind, stop, counts), daemon=True)
    flooder.start()
    time.sleep(0.5)                                    # the flood is on before the bystanders start
    try:
        beside = run(url, clients, seconds, max_tokens, drop=False, settle=False)
    finally:
        stop.set()
        flooder.join(30)
    a, b = alone["tpot_ms"]["p50"], beside["tpot_ms"]["p50"]
    return {"neighbour": kind, "clients": clients, "seconds": seconds, "max_tokens": max_tokens,
            "alone": alone, "beside": beside, "flooder": counts,
            "tpot_p50_ms": {"alone": a, "beside": b}, "tpot_ratio": round(b / a, 2) if a and b else None}
