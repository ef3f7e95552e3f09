"""A room's engine: a sibling of the server's (the same weights, no copy) with the room's
settings, its own KV pool, scheduler and step trace, run by an EngineLoop of its own.

The server's other users never feel a room's settings: the room's requests never enter the
serving engine. The room starts an engine when a request arrives and stops it once it has been
idle a while (Room.tick); a change of scheduling, batch slots, prefix caching or chunked prefill
gives the room a fresh engine for its next requests, while the old one finishes what it holds.

After each step (and before any output of it reaches the room) the loop's side work (on the loop's thread, between steps) hands the new
StepTrace rows and the running requests' block tables to the room: snapshots the engine's view
gives out (core/engine/view.py), never its internals.
"""

import time

from core.engine.engine_loop import EngineLoop

TRACE_STEPS = 256          # trace rows the engine keeps; the room copies them after every step


class RoomEngine:
    def __init__(self, base, settings, num_kv_blocks: int, generation: int, max_queue: int, on_steps):
        """base: the server's LLMEngine; on_steps(room_engine, traces, block_tables) on the loop's thread."""
        engine = base.sibling(num_kv_blocks=num_kv_blocks, trace_steps=TRACE_STEPS, **settings.engine_settings())
        self.generation = generation
        self.settings = settings
        self.step_budget = engine.view.config.max_num_batched_tokens
        self.on_steps = on_steps
        self.records: dict = {}             # engine request id -> Record, while in flight
        self.known: dict = {}               # engine request id -> Record, every one this engine ran
                                            # (a finished request's slot may show in later steps)
        self.seen = 0                       # engine steps already handed to the room
        self.last_busy = time.monotonic()
        self.loop = EngineLoop(engine, max_queue=max_queue, side_work=self._observe)
        self.loop.start()

    def observe(self) -> None:
        """Hand the room the steps not yet seen; on the loop's thread only (a request's listener
        calls it first, so a record never runs ahead of the steps that made it)."""
        self._observe(self.loop.engine)

    def _observe(self, engine) -> bool:
        n = engine.view.num_steps
        if n > self.seen:
            new = engine.view.trace[-(n - self.seen):]
            self.seen = n
            self.on_steps(self, new, engine.view.block_tables())
        return False

    @property
    def busy(self) -> bool:
        return bool(self.records)

    def kv(self) -> dict:
        kv = self.loop.stats()["kv"]
        return {"used": kv["used_blocks"], "total": kv["total_blocks"]}

    def abort_all(self) -> None:
        for request_id in list(self.records):
            self.loop.abort(request_id)

    def shutdown(self) -> None:
        self.loop.shutdown()
