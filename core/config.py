"""Settings: the shape of a model, and every knob of the engine, in one dataclass each.

`ModelConfig` is read from the checkpoint (GGUF metadata for SmolLM2); `EngineConfig` is what a
user of `LLM(...)` sets. Every limit the engine enforces has a name here.
"""

import os
import sys
from dataclasses import dataclass
from enum import Enum

from core.errors import InvalidParameter, is_int

# How long an OpenMP thread spins before it sleeps, read once when torch loads libgomp (core's
# __init__ imports this module before anything imports torch). A decode step is ~100 parallel
# regions: sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a slow wake-up in each; a short spin
# keeps threads hot between them, much faster (cpu_share.py). Spinning starves a partner thread when
# another process is busy on the same cores, so the server runs on the cores others leave free
# (cpu_share.py). Either variable set by the user wins. LLMEngine logs a warning when torch came
# first and the setting could not reach OpenMP (OMP_POLICY_APPLIED).
OMP_SPIN_COUNT = "10000"
OMP_POLICY_APPLIED = ("OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
                      or "torch" not in sys.modules)
OMP_DEFAULTS_SET = {}  # what core set itself (the benchmark takes it back for its peers)
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = OMP_DEFAULTS_SET["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int = 49152
    hidden_size: int = 576            # C, the residual stream width
    intermediate_size: int = 1536     # SwiGLU width
    num_layers: int = 30
    num_heads: int = 9                # query heads
    num_kv_heads: int = 3             # key/value heads (grouped-query attention)
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192  # the context window
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2
    num_experts: int = 0              # mixture of experts: experts per MLP (0: one dense MLP, see moe.py)
    num_experts_per_token: int = 0    # ... and how many of them the router picks for each token (top-k)

    @property
    def expert_size(self) -> int:
        """Hidden units of one expert: the MLP's width split evenly (0 for a dense MLP)."""
        return self.intermediate_size // self.num_experts if self.num_experts else 0

    @property
    def kv_values_per_token(self) -> int:
        """Values the KV cache holds per token: K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


class WeightFormat(str, Enum):
    """How the linear layers' weights are stored and multiplied (see core/model/linear.py)."""
    FP32 = "fp32"   # the reference: fp32 weights (the engine's kernel; oneDNN or MKL without it)
    BF16 = "bf16"   # bfloat16 weights, fp32 accumulation (oneDNN with AVX-512 BF16, else the engine's kernel)
    Q4_1 = "q4_1"   # the GGUF's own 4-bit groups, the engine's kernel (AVX-512 BF16 or AVX2) or PyTorch's int4
    Q8_0 = "q8_0"   # llama.cpp's 8-bit groups of 32 (w = d*q), the engine's Q8_0 kernel (AVX2) or two int4 halves


class KVCacheDtype(str, Enum):
    """How the KV pool stores keys and values (core/model/kv_cache.py; vLLM's kv_cache_dtype)."""
    AUTO = "auto"   # bf16 where attention rounds its operands to bf16 (q4_1 on the engine's kernels), else fp32
    FP32 = "fp32"   # 4 bytes a value, what attention reads in every format
    BF16 = "bf16"   # 2 bytes a value, rounded as bf16 attention rounds them: the same bits, twice the tokens


class Scheduling(str, Enum):
    CONTINUOUS = "continuous"  # iteration-level: requests join and leave at every step (Orca)
    STATIC = "static"          # a batch runs until all its members finish (the old baseline)


class PreemptionMode(str, Enum):
    """How the scheduler takes blocks back when the KV pool runs short (core/engine/swap.py)."""
    RECOMPUTE = "recompute"  # free the blocks; prefill prompt and outputs again later
    SWAP = "swap"            # copy the blocks to a bounded host pool and back


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    block_size: int = 16                  # tokens per KV block (vLLM's default)
    num_kv_blocks: int | None = None      # None: as many as kv_cache_bytes buys
    kv_cache_bytes: int = 1 << 30         # KV pool size when num_kv_blocks is None (1 GiB)
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO  # auto, fp32 or bf16 (only where attention is bf16)
    max_num_seqs: int = 64                # requests running at once (batch slots)
    max_num_batched_tokens: int = 256     # token budget of one step (prefill chunks + decodes)
    chunk_context_tokens: int = 2048      # a prefill chunk at context c costs 1 + c/this budget tokens per token
                                          # (attention over c keys; 0: plain token count), see scheduler.py
    max_model_len: int | None = None      # context length; None: the model's own window
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling: Scheduling = Scheduling.CONTINUOUS
    num_threads: int | None = None        # the most torch threads the engine uses (None: one per core it may
                                          # run on)
    share_cpu: bool = True                # before each step, use only the cores other processes leave free
                                          # (cpu_share.py); False: num_threads (if set) all the time
    weight_format: WeightFormat = WeightFormat.FP32  # fp32 (reference), bf16, q8_0 or q4_1 (fastest)
    native: bool = True                   # the layers of a step in C++ (model/native_decoder.py): the same operations and
                                          # bits as model.py, less Python; False, or no compiler: Python
    kv_sink_tokens: int = 0               # KV eviction (StreamingLLM): the first tokens every query keeps seeing
    kv_window: int = 0                    # ... plus its last kv_window tokens; 0: full attention (see attention.py)
    lm_head_candidates: int = 64          # bf16/q8_0/q4_1: top logits recomputed exactly in fp32
    self_draft_layers: int | None = None  # layers of the self-speculation draft (engine/drafts.py);
                                          # None: a quarter of the model's
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE  # recompute or swap (see core/engine/swap.py)
    num_swap_blocks: int | None = None    # swap: the host pool's size in blocks (None: as many as the KV pool)
    trace_steps: int = 4096               # step-trace rows kept for the batching widgets
    seed: int = 0                         # seeds the generators of unseeded sampling requests
    cache_dir: str | None = None          # converted weights and tokenizer; None: ~/.cache/sendlens

    def __post_init__(self):
        try:
            self.scheduling = Scheduling(self.scheduling)
        except ValueError:
            raise InvalidParameter("scheduling", f"must be one of {[s.value for s in Scheduling]}, "
                                   f"got {self.scheduling!r}") from None
        try:
            self.preemption_mode = PreemptionMode(self.preemption_mode)
        except ValueError:
            raise InvalidParameter("preemption_mode", f"must be one of {[m.value for m in PreemptionMode]}, "
                                   f"got {self.preemption_mode!r}") from None
        try:
            self.kv_cache_dtype = KVCacheDtype(self.kv_cache_dtype)
        except ValueError:
            raise InvalidParameter("kv_cache_dtype", f"must be one of {[d.value for d in KVCacheDtype]}, "
                                   f"got {self.kv_cache_dtype!r}") from None
        try:
            self.weight_format = WeightFormat(self.weight_format)
        except ValueError:
            raise InvalidParameter("weight_format", f"must be one of {[f.value for f in WeightFormat]}, "
                                   f"got {self.weight_format!r}") from None
        for name in ("block_size", "lm_head_candidates", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes", "trace_steps"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InvalidParameter(name, f"must be a positive integer, got {value!r}")
        if not is_int(self.chunk_context_tokens) or self.chunk_context_tokens < 0:
            raise InvalidParameter("chunk_context_tokens", f"must be a non-negative integer (0: off), "
                                   f"got {self.chunk_context_tokens!r}")
        for name in ("kv_sink_tokens", "kv_window"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise InvalidParameter(name, f"must be a non-negative integer (0: off), got {value!r}")
        if self.kv_sink_tokens and not self.kv_window:
            raise InvalidParameter("kv_sink_tokens", "keeps tokens beside a sliding window: set kv_window too "
                                                     f"(kv_sink_tokens is {self.kv_sink_tokens}, kv_window 0)")
        for name in ("share_cpu", "native"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameter(name, f"must be true or false, got {getattr(self, name)!r}")
        for name in ("num_kv_blocks", "max_model_len", "num_threads", "self_draft_layers", "num_swap_blocks"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise InvalidParameter(name, f"must be a positive integer or None, got {value!r}")
