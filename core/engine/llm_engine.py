"""LLMEngine: requests in, one step at a time, outputs out (after vLLM's LLMEngine).

A step is: schedule (which sequences, how many tokens each; scheduler.py) -> run the model once
over all of them and sample one token for each sequence whose prompt is done (the model runner
and the sampler) -> postprocess (append the token, detokenize, check stop conditions, publish
full KV blocks to the prefix cache, free the blocks of finished requests) -> record the step
(step_recorder.py). Before the forward pass the runner carries out the step's block moves: the
copy-on-write copies and the swaps the scheduler decided (block_manager.py, swap.py), timed. A
speculative request's decode checks its draft's tokens in the same run and may add several tokens
at once (speculative.py). A request of n samples forks them when its prompt is done
(sequence_group.py); a beam search (beam_search.py) picks its beams' tokens itself. The model
runner builds the model and the KV pool; the app reads the engine
only through `engine.view` (view.py). The engine is single-threaded: EngineLoop runs it on a
thread of its own for the web app; LLM drives it directly for offline use.
"""

import dataclasses
import itertools
import logging
import random
import time

import torch

from core import registry
from core.config import OMP_POLICY_APPLIED, OMP_SPIN_COUNT, EngineConfig
from core.engine.beam_search import BeamGroup, BeamSearchParams
from core.engine.block_manager import BlockManager, BlockOp
from core.engine.outputs import RequestOutput
from core.engine.sampling_params import SamplingParams, derived_seed
from core.engine.scheduler import Scheduler, SchedulerOutput
from core.engine.sequence import FinishReason, Sequence, SequenceStatus
from core.engine.sequence_group import SequenceGroup, sample_id
from core.engine.speculative import Speculator
from core.engine.step_recorder import StepRecorder
from core.engine.view import EngineView
from core.errors import ContextLengthExceeded, InvalidParameter, is_int
from core.model.model_runner import ModelRunner
from core.model.sampler import Sampler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Sampled:
    """What a step's run gives back: tokens (and candidates) for each sequence that samples: one,
    or a speculative pass's kept draft tokens and the model's own after them."""

    seqs: list[Sequence]
    tokens: list[list[int]]
    candidates: list      # per sequence: a list of Candidate, or None
    time: float           # time.perf_counter() when the tokens were ready
    logits: object = None # (N, V), kept for the beams among seqs
    moves: object = None  # BlockMoves carried out before the forward pass


@dataclasses.dataclass
class BlockMoves:
    """The block moves carried out before a step's forward pass, and how long they took (measured)."""

    copies: int = 0       # copy-on-write
    swapped_out: int = 0  # blocks to the host pool
    swapped_in: int = 0   # blocks back from it
    copy_s: float = 0.0
    swap_s: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None):
        """loaded: the model (config, state_dict, tokenizer, source), e.g. from core.registry.load;
        None loads config.model by name. The only process-wide thing an engine touches is torch's
        thread count: with share_cpu it sets it before each step to the cores other processes
        leave free (cpu_share.py), else to num_threads once if given. No global seed, so a second
        engine can sit beside the serving one (sibling() engines leave the thread count alone)."""
        loaded = loaded or registry.load(config.model, config.cache_dir)
        if not OMP_POLICY_APPLIED and config.num_threads != 1:
            log.warning("torch was imported before sendlens' core, so OpenMP keeps its default spin "
                        "(long): beside another busy process decode runs several times slower until "
                        "the engine drops to the free cores. Import core first, or set "
                        f"GOMP_SPINCOUNT={OMP_SPIN_COUNT}.")
        self.config = config
        self.model_config = mc = loaded.config
        self.model_source = loaded.source
        self.tokenizer = loaded.tokenizer
        self.runner = ModelRunner(config, loaded)                 # the model and the KV pool
        num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler()
        self.speculator = Speculator(self)
        # A sequence can never grow past the window, nor past the whole pool.
        window = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.max_model_len = min(window, num_blocks * config.block_size)
        self.stop_token_ids = {mc.eos_token_id, self.tokenizer.eos_token_id}
        self.recorder = StepRecorder(self.scheduler, config.trace_steps)
        self.view = EngineView(self)
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.groups: dict[str, object] = {}    # request id -> SequenceGroup or BeamGroup in flight

    def sibling(self, **settings) -> "LLMEngine":
        """A second engine on the same weights and tokenizer (no copy), with its own KV pool,
        scheduler and trace, and `settings` (any EngineConfig field) changed: for experiments that
        run beside the serving engine (the widgets' timing jobs) without touching its state. In
        the same weight format it runs this engine's model itself (packing q4_1 again would stall
        the engine loop); both run on the engine loop's one thread, never at once."""
        settings = {"share_cpu": False, "num_threads": None, **settings}  # the serving engine sets threads
        config = dataclasses.replace(self.config, **settings)
        packed_alike = all(getattr(config, f) == getattr(self.config, f)
                           for f in ("weight_format", "lm_head_candidates", "native"))
        runner = self.runner
        loaded = _Shared(self.model_config, runner.model.state_dict(), self.tokenizer, self.model_source,
                         (runner.model, runner.reference_model) if packed_alike else None)
        return LLMEngine(config, loaded)

    # -- requests ----------------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, arrival_time: float | None = None) -> Sequence:
        """Validate and tokenize a request (safe from any thread; nothing is queued)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidParameter("sampling_params", f"must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            text, ids = None, list(prompt)
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidParameter("prompt", f"token id {bad[0]} is outside the vocabulary "
                                                 f"(0..{self.model_config.vocab_size - 1})")
        else:
            raise InvalidParameter("prompt", "must be a string or a list of token ids")
        if not ids:
            raise InvalidParameter("prompt", "is empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthExceeded(
                "prompt", f"{len(ids)} tokens leave no room to generate in a context of "
                          f"{self.max_model_len} tokens")
        if params.n > self.config.max_num_seqs:
            raise InvalidParameter("n", f"must be at most max_num_seqs ({self.config.max_num_seqs}): "
                                        "each sample takes a batch slot")
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        seqs = [Sequence(sample_id(rid, i), ids, params, self.tokenizer, arrival, prompt=text)
                for i in range(params.n)]
        for i, seq in enumerate(seqs):
            if not params.greedy:   # sample i of a seeded request: derived_seed(seed, i)
                seed = derived_seed(params.seed, i) if params.seed is not None else self._rng.getrandbits(63)
                seq.generator = torch.Generator().manual_seed(seed)
        if params.n > 1:
            SequenceGroup(rid, seqs)
        return seqs[0]

    def add_sequence(self, seq: Sequence) -> None:
        if self.scheduler.find(seq.request_id) is not None or seq.request_id in self.groups:
            raise InvalidParameter("request_id", f"{seq.request_id!r} is already running")
        if seq.group is not None:
            self.groups[seq.request_id] = seq.group
        self.scheduler.add(seq)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> Sequence:
        seq = self.make_sequence(prompt, params, request_id, arrival_time)
        self.add_sequence(seq)
        return seq

    def add_beam_search(self, prompt, params: BeamSearchParams, request_id: str | None = None) -> BeamGroup:
        """Queue a beam search over prompt (beam_search.py); its result is on the group when done."""
        root = self.make_beam_search(prompt, params, request_id)
        self.add_sequence(root)
        return root.group

    def make_beam_search(self, prompt, params: BeamSearchParams, request_id: str | None = None) -> Sequence:
        """Validate a beam search and make its group (nothing is queued) -> its root sequence,
        which add_sequence queues as any request's (the web app's way in, engine_loop.py)."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidParameter("params", f"must be a BeamSearchParams, got {type(params).__name__}")
        if params.beam_width > self.config.max_num_seqs:
            raise InvalidParameter("beam_width", f"must be at most max_num_seqs ({self.config.max_num_seqs}): "
                                                 "each beam takes a batch slot")
        seq = self.make_sequence(prompt, SamplingParams(temperature=0.0, max_tokens=1), request_id)  # validates
        group = BeamGroup(self, seq.request_id, seq.token_ids, params)
        group.root.prompt = seq.prompt
        return group.root

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; its blocks go back to the pool. None if it is not running or queued."""
        group = self.groups.pop(request_id, None)
        if group is not None:      # every sample (or beam) still going
            now = time.perf_counter()
            for seq in group.seqs:
                if not seq.is_finished:
                    self._finish(seq, FinishReason.ABORT, None, now)
                    seq.detokenizer.drop_held_back()
            return group.output({})
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        self._finish(seq, FinishReason.ABORT, None, time.perf_counter())
        seq.detokenizer.drop_held_back()
        return seq.output([], "")

    def warmup(self, touch_pool: bool = False) -> None:
        """Run one short request, so the first real one does not pay for first-call setup
        (allocator, BLAS threads). Leaves no trace: steps, trace and ids start afresh.
        touch_pool: also map the whole KV pool now (KVCache.touch), as it is after a while of
        serving; otherwise each block's first write pays for its pages (a fresh engine's first
        512-token prompt took about a third longer than its second)."""
        if touch_pool:
            self.runner.cache.touch()
        seq = self.add_request([self.model_config.bos_token_id] * 3, SamplingParams(temperature=0.0, max_tokens=2))
        while not seq.is_finished:
            self.step()
        self.recorder.reset()
        self._ids = itertools.count()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run -> postprocess -> record. -> an output per request that got a token or finished."""
        self.runner.fit_threads()
        self.recorder.start()
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            return []
        self.recorder.begin(batch)
        sampled = self.run(batch)
        outputs = self.postprocess(batch, sampled)
        self.recorder.end(batch, outputs, sampled.time, sampled.moves)
        return outputs

    def move_blocks(self) -> BlockMoves:
        """Carry out the block moves the scheduler queued, in order: copies within the pool
        (copy-on-write), swaps to and from the host pool, each run of one kind at once."""
        ops, self.block_manager.ops = self.block_manager.ops, []
        cache, host = self.runner.cache, self.runner.host_cache
        moves = BlockMoves()
        for kind, run in itertools.groupby(ops, key=lambda op: op[0]):
            run = list(run)
            src, dst = {BlockOp.COPY: (cache, cache), BlockOp.SWAP_OUT: (cache, host),
                        BlockOp.SWAP_IN: (host, cache)}[kind]
            t0 = time.perf_counter()
            src.copy_to(dst, [op[1] for op in run], [op[2] for op in run])
            took = time.perf_counter() - t0
            if kind == BlockOp.COPY:
                moves.copies += len(run)
                moves.copy_s += took
            else:
                moves.swap_s += took
                if kind == BlockOp.SWAP_OUT:
                    moves.swapped_out += len(run)
                else:
                    moves.swapped_in += len(run)
        return moves

    def run(self, batch: SchedulerOutput) -> Sampled:
        """The model over every scheduled token at once, then one sampled token per sequence
        whose computed tokens reach its end: first the block moves the scheduler queued, then
        the speculative decodes' drafts, whose passes keep what the model agrees with."""
        moves = self.move_blocks()
        self.speculator.extend(batch)
        step_input = self.runner.prepare(batch.scheduled)
        seqs = step_input.sample_seqs
        step_input = self.speculator.widen(step_input)
        logits = self.runner.run(step_input)                       # (R, V): R sampled rows
        seqs, logits, drafted, drafted_tokens = self.speculator.verify(seqs, logits)
        if any(_forks_samples(s) for s in seqs):   # samples about to fork draw from their parent's logits
            rows = [r for r, s in enumerate(seqs) for _ in range(s.num_seats if _forks_samples(s) else 1)]
            seqs = [t for s in seqs for t in (s, *(s.group.unforked if _forks_samples(s) else ()))]
            logits = logits[rows]                                  # (N, V)
        tokens, candidates = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        return Sampled(seqs + drafted, [[t] for t in tokens] + drafted_tokens,
                       candidates + [None] * len(drafted), time.perf_counter(), logits, moves)

    def postprocess(self, batch: SchedulerOutput, sampled: Sampled) -> list[RequestOutput]:
        """Advance the scheduled sequences (less rejected draft tokens), publish their full blocks
        to the prefix cache, append the sampled tokens and check stop conditions after each (a
        finished request frees its blocks and drops the rest)."""
        for seq, n in batch.scheduled:
            seq.num_computed_tokens += n
            self.speculator.roll_back(seq)
            self.block_manager.publish(seq)
        for seq in sampled.seqs:
            if _forks_samples(seq):           # its prompt is done: the other samples fork from it
                children, seq.group.forked = seq.group.unforked, True
                for child in children:
                    self.scheduler.fork(seq, child)
        outputs, new, beams = [], {}, []
        for row, (seq, tokens, cands) in enumerate(zip(sampled.seqs, sampled.tokens, sampled.candidates)):
            if isinstance(seq.group, BeamGroup):  # a beam's logits go to its group, which picks
                seq.group.report(seq, sampled.logits[row])
                if seq.group not in beams:
                    beams.append(seq.group)
                continue
            delta = (self._append_tokens(seq, tokens, cands, sampled.time), seq.detokenizer.release(seq.is_finished))
            if seq.group is None:
                outputs.append(seq.output(*delta))
            else:
                new.setdefault(seq.group, {})[seq.index] = delta
        for group, delta in new.items():     # one output per request of n samples
            outputs.append(group.output(delta))
            if group.is_finished:
                self.groups.pop(group.request_id, None)
        for group in beams:
            if group.ready:
                group.advance()
            if group.is_finished and self.groups.pop(group.request_id, None) is not None:
                outputs.append(group.output({}))
        return outputs

    def _append_tokens(self, seq: Sequence, tokens: list[int], cands, now: float) -> list[int]:
        """Append a pass's tokens one by one (a speculative pass's kept drafts, then the model's
        own), checking stop conditions after each. -> the tokens appended."""
        self.speculator.kept_drafts(seq, tokens)
        appended = []
        for token in tokens:
            self._append_token(seq, token, cands, now)
            appended.append(token)
            if seq.is_finished:
                break
        return appended

    def _append_token(self, seq: Sequence, token: int, cands, now: float) -> None:
        seq.token_ids.append(token)
        seq.metrics.token_times.append(now)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        if seq.candidates is not None:
            seq.candidates.append(cands)
        stop_string = seq.detokenizer.append(token)
        params = seq.params
        if token in self.stop_token_ids and not params.ignore_eos:
            self._finish(seq, FinishReason.STOP, token, now)
        elif token in params.stop_token_ids:
            self._finish(seq, FinishReason.STOP, token, now)
        elif stop_string is not None:
            self._finish(seq, FinishReason.STOP, stop_string, now)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH, None, now)

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason, now: float) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.metrics.finished_time = now
        self.scheduler.finish(seq)


def _forks_samples(seq: Sequence) -> bool:
    """Is seq sample 0 of an n-sample request whose other samples fork from it now?"""
    return isinstance(seq.group, SequenceGroup) and seq.num_seats > 1


@dataclasses.dataclass
class _Shared:
    """A loaded model's parts, handed from one engine to its sibling."""

    config: object
    state_dict: dict
    tokenizer: object
    source: str
    models: tuple | None = None   # (model, reference_model) to run as they are, when packed alike

