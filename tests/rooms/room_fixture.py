"""A recorded room in the contract's shapes (the rooms contract, issue 25), for the browser tests
of the room views: the `room_update` messages a live room pushes and the export of the same
session, built from a small deterministic schedule of continuous or static batching.

Not an engine: a step model of what the engine's scheduler does, enough to give the views the
shapes and patterns they draw (students sharing steps; static batching holding finished slots
idle until the batch drains, continuous batching refilling them).
"""

from dataclasses import dataclass, field

CHUNK = 16            # prompt tokens a prefill chunk takes
STEP_S = 0.02         # a step's recorded time


@dataclass
class Req:
    id: str
    student: str
    prompt: int
    output: int
    arrived: int = 0              # the step it arrived before
    done_prefill: int = 0
    generated: int = 0
    chunks_done: int = 0
    first_step: int | None = None
    first_token_step: int | None = None
    end_step: int | None = None
    slot: int | None = None
    record: dict = field(default_factory=dict)

    @property
    def chunks(self) -> int:
        return -(-self.prompt // CHUNK)


def settings(scheduling: str, slots: int) -> dict:
    return {"paused": False, "scheduling": scheduling, "max_num_seqs": slots, "max_tokens": 32,
            "one_at_a_time": True, "prefix_caching": True, "chunked_prefill": True}


def names(n: int) -> list[str]:
    base = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Margaret", "Dennis",
            "Radia", "Tim", "Sophie", "John", "Leslie", "Katherine"]
    return [base[i % len(base)] + ("" if i < len(base) else f" {i // len(base) + 1}") for i in range(n)]


def make_requests(students: list[str], start: int = 0, round_: int = 0) -> list[Req]:
    """One request per student, of varied prompt and output lengths, arriving in two waves from
    step `start`; ids req-<i> in the first round, req-<round>-<i> after."""
    prefix = "req-" if round_ == 0 else f"req-{round_}-"
    return [Req(id=f"{prefix}{i}", student=s, prompt=10 + (i * 7) % 30, output=4 + (i * 5) % 11, arrived=start + (0 if i < 6 else 3))
            for i, s in enumerate(students)]


def _work(r: Req, step: int) -> dict:
    """What request r does in its slot this step (and advance it)."""
    if r.first_step is None:
        r.first_step = step
    if r.done_prefill < r.prompt:
        n = min(CHUNK, r.prompt - r.done_prefill)
        r.done_prefill += n
        r.chunks_done += 1
        work = {"request": r.id, "student": r.student, "kind": "prefill", "num_tokens": n, "output_index": None, "recompute": False}
        if r.done_prefill == r.prompt:          # the last chunk makes the first token
            r.generated, r.first_token_step = 1, step
            work["output_index"] = 1
        return work
    r.generated += 1
    return {"request": r.id, "student": r.student, "kind": "decode", "num_tokens": 1, "output_index": r.generated, "recompute": False}


def _admit(slots: list, queue: list[Req], scheduling: str) -> None:
    """Fill free slots from the queue: continuous at once; static only once the batch drained."""
    if scheduling == "static" and any(s is not None for s in slots):
        return
    for i, s in enumerate(slots):
        if s is None and queue:
            r = queue.pop(0)
            r.slot = i
            slots[i] = r


def _record(r: Req, step: int) -> dict:
    state = ("done" if r.end_step is not None and r.end_step <= step else
             "waiting" if r.first_step is None else
             "prefill" if r.done_prefill < r.prompt or (r.chunks_done and r.generated == 0) else "decoding")
    in_prefill = state == "prefill"
    ttft = None if r.first_token_step is None else round((r.first_token_step - r.arrived + 1) * STEP_S, 4)
    tpot = STEP_S if state == "done" and r.output > 1 else None
    return {"id": r.id, "student": r.student, "state": state,
            "prefill_chunk": r.chunks_done if in_prefill else None, "prefill_chunks": r.chunks if in_prefill else None,
            "prompt_tokens": r.prompt, "cached_tokens": 0, "generated_tokens": r.generated,
            "ttft_s": ttft, "tpot_s": tpot,
            "waited_s": None if r.first_step is None else round((r.first_step - r.arrived) * STEP_S, 4)}


def _step(step: int, slots: list, queue: list[Req], scheduling: str, kv_total: int) -> dict:
    """One engine step: each slot's work, then the finished requests leave (continuous) or idle (static)."""
    cells, finished = [], []
    for r in slots:
        if r is None:
            cells.append(None)
        elif r.end_step is not None:
            cells.append({"request": r.id, "student": r.student, "kind": "idle", "num_tokens": 0, "output_index": None, "recompute": False})
        else:
            cells.append(_work(r, step))
            if r.generated >= r.output:
                r.end_step = step
                finished.append(r.id)
    busy = [c for c in cells if c and c["kind"] != "idle"]
    prefill = sum(c["num_tokens"] for c in busy if c["kind"] == "prefill")
    decode = sum(1 for c in busy if c["kind"] == "decode")
    used = sum(-(-(r.done_prefill + r.generated) // 16) for r in slots if r is not None and r.end_step is None)
    return {"step": step, "start_s": round(step * STEP_S, 4), "duration_s": STEP_S, "num_batched_tokens": prefill + decode,
            "num_prefill_tokens": prefill, "num_decode_tokens": decode, "running": len(busy), "waiting": len(queue),
            "kv_blocks_used": used, "kv_blocks_total": kv_total, "slots": cells, "preempted": [], "finished": finished}


def _update(code: str, seq: int, current: dict, who: list[str], reqs: list[Req], step: int, steps: list[dict],
            queue: list[Req], kv_total: int, ran: bool = True) -> dict:
    """The room_update the live room pushes after step `step`: with that step's row if it just
    ran, else (a settings change between steps) with none."""
    busy = sum(1 for s in steps for c in s["slots"] if c and c["kind"] != "idle")
    seen = [r for r in reqs if r.arrived <= step]
    blocks = {name: 0 for name in who}
    for r in reqs:
        if r.slot is not None and r.end_step is None:
            blocks[r.student] += -(-(r.done_prefill + r.generated) // 16)
    return {
        "type": "room_update", "room": code, "seq": seq, "settings": dict(current),
        "students": [{"name": name, "kv_blocks": blocks[name]} for name in who],
        "requests": [_record(r, step) for r in seen], "steps": [steps[-1]] if ran else [],
        "waiting": [r.id for r in queue], "kv": {"used": steps[-1]["kv_blocks_used"] if steps else 0, "total": kv_total},
        "totals": {"students": len(who), "requests": len(seen), "engine_steps": len(steps),
                   "mean_requests_per_step": busy / len(steps) if steps else 0.0},
    }


def session(students: int = 8, slots: int = 4, scheduling: str = "continuous", code: str = "TESTR00M",
            changes: list[dict] = ()) -> dict:
    """A whole session: {"updates": [room_update...], "export": {...}, "rounds": [...]}; one update
    per step, seq counting the updates.

    changes: the teacher's settings changes between rounds of sends. Every student sends once in
    the first round; once a round drained, the next change applies, one setting at a time as the
    controls send them (each an update with no step, and a settings_log entry at the steps done),
    and every student sends again. rounds[k] = {"changes": [{"settings": {key: value}, "update"}],
    "updates": [the round's step updates]}: the first round has no changes."""
    who = names(students)
    current = settings(scheduling, slots)
    log = [{"at": 0.0, "step": 0, "settings": dict(current)}]
    steps, updates, rounds, every, kv_total, seq = [], [], [], [], 64, 0
    step = 0
    for k, change in enumerate([{}, *changes]):
        done: list[dict] = []
        for key, value in change.items():   # one control each, as the teacher's page sends them
            current = {**current, key: value}
            log.append({"at": float(k), "step": len(steps), "settings": dict(current)})
            done.append({"settings": {key: value}, "update": _update(code, seq, current, who, every, step - 1, steps, [], kv_total, ran=False)})
            seq += 1
        reqs = make_requests(who, start=step, round_=k)
        every += reqs
        pending = sorted(reqs, key=lambda r: r.arrived)
        queue: list[Req] = []
        held: list = [None] * current["max_num_seqs"]
        mode, mine = current["scheduling"], []
        while pending or queue or any(r is not None for r in held):
            queue += [r for r in pending if r.arrived <= step]
            pending = [r for r in pending if r.arrived > step]
            _admit(held, queue, mode)
            trace = _step(step, held, queue, mode, kv_total)
            for i, r in enumerate(held):   # continuous frees a finished slot now; static when all are done
                if r is not None and r.end_step is not None and (mode == "continuous" or all(x is None or x.end_step is not None for x in held)):
                    held[i] = None
            steps.append(trace)
            mine.append(_update(code, seq, current, who, every, step, steps, queue, kv_total))
            seq += 1
            step += 1
        rounds.append({"changes": done, "updates": mine})
        updates += [c["update"] for c in done] + mine
    updates[0]["full"] = True
    export = {"schema": "sendlens.room/1", "room": {"code": code, "students": [{"name": n} for n in who]},
              "settings_log": log, "steps": steps, "requests": [_record(r, step) for r in every]}
    return {"updates": updates, "export": export, "rounds": rounds}
