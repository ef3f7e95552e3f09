"""Build the model and the KV pool; turn one scheduled step into tensors, run the model over the
paged KV cache, return logits (after nano-vllm's ModelRunner).

At start the runner packs the loaded weights in the engine's format (core/model/linear.py), gives
the model the C++ kernels and decoder where they are built, keeps an fp32 reference model on the
same weights for the looking-inside widgets, and sizes the KV pool from the engine's byte budget
(in bf16 where attention reads bf16: kv_cache.py).
Before each step it sets torch's thread count (cpu_share.py), where the engine shares the CPU.

The scheduler says which sequences compute how many tokens; the runner packs those tokens into
one flat batch (ids, positions, the pool slot of each token's K and V, each sequence's block
table), runs the forward pass once, and keeps the logits only of each sequence whose computed
tokens reach its end (a finished prefill or a decode): only those sample a token this step. The
LM head is 49152 x 576, so skipping the other rows matters. Where the attention kernel is not
built, the runner also groups the sequences for attention.py's torch path (a long prefill chunk
in causal pieces).
"""

from dataclasses import dataclass

import numpy as np
import torch

from core.config import EngineConfig
from core.cpu_share import CpuShare
from core.kernels.loader import kernels
from core.model.attention import Eviction, PagedBatch, build_group, min_query_rows, plan_groups
from core.model.kv_cache import KVCache, bytes_per_value, kv_dtype
from core.model.model import Transformer
from core.model.native_decoder import native_decoder

# The torch path only: a prefill chunk attends as pieces of this many queries, each reading the
# keys up to its own last position only: a causal mask over one (n, n) square wastes half the
# products, pieces of 64 waste about 1/(2 * pieces) of them. Any split gives the same bits
# (attention.py pads keys and queries without changing a result), so this is a speed knob only.
PREFILL_PIECE = 64


@dataclass
class StepInput:
    input_ids: torch.Tensor    # (T,)
    positions: torch.Tensor    # (T,)
    batch: PagedBatch
    sample_rows: torch.Tensor  # (N,) packed index of the last token of each sampling sequence
    sample_seqs: list          # the engine's Sequences that sample a token, in row order


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded):
        """loaded: the model (config, state_dict); with `models` (model, reference model) set, as
        a sibling engine hands them over, those run as they are."""
        self.cpu_share = CpuShare(config.num_threads) if config.share_cpu else None
        if not config.share_cpu and config.num_threads:
            torch.set_num_threads(config.num_threads)
        mc = loaded.config
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
        # bf16 where attention reads bf16 and the block's slots pair up
        dtype = kv_dtype(config.kv_cache_dtype, self.model.attention_operands(), config.block_size)
        bytes_per_block = config.block_size * mc.kv_values_per_token * bytes_per_value(dtype)
        self.num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // bytes_per_block)
        self.cache = KVCache(mc.num_layers, self.num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        # Preemption by swap: a bounded host pool the preempted blocks wait in (core/engine/swap.py).
        self.host_cache = None
        if config.preemption_mode == "swap":
            self.host_cache = KVCache(mc.num_layers, config.num_swap_blocks or self.num_blocks, config.block_size,
                                      mc.num_kv_heads, mc.head_dim, dtype)
        self.block_size = config.block_size
        self.min_rows = min_query_rows(mc.num_heads, mc.num_kv_heads)
        self.kernel = kernels(mc)  # None: attention.py's torch path
        self.eviction = Eviction(config.kv_sink_tokens, config.kv_window)  # a mask in attention

    def fit_threads(self) -> None:
        """Before a step: torch's thread count to the cores other processes leave free (with share_cpu)."""
        if self.cpu_share is not None:
            self.cpu_share.update()

    def prepare(self, scheduled: list[tuple]) -> StepInput:
        """Plain Python and numpy over the scheduled sequences, then one tensor per field: the
        cost grows with the new tokens and the blocks they read, never with anything else."""
        bs = self.block_size
        ids, positions, slots, token_seq = [], [], [], []
        tables, entries = [], []
        sample_rows, sample_seqs = [], []
        t = 0
        for row, (seq, n) in enumerate(scheduled):
            start = seq.num_computed_tokens
            table = seq.block_table[: -(-(start + n) // bs)]     # the blocks this step reads
            tables.append(table)
            ids.extend(seq.token_ids[start:start + n])
            token_seq.extend([row] * n)
            if n == 1:                                         # a decode: one slot
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, start + n)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            if self.kernel is None:
                for off in range(0, n, PREFILL_PIECE):         # causal pieces (see above)
                    m = min(PREFILL_PIECE, n - off)
                    entries.append((t + off, m, start + off, table[: -(-(start + off + m) // bs)]))
            if start + n == seq.num_tokens:
                sample_rows.append(t + n - 1)
                sample_seqs.append(seq)
            t += n
        block_tables = np.zeros((len(tables), max(map(len, tables), default=0)), dtype=np.int64)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = table
        groups = [] if self.kernel else [build_group(g, bs, self.min_rows, self.eviction)
                                         for g in plan_groups(entries, bs, self.min_rows)]
        positions = torch.tensor(positions, dtype=torch.long)
        return StepInput(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=positions,
            batch=PagedBatch(self.cache, torch.tensor(slots, dtype=torch.long), torch.from_numpy(block_tables),
                             torch.tensor(token_seq, dtype=torch.long), positions, self.kernel, groups,
                             self.eviction),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
            sample_seqs=sample_seqs,
        )

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """-> logits (N, V) for step.sample_seqs, in that order."""
        hidden = self.model(step.input_ids, step.positions, step.batch)  # (T, C)
        if len(step.sample_seqs) == 0:
            return hidden.new_empty(0, self.model.config.vocab_size)
        return self.model.logits(hidden[step.sample_rows])               # (N, V)
