"""The engine's record of its steps: the trace (core/engine/trace.py) and each request's own.

Beside the step, never in its way: start() notes when a step begins (before scheduling), begin()
notes what each scheduled request is about to do (a prefill chunk or a decode, decided before
the step changes it), end() writes the step's row once its outputs are known: the batch's slots,
token counts, queue lengths, the KV pool's use, who was preempted and who finished. Each request
also gets a StepRecord per step that worked on it (RequestOutput.metrics.steps).
"""

import time
from collections import deque

from core.engine.outputs import RequestOutput, StepRecord
from core.engine.scheduler import Scheduler, SchedulerOutput
from core.engine.sequence_group import sample_id
from core.engine.trace import SlotWork, StepKind, StepTrace


class StepRecorder:
    def __init__(self, scheduler: Scheduler, trace_steps: int):
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.trace: deque[StepTrace] = deque(maxlen=trace_steps)
        self.num_steps = 0
        self.start_time = time.perf_counter()
        self._t0 = self.start_time
        self._slots: list = []
        self._work: dict[str, SlotWork] = {}

    def reset(self) -> None:
        """Forget every step: the trace, the count and the clock start afresh."""
        self.trace.clear()
        self.num_steps = 0
        self.start_time = time.perf_counter()

    def start(self) -> None:
        """A step begins (its clock starts before the scheduler runs)."""
        self._t0 = time.perf_counter()

    def begin(self, batch: SchedulerOutput) -> None:
        """What each scheduled request does this step, decided before the step changes it."""
        self._slots = list(self.scheduler.slots)
        self._work = {}
        for seq, n in batch.scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = self._t0
            decode = seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0
            self._work[seq.request_id] = SlotWork(seq.request_id, StepKind.DECODE if decode else StepKind.PREFILL, n,
                                                  recompute=seq.num_preemptions > 0 and not decode)

    def end(self, batch: SchedulerOutput, outputs: list[RequestOutput], ran_until: float, moves=None) -> None:
        """The step's row in the trace, and a StepRecord for each request in it; ran_until: when
        the model's run (and the sampling) ended; moves: the step's block moves (BlockMoves)."""
        t0, work, slots = self._t0, self._work, _trim(self._slots)
        finished = []
        for out in outputs:
            for sample in out.outputs:    # n samples: each under its own id
                rid = sample_id(out.request_id, sample.index)
                if sample.new_token_ids and rid in work:
                    work[rid].output_index = len(sample.token_ids)
                if sample.new_token_ids and sample.finish_reason is not None:
                    finished.append(rid)
        for seq, n in batch.scheduled:
            seq.metrics.steps.append(StepRecord(self.num_steps, t0, ran_until - t0, work[seq.request_id].kind, n,
                                                len(batch.scheduled), batch.num_batched_tokens))
        bm = self.block_manager
        self.trace.append(StepTrace(
            step=self.num_steps, start_s=t0 - self.start_time, duration_s=ran_until - t0,
            num_batched_tokens=batch.num_batched_tokens,
            num_prefill_tokens=sum(w.num_tokens for w in work.values() if w.kind == StepKind.PREFILL),
            num_decode_tokens=sum(w.num_tokens for w in work.values() if w.kind == StepKind.DECODE),
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks, kv_blocks_total=bm.num_blocks,
            slots=[work.get(rid) or (SlotWork(rid, StepKind.IDLE) if rid else None) for rid in slots],
            preempted=[s.request_id for s in batch.preempted],
            finished=finished, swapped=len(self.scheduler.swapped),
            swapped_out=[s.request_id for s in batch.swapped_out],
            swapped_in=[s.request_id for s in batch.swapped_in],
            **({} if moves is None else {
                "blocks_copied": moves.copies, "blocks_swapped_out": moves.swapped_out,
                "blocks_swapped_in": moves.swapped_in, "copy_s": moves.copy_s, "swap_s": moves.swap_s})))
        self.num_steps += 1


def _trim(slots: list) -> list:
    """Slots up to the last occupied one."""
    last = max((i for i, s in enumerate(slots) if s is not None), default=-1)
    return slots[: last + 1]
