"""Which requests run in the next step, and how many tokens each computes.

Continuous batching (Yu et al., 2022, "Orca"): the batch is re-formed at every step. Running
requests go first, oldest first, each with its next token (decode) or its next prefill chunk;
then waiting requests join while the step's token budget (max_num_batched_tokens), the batch
slots (max_num_seqs) and the KV pool allow. With chunked prefill (Agrawal et al., 2024,
"Sarathi-Serve") a long prompt is cut to fit the budget, so it does not stall the decoders.

A chunk's cost grows with its context: each of its tokens runs the linear layers once (the same
work at any position) and attends to every key before it. On a CPU the attention over one to
two thousand keys costs about as much as the linear layers, so a budget counted in tokens alone
lets the last chunks of a long prompt take several times as long as the first, and stall the
decoders that long. A chunk starting at position c therefore counts each token as
1 + c / chunk_context_tokens tokens of the budget (2048 by default), which keeps late chunks'
steps close to the first ones' (the widget `chunked_prefill` times the steps of such a prompt).

When the pool runs short, the newest running request gives its blocks back (preemption), by
recompute or by swap (config.preemption_mode, swap.py). Swapped requests come back before any
waiting request starts, as in vLLM's. A request of n samples (sequence_group.py) starts only when
there are n free batch slots: its samples fork from it when its prompt is done, into the slots
held for them.
"""

from collections import deque
from dataclasses import dataclass, field

from core.config import EngineConfig, PreemptionMode, Scheduling
from core.engine.block_manager import BlockManager, BlockOp
from core.engine.sequence import Sequence, SequenceStatus
from core.engine.swap import SwapSpace


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)   # of the preempted, those swapped
    swapped_in: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []            # oldest admitted first
        self.slots: list[str | None] = [None] * config.max_num_seqs  # request id per batch slot
        self.static_batch: set[str] = set()          # members of the static batch in flight
        self.swapped: deque[Sequence] = deque()      # preempted by swap, oldest first
        swap_blocks = config.num_swap_blocks or block_manager.num_blocks
        self.swap = SwapSpace(swap_blocks if config.preemption_mode == PreemptionMode.SWAP else 0)

    @property
    def static(self) -> bool:
        return self.config.scheduling == Scheduling.STATIC

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's batch. A step with nothing to run while beams sit idle on their blocks
        (each has its logits in and waits for its group's other beams, which wait for those
        blocks) would repeat for ever: the newest idle beam gives its blocks back, by recompute,
        and goes to the back of the queue, until the stuck sequence fits. Its logits stay with its
        group (beam_search.py), so only its KV is computed again."""
        out = self._schedule()
        while not out.scheduled and (self.waiting or self.swapped):
            idle = [s for s in self.running if s.num_uncomputed_tokens == 0]
            if not idle:
                break
            victim = idle[-1]
            self.preempt(victim, idle=True)
            again = self._schedule()
            again.preempted[:0] = [*out.preempted, victim]
            again.swapped_out[:0] = out.swapped_out
            out = again
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill

        # 1. Running requests: next token, or next prefill chunk.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_uncomputed_tokens
            cost = n
            if n == 0:               # a beam waiting for the rest of its group's step
                i += 1
                continue
            if chunked:
                n, cost = self.chunk(seq.num_computed_tokens, n, budget)
            elif n > budget:
                i += 1
                continue
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]  # the newest request gives way
                if self.preempt(victim):
                    out.swapped_out.append(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            self.block_manager.allocate(seq, n)
            out.scheduled.append((seq, n))
            budget -= cost
            i += 1

        # 2. Swapped-out requests come back, unless memory just ran short.
        while self.swapped and not out.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = cost = seq.num_uncomputed_tokens
            if n == 0:               # a beam that had its logits: back in, nothing to compute yet
                if len(seq.host_table) > self.block_manager.num_free_blocks or seq.num_seats > self.slots.count(None):
                    break
                self.swapped.popleft()
                self.swap_in(seq)
                out.swapped_in.append(seq)
                continue
            if chunked:
                n, cost = self.chunk(seq.num_computed_tokens, n, budget)
            elif n > budget:
                break
            blocks = len(seq.host_table)
            need = self.block_manager.blocks_needed(seq.num_computed_tokens + n) - blocks
            if blocks + need > self.block_manager.num_free_blocks or seq.num_seats > self.slots.count(None):
                break
            self.swapped.popleft()
            self.swap_in(seq)
            self.block_manager.allocate(seq, n)
            out.swapped_in.append(seq)
            out.scheduled.append((seq, n))
            budget -= cost

        # 3. Waiting requests join, unless memory just ran short or swapped requests wait.
        if out.preempted or self.swapped:
            return out
        if self.static and not self.static_batch:
            self.static_batch = {s.request_id for s in list(self.waiting)[: self.config.max_num_seqs]}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.static and seq.request_id not in self.static_batch:
                break
            if (seq.slot is None) + seq.num_seats - 1 > self.slots.count(None):
                break                # n samples: a slot for each
            cached_ids, cached_hashes = self.block_manager.find_cached_prefix(seq)
            start = len(cached_ids) * self.block_manager.block_size
            n = cost = seq.num_tokens - start
            if chunked:
                n, cost = self.chunk(start, n, budget)
            elif n > budget and (out.scheduled or n <= self.config.max_num_batched_tokens):
                break  # a whole prompt must fit; one larger than any budget runs alone
            if not self.block_manager.can_admit(seq, cached_ids, n):
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, cached_ids, cached_hashes, n)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self._take_slots(seq)
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= cost
        return out

    def chunk(self, start: int, n: int, budget: int) -> tuple[int, int]:
        """(tokens, budget cost) of the next piece of n uncomputed tokens starting at position
        `start`, within `budget`: a decode or a short context costs its token count; a chunk
        deep in a long prompt gets fewer tokens for the same budget (see the module docstring)."""
        per_token = 1.0 + start / self.config.chunk_context_tokens if self.config.chunk_context_tokens else 1.0
        if n == 1:                   # a decode: its attention is a row, not a chunk's square
            return 1, 1
        tokens = max(1, min(n, int(budget / per_token)))
        return tokens, min(budget, max(tokens, round(tokens * per_token)))

    # -- state changes -----------------------------------------------------------------------
    def preempt(self, seq: Sequence, idle: bool = False) -> bool:
        """Take seq's blocks back: swap them out if the mode says so and the host pool has room
        (-> True), else drop them and queue seq again at the front, to recompute (-> False).
        An idle beam (see schedule) is always recomputed and queued at the back: swapped, it
        would be the first to come back in, onto the blocks it just gave up."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        if not self.static:  # a static batch keeps its member's slot while it waits
            self._release_slots(seq)
        blocks = len(seq.block_table)
        if blocks and seq.num_computed_tokens and not idle and self.swap.can_hold(blocks):
            seq.host_table = self.swap.take(blocks)
            bm = self.block_manager
            bm.ops.extend((BlockOp.SWAP_OUT, g, h) for g, h in zip(seq.block_table, seq.host_table))
            bm.release(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return True
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        if idle:
            self.waiting.append(seq)
        else:
            self.waiting.appendleft(seq)
        return False

    def swap_in(self, seq: Sequence) -> None:
        """seq's blocks back from the host pool into fresh pool blocks; seq runs again."""
        bm = self.block_manager
        seq.block_table = bm.take_blocks(len(seq.host_table))
        bm.ops.extend((BlockOp.SWAP_IN, h, g) for h, g in zip(seq.host_table, seq.block_table))
        self.swap.give_back(seq.host_table)
        seq.host_table = []
        seq.status = SequenceStatus.RUNNING
        self._take_slots(seq)
        self.running.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child joins the running batch sharing parent's blocks (a sample or a beam), in the slot
        held for it or a free one; a parent without blocks (preempted) leaves child to recompute."""
        if parent.status == SequenceStatus.RUNNING:
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            if child.slot is None:
                child.slot = self.slots.index(None)
                self.slots[child.slot] = child.request_id
            self.running.append(child)
        else:
            if child.slot is not None and not self.static:
                self._release_slot(child)
            child.status = SequenceStatus.WAITING
            self.waiting.appendleft(child)
        if self.static and parent.request_id in self.static_batch:
            self.static_batch.add(child.request_id)

    def finish(self, seq: Sequence) -> None:
        """seq is done (or aborted): free its blocks and, unless a static batch holds it, its slot."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free_blocks(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.swap.give_back(seq.host_table)
            seq.host_table = []
        self._release_unforked(seq)
        seq.status = SequenceStatus.FINISHED
        if self.static and seq.request_id in self.static_batch:
            self.static_batch.discard(seq.request_id)
            if not self.static_batch:  # the whole batch is done: its slots open together
                self.slots = [None] * self.config.max_num_seqs
        else:
            self._release_slot(seq)

    def _take_slots(self, seq: Sequence) -> None:
        """A slot for seq, and one held for each sample still to fork from it."""
        for s in [seq, *(seq.group.unforked if seq.num_seats > 1 else ())]:
            if s.slot is None:
                s.slot = self.slots.index(None)
                self.slots[s.slot] = s.request_id

    def _release_slots(self, seq: Sequence) -> None:
        self._release_slot(seq)
        self._release_unforked(seq)

    def _release_unforked(self, seq: Sequence) -> None:
        if seq.num_seats > 1:
            for s in seq.group.unforked:
                self._release_slot(s)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot is not None and self.slots[seq.slot] == seq.request_id:
            self.slots[seq.slot] = None
        seq.slot = None

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in (*self.waiting, *self.swapped):
            if seq.request_id == request_id:
                return seq
        return None
