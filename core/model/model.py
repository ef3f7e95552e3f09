"""A Llama-style decoder in plain PyTorch, readable top to bottom (after nanoGPT's model.py).

SmolLM2-135M is a Llama: token embedding -> 30 x [RMSNorm -> grouped-query attention with RoPE
-> residual add -> RMSNorm -> SwiGLU MLP -> residual add] -> RMSNorm -> logits through the same
embedding matrix (tied). A config with experts (num_experts > 0) gets a mixture-of-experts MLP in
every block instead (moe.py). Shapes below: T tokens in the packed batch, C = hidden size, H query
heads and Hkv key/value heads of size D, V vocabulary.

The linear layers keep their fp32 weight (what checkpoints load and the widgets read) and
multiply through a PackedLinear in the engine's weight format (fp32, bf16, q8_0 or q4_1, see linear.py).
Activations and the residual stream stay fp32; bf16 and q4_1 products come back in bfloat16 and
are promoted where they join fp32 tensors. The LM head in bf16, q8_0 and q4_1 is approximate, and the
top `lm_head_candidates` logits of each row are then recomputed exactly in fp32 (so greedy
decoding picks what fp32 would, and sampling reads exact logits where the mass is).

The forward pass takes a packed batch of tokens from many sequences with explicit positions and
no padding, so one engine step can mix prefill chunks and decode tokens (see attention.py).
Without a PagedBatch it runs one whole sequence with plain causal attention. Nothing here knows
about the widgets: core/inspect/probes.py looks inside by running these modules itself, block by block.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.config import ModelConfig, WeightFormat
from core.model.attention import FULL, Eviction, PagedBatch, causal_attention, paged_attention
from core.model.linear import ActivationRounding, PackedLinear, PackedQ8_0, Product, linear
from core.model.moe import Experts, MoEMLP


class Linear(nn.Module):
    """y = x W^T, batch-invariant, in the model's weight format (gemm.PackedLinear); no bias.
    The weight starts empty: checkpoints load over it, so random initialisation would be wasted
    time. Until pack() is called the product runs in fp32."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.kernel: PackedLinear | None = None

    def pack(self, fmt: WeightFormat, product: Product | None = None) -> None:
        self.kernel = PackedLinear(fmt, self.weight.detach(), product=product)

    def forward(self, x):  # (N, in) -> (N, out): fp32, or bfloat16 for bf16 (and q4_1 on PyTorch's int4)
        if self.kernel is None:
            return linear(x, self.weight)
        return self.kernel(x)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich, 2019): LayerNorm without the mean, each row on its
    own: torch's rms_norm, or the engine's kernel (csrc/rms_norm.cpp, one pass) once
    Transformer.use_kernels has set it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel = None

    def forward(self, x):  # (T, C)
        if self.kernel is not None:
            return self.kernel.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al., 2021), in Llama's 'rotate half' layout.

    Dimension i of a head is paired with i + D/2 and the pair is rotated by position * theta^(-2i/D):
    fast rotations in the first pairs, slow ones in the last.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        angles = torch.outer(torch.arange(max_positions).float(), inv_freq)  # (P, D/2)
        self.register_buffer("cos", torch.cat([angles.cos(), angles.cos()], dim=-1), persistent=False)
        # rotate half: (x1, x2) -> (-x2, x1), written as (x2, x1) * (-sin, sin)
        self.register_buffer("sin", torch.cat([-angles.sin(), angles.sin()], dim=-1), persistent=False)
        self._last = (None, None, None)  # (positions, cos, sin): the layers of a step share them
        self.kernel = None               # the engine's kernel (csrc/rotary.cpp), set by use_kernels

    def forward(self, x, positions):  # x: (T, heads, D), positions: (T,)
        if self.kernel is not None:
            return self.kernel.rotary(x, self.cos, self.sin, positions)  # the same, in one pass
        last, cos, sin = self._last
        if positions is not last:
            cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # (T, 1, D)
            self._last = (positions, cos, sin)
        half = x.shape[-1] // 2
        swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
        return x * cos + swapped * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # q, k and v projections fused into one matrix: one matmul instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, (self.H + 2 * self.Hkv) * self.D)
        self.o_proj = Linear(self.H * self.D, cfg.hidden_size)

    def forward(self, x, positions, rotary, batch: PagedBatch | None, eviction: Eviction = FULL):
        T, H, Hkv, D = x.shape[0], self.H, self.Hkv, self.D
        qkv = self.qkv_proj(x).to(x.dtype)                       # (T, (H + 2 Hkv) D): bf16 products promoted
        qk = rotary(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), positions)  # q and k at once
        q, k = qk[:, :H], qk[:, H:]                              # (T, H, D), (T, Hkv, D)
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)               # (T, Hkv, D)
        if batch is not None:
            y = paged_attention(q, k, v, self.layer, batch, self.bf16_operands)   # (T, H, D)
        else:
            y, _ = causal_attention(q, k, v, eviction, self.bf16_operands)       # (T, H, D)
        return self.o_proj(y.reshape(T, H * D))                 # (T, C)

    @property
    def bf16_operands(self) -> bool:
        """Whether attention rounds its operands to bfloat16 (attention.py): q4_1 on the engine's
        own products, as the C++ decoder decides it too."""
        kernel = self.qkv_proj.kernel
        return kernel is not None and kernel.format is WeightFormat.Q4_1 and kernel.product is Product.OWN


class MLP(nn.Module):
    """SwiGLU (Shazeer, 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)  # gate and up, fused
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.kernel = None  # the engine's kernel (csrc/silu_mul.cpp), set by use_kernels

    def forward(self, x):  # (T, C)
        if self.kernel is not None:
            return self.down_proj(self.kernel.silu_mul(self.gate_up_proj(x)))  # the same, in one pass
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)          # (T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEMLP(cfg) if cfg.num_experts else MLP(cfg)   # experts and a router (moe.py), or one MLP

    def forward(self, x, positions, rotary, batch=None, eviction: Eviction = FULL):  # x: (T, C)
        x = x + self.attn(self.attn_norm(x), positions, rotary, batch, eviction)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.weight_format = WeightFormat.FP32
        self.lm_head_candidates = 0
        self.lm_head = None  # once packed: a PackedLinear (fp32, bf16), or for q4_1 and q8_0 Q8_0 (PackedQ8_0)
        self.native = None   # the same layers in C++ for the engine's paged batches (native.py), if built
        self.head_kernel = None  # the engine's extension, for the LM head's candidates (csrc/lm_head.cpp)

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state_dict: dict[str, torch.Tensor],
                        weight_format: WeightFormat | str = WeightFormat.FP32,
                        lm_head_candidates: int = 64, packed: bool = True) -> "Transformer":
        """Build with empty weights, then adopt the checkpoint's tensors (no copy), and pack the
        linear layers' weights in `weight_format` (gemm.PackedLinear). packed=False (fp32 only)
        keeps the plain tensors and multiplies them as they are: no copy at all."""
        model = cls(cfg)
        model.load_state_dict(state_dict, strict=True, assign=True)
        model = model.eval().requires_grad_(False)
        fmt = WeightFormat(weight_format)
        if packed or fmt is not WeightFormat.FP32:
            model.pack(fmt, lm_head_candidates)
        return model

    def pack(self, fmt: WeightFormat, lm_head_candidates: int = 64) -> None:
        self.weight_format = fmt
        self.lm_head_candidates = lm_head_candidates
        for module in self.modules():
            if isinstance(module, (Linear, Experts)):
                module.pack(fmt)
        emb = self.embed_tokens.weight
        eight_bit = fmt in (WeightFormat.Q4_1, WeightFormat.Q8_0)   # the file's Q8_0 embedding, as llama.cpp
        self.lm_head = PackedQ8_0(emb) if eight_bit else PackedLinear(fmt, emb)

    def use_kernels(self, ext) -> None:
        """Normalize, rotate and gate with the engine's kernels (native.kernels(); None: torch's),
        as the C++ decoder does, so that the Python forward gives its bits; and recompute the LM
        head's candidates with its kernel (csrc/lm_head.cpp)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Rotary, MLP)):
                module.kernel = ext
        self.head_kernel = ext

    def reference(self) -> "Transformer":
        """The same model multiplying in fp32: a second set of modules over the same fp32 weight
        tensors (no copy, not prepacked), for the widgets that look inside and compare with
        transformers. Itself when the model is fp32 already."""
        if self.weight_format is WeightFormat.FP32:
            return self
        return Transformer.from_state_dict(self.config, self.state_dict(), WeightFormat.FP32, packed=False)

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step of a dense model reads: every linear layer's in its
        format, and the LM head's (the tied embedding, or its packed copy)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        head = self.embed_tokens.weight.nbytes if self.lm_head is None else self.lm_head.nbytes
        return sum(m.kernel.nbytes if m.kernel else m.weight.nbytes for m in linears) + head

    def activation_rounding(self) -> str:
        """How the linear layers' products round their activations (linear.ActivationRounding):
        the one way they all share, "mixed" where layers differ (a width the kernels cannot take)."""
        none = ActivationRounding.NONE.value
        kinds = {m.kernel.activation_rounding if m.kernel else none for m in self.modules() if isinstance(m, Linear)}
        for m in self.modules():                                  # an MoE layer's experts
            if isinstance(m, Experts):
                kinds |= {k.activation_rounding for pair in m.kernels for k in pair} if m.kernels else {none}
        return kinds.pop() if len(kinds) == 1 else ActivationRounding.MIXED.value

    def attention_operands(self) -> str:
        """How attention rounds its operands (attention.py): "bf16" (q4_1 on the engine's own
        products: Attention.bf16_operands) or "fp32"; the pages say it beside the format."""
        return "bf16" if self.layers[0].attn.bf16_operands else "fp32"

    def forward(self, input_ids, positions, batch: PagedBatch | None = None, eviction: Eviction = FULL):
        """input_ids, positions: (T,) -> final hidden states (T, C), normalized. Without a batch,
        one whole sequence under `eviction` (a paged batch carries its engine's own)."""
        if batch is not None and self.native is not None:
            return self.native.forward(input_ids, positions, batch)  # the code below, in C++
        x = self.embed_tokens(input_ids)  # (T, C)
        for block in self.layers:
            x = block(x, positions, self.rotary, batch, eviction)
        return self.norm(x)

    def logits(self, hidden):  # (N, C) -> (N, V), through the tied embedding matrix
        emb = self.embed_tokens.weight                                    # (V, C)
        if self.lm_head is None:
            return linear(hidden, emb)
        if self.weight_format is WeightFormat.FP32:
            return self.lm_head(hidden)
        logits = self.lm_head(hidden).float()                             # (N, V), rows independent
        k = min(self.lm_head_candidates, logits.shape[-1])
        if k and self.head_kernel is not None:                           # the same, in one pass a row
            self.head_kernel.rescore_top(logits, emb, hidden.float().contiguous(), k)
        elif k:
            top = logits.topk(k, dim=-1, sorted=False).indices           # (N, k)
            exact = (emb[top] * hidden[:, None, :]).sum(-1)              # (N, k), fp32
            logits.scatter_(-1, top, exact)
        return logits

    @torch.inference_mode()
    def score(self, input_ids: list[int], eviction: Eviction = FULL) -> torch.Tensor:
        """Logits for every position of one sequence, no cache: (T, V)."""
        ids = torch.tensor(input_ids, dtype=torch.long)
        return self.logits(self.forward(ids, torch.arange(len(input_ids)), eviction=eviction))

