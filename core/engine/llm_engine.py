"""LLMEngine: requests in, one step at a time, outputs out (after vLLM's LLMEngine).

A step is: schedule (which sequences, how many tokens each) -> run the model once over all of
them -> sample one token for each sequence whose prompt is done -> postprocess (append the token,
detokenize, check stop conditions, publish full KV blocks to the prefix cache, free the blocks of
finished requests) -> record the step in the trace. The engine is single-threaded: EngineLoop
runs it on a thread of its own for the web app; LLM drives it directly for offline use.
"""

import dataclasses
import itertools
import logging
import random
import time
from collections import deque

import torch

from core import registry
from core.config import OMP_POLICY_APPLIED, OMP_SPIN_COUNT, EngineConfig
from core.cpu_share import CpuShare
from core.engine.block_manager import BlockManager
from core.engine.outputs import RequestOutput, StepRecord
from core.engine.sampling_params import SamplingParams
from core.engine.scheduler import Scheduler
from core.engine.sequence import FinishReason, Sequence
from core.engine.trace import SlotWork, StepKind, StepTrace
from core.errors import ContextLengthExceeded, InvalidParameter, is_int
from core.kernels.loader import kernels
from core.model.kv_cache import BYTES_PER_VALUE, KVCache
from core.model.model import Transformer
from core.model.model_runner import ModelRunner
from core.model.native_decoder import native_decoder
from core.model.sampler import Sampler

log = logging.getLogger(__name__)



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
        self.cpu_share = CpuShare(config.num_threads) if config.share_cpu else None
        if not config.share_cpu and config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config = mc = loaded.config
        self.model_source = loaded.source
        self.tokenizer = loaded.tokenizer
        if getattr(loaded, "models", None):          # a sibling in its parent's format: the same modules
            self.model, self.reference_model = loaded.models
        else:
            self.model = Transformer.from_state_dict(mc, loaded.state_dict, config.weight_format,
                                                     config.lm_head_candidates)
            self.model.use_kernels(kernels(mc))                  # None where it cannot be built: torch's
            if config.native:
                self.model.native = native_decoder(self.model)   # None where it cannot be built: Python
            # What the looking-inside widgets run: the same weights multiplied in fp32 (no copy).
            self.reference_model = self.model.reference()
        bytes_per_block = config.block_size * mc.kv_values_per_token * BYTES_PER_VALUE
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // bytes_per_block)
        self.cache = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(self.model, self.cache)
        self.sampler = Sampler()
        # A sequence can never grow past the window, nor past the whole pool.
        window = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.max_model_len = min(window, num_blocks * config.block_size)
        self.stop_token_ids = {mc.eos_token_id, self.tokenizer.eos_token_id}
        self.trace: deque[StepTrace] = deque(maxlen=config.trace_steps)
        self.num_steps = 0
        self.start_time = time.perf_counter()
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)

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
        loaded = _Shared(self.model_config, self.model.state_dict(), self.tokenizer, self.model_source,
                         (self.model, self.reference_model) if packed_alike else None)
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
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        seq = Sequence(rid, ids, params, self.tokenizer,
                       arrival_time if arrival_time is not None else time.perf_counter(), prompt=text)
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            seq.generator = torch.Generator().manual_seed(seed)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if self.scheduler.find(seq.request_id) is not None:
            raise InvalidParameter("request_id", f"{seq.request_id!r} is already running")
        self.scheduler.add(seq)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> Sequence:
        seq = self.make_sequence(prompt, params, request_id, arrival_time)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; its blocks go back to the pool. None if it is not running or queued."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        self._finish(seq, FinishReason.ABORT, None, time.perf_counter())
        seq.detokenizer.drop_held_back()
        return seq.output([], "")

    def warmup(self) -> None:
        """Run one short request, so the first real one does not pay for first-call setup
        (allocator, BLAS threads). Leaves no trace: steps, trace and ids start afresh."""
        seq = self.add_request([self.model_config.bos_token_id] * 3, SamplingParams(temperature=0.0, max_tokens=2))
        while not seq.is_finished:
            self.step()
        self.trace.clear()
        self.num_steps = 0
        self._ids = itertools.count()
        self.start_time = time.perf_counter()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that got a token or finished."""
        if self.cpu_share is not None:
            self.cpu_share.update()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        slots, work = list(self.scheduler.slots), self._slot_work(sched, t0)  # for the trace
        seqs, tokens, candidates = self.run(sched.scheduled)
        t1 = time.perf_counter()
        outputs = self.postprocess(sched.scheduled, seqs, tokens, candidates, t1)
        self._record(sched, slots, work, outputs, t0, t1)
        return outputs

    def run(self, scheduled):
        """The model over every scheduled token at once, then one sampled token per sequence
        whose computed tokens reach its end. -> (those sequences, their tokens, candidates)."""
        step_input = self.runner.prepare(scheduled)
        logits = self.runner.run(step_input)                       # (N, V)
        seqs = step_input.sample_seqs
        tokens, candidates = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        return seqs, tokens, candidates

    def postprocess(self, scheduled, seqs, tokens, candidates, now: float) -> list[RequestOutput]:
        """Advance the scheduled sequences, publish their full blocks to the prefix cache, append
        the sampled tokens and check stop conditions (a finished request frees its blocks)."""
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.block_manager.publish(seq)
        outputs = []
        for seq, token, cands in zip(seqs, tokens, candidates):
            self._append_token(seq, token, cands, now)
            outputs.append(seq.output([token], seq.detokenizer.release(seq.is_finished)))
        return outputs

    # -- trace and metrics, beside the step --------------------------------------------------
    def _slot_work(self, sched, t0: float) -> dict[str, SlotWork]:
        """What each scheduled request does this step, decided before the step changes it."""
        work = {}
        for seq, n in sched.scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = t0
            decode = seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0
            work[seq.request_id] = SlotWork(seq.request_id, StepKind.DECODE if decode else StepKind.PREFILL, n,
                                            recompute=seq.num_preemptions > 0 and not decode)
        return work

    def _record(self, sched, slots, work: dict[str, SlotWork], outputs, t0: float, t1: float) -> None:
        slots = _trim(slots)
        for out in outputs:
            work[out.request_id].output_index = len(out.token_ids)
        for seq, n in sched.scheduled:
            seq.metrics.steps.append(StepRecord(self.num_steps, t0, t1 - t0, work[seq.request_id].kind, n,
                                                len(sched.scheduled), sched.num_batched_tokens))
        self.trace.append(StepTrace(
            step=self.num_steps, start_s=t0 - self.start_time, duration_s=t1 - t0,
            num_batched_tokens=sched.num_batched_tokens,
            num_prefill_tokens=sum(w.num_tokens for w in work.values() if w.kind == StepKind.PREFILL),
            num_decode_tokens=sum(w.num_tokens for w in work.values() if w.kind == StepKind.DECODE),
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.block_manager.num_blocks - self.block_manager.num_free_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            slots=[work.get(rid) or (SlotWork(rid, StepKind.IDLE) if rid else None) for rid in slots],
            preempted=[s.request_id for s in sched.preempted],
            finished=[out.request_id for out in outputs if out.finished]))
        self.num_steps += 1

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

    # -- state for the widgets (call on the engine's thread; EngineLoop publishes copies) ------
    def info(self) -> dict:
        """Facts that never change while the engine runs: the model's shape and the engine's limits."""
        mc, cfg = self.model_config, self.config
        return {
            "model": mc.name, "model_source": self.model_source,
            "context_window": self.max_model_len, "num_layers": mc.num_layers, "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "hidden_size": mc.hidden_size,
            "intermediate_size": mc.intermediate_size, "vocab_size": mc.vocab_size,
            "rope_theta": mc.rope_theta, "tie_word_embeddings": mc.tie_word_embeddings,
            "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "scheduling": cfg.scheduling.value,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "enable_chunked_prefill": cfg.enable_chunked_prefill,
            "kv_bytes_per_token": mc.kv_values_per_token * BYTES_PER_VALUE,
            "weight_format": cfg.weight_format.value,
            "num_params": sum(p.numel() for p in self.model.parameters()),
        }

    def stats(self) -> dict:
        """What changes step by step: the KV pool, the queues, the step count."""
        return {"kv": self.kv_stats(), "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "waiting_tokens": sum(s.num_tokens - s.num_computed_tokens for s in self.scheduler.waiting),
                "steps": self.num_steps}

    def block_tables(self) -> list[dict]:
        """A copy of every running request's block table, with the pool's reference counts."""
        refs = self.block_manager.ref_counts()
        return [{"request_id": s.request_id, "num_tokens": s.num_tokens,
                 "num_computed_tokens": s.num_computed_tokens, "num_cached_tokens": s.num_cached_tokens,
                 "blocks": list(s.block_table), "ref_counts": [int(refs[b]) for b in s.block_table]}
                for s in self.scheduler.running]

    def kv_stats(self) -> dict:
        bm = self.block_manager
        return {
            "total_blocks": bm.num_blocks,
            "free_blocks": bm.num_free_blocks,
            "used_blocks": bm.num_blocks - bm.num_free_blocks,
            "cached_blocks": bm.num_cached_blocks,
            "block_size": bm.block_size,
            "bytes": self.cache.nbytes,
            "bytes_per_token": self.model_config.kv_values_per_token * BYTES_PER_VALUE,
        }

    def kv_pool_map(self) -> dict:
        """Every block of the pool: its reference count (0: free), and the ids of the blocks that
        hold a published prefix (in use, or free but not yet evicted)."""
        bm = self.block_manager
        return {"ref_counts": bm.ref_counts(), "cached_block_ids": sorted(bm.cached.values())}


@dataclasses.dataclass
class _Shared:
    """A loaded model's parts, handed from one engine to its sibling."""

    config: object
    state_dict: dict
    tokenizer: object
    source: str
    models: tuple | None = None   # (model, reference_model) to run as they are, when packed alike


def _trim(slots: list) -> list:
    """Slots up to the last occupied one."""
    last = max((i for i, s in enumerate(slots) if s is not None), default=-1)
    return slots[: last + 1]
