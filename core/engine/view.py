"""The one read-only window onto an engine: what the app reads, and nothing it could change.

The app (the widgets, the engine loop's snapshots, the benchmark) reads an engine only through
`engine.view`: its fixed facts (info), its state step by step (stats, kv_stats, block_tables,
kv_pool_map, trace), and the parts the looking-inside widgets run or measure themselves (the
model, the fp32 reference model, the KV pool's tensors, the tokenizer). It drives an engine only
through the engine's own verbs (add_request, step, abort, sibling). Call it on the engine's
thread; EngineLoop publishes copies for other threads.
"""



class EngineView:
    def __init__(self, engine):
        self._engine = engine

    # -- what the engine was built with --------------------------------------------------------
    @property
    def config(self):
        """The engine's EngineConfig (frozen)."""
        return self._engine.config

    @property
    def model_config(self):
        return self._engine.model_config

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def model(self):
        """The model as the engine multiplies it (its weight format)."""
        return self._engine.runner.model

    @property
    def reference_model(self):
        """The same weights multiplied in fp32 (what the looking-inside widgets run)."""
        return self._engine.runner.reference_model

    @property
    def cache(self):
        """The KV pool (its tensors, for the widget that shows what the engine set aside)."""
        return self._engine.runner.cache

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    # -- the steps -----------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return self._engine.recorder.num_steps

    @property
    def start_time(self) -> float:
        """time.perf_counter() when the trace's clock started (StepTrace.start_s counts from it)."""
        return self._engine.recorder.start_time

    @property
    def trace(self) -> tuple:
        """The recent steps' StepTrace rows, oldest first (a copy of the recorder's)."""
        return tuple(self._engine.recorder.trace)

    # -- for the widgets -----------------------------------------------------------------------
    def info(self) -> dict:
        """Facts that never change while the engine runs: the model's shape and the engine's limits."""
        e = self._engine
        mc, cfg = e.model_config, e.config
        return {
            "model": mc.name, "model_source": e.model_source,
            "context_window": e.max_model_len, "num_layers": mc.num_layers, "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "hidden_size": mc.hidden_size,
            "intermediate_size": mc.intermediate_size, "vocab_size": mc.vocab_size,
            "rope_theta": mc.rope_theta, "tie_word_embeddings": mc.tie_word_embeddings,
            "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "scheduling": cfg.scheduling.value,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "enable_chunked_prefill": cfg.enable_chunked_prefill,
            "kv_bytes_per_token": mc.kv_values_per_token * self.cache.bytes_per_value,
            "kv_cache_dtype": self.cache.dtype.value,
            "weight_format": cfg.weight_format.value,
            "activation_rounding": self.model.activation_rounding(),
            "attention_operands": self.model.attention_operands(),
            "num_params": sum(p.numel() for p in self.model.parameters()),
        }

    def stats(self) -> dict:
        """What changes step by step: the KV pool, the queues, the step count."""
        sched = self._engine.scheduler
        return {"kv": self.kv_stats(), "running": len(sched.running),
                "waiting": len(sched.waiting),
                "waiting_tokens": sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting),
                "steps": self.num_steps}

    def block_tables(self) -> list[dict]:
        """A copy of every running request's block table, with the pool's reference counts."""
        refs = self._engine.block_manager.ref_counts()
        return [{"request_id": s.request_id, "num_tokens": s.num_tokens,
                 "num_computed_tokens": s.num_computed_tokens, "num_cached_tokens": s.num_cached_tokens,
                 "blocks": list(s.block_table), "ref_counts": [int(refs[b]) for b in s.block_table]}
                for s in self._engine.scheduler.running]

    def kv_stats(self) -> dict:
        bm = self._engine.block_manager
        return {
            "total_blocks": bm.num_blocks,
            "free_blocks": bm.num_free_blocks,
            "used_blocks": bm.num_blocks - bm.num_free_blocks,
            "cached_blocks": bm.num_cached_blocks,
            "block_size": bm.block_size,
            "bytes": self.cache.nbytes,
            "bytes_per_token": self.model_config.kv_values_per_token * self.cache.bytes_per_value,
            "dtype": self.cache.dtype.value,
        }

    def kv_pool_map(self) -> dict:
        """Every block of the pool: its reference count (0: free), and the ids of the blocks that
        hold a published prefix (in use, or free but not yet evicted)."""
        bm = self._engine.block_manager
        return {"ref_counts": bm.ref_counts(), "cached_block_ids": sorted(bm.cached.values())}
