"""A Llama-style decoder in plain PyTorch, readable top to bottom (after nanoGPT's model.py).

SmolLM2-135M is a Llama: token embedding -> 30 x [RMSNorm -> grouped-query attention with RoPE
-> residual add -> RMSNorm -> SwiGLU MLP -> residual add] -> RMSNorm -> logits through the same
embedding matrix (tied). Shapes below: T tokens in the packed batch, C = hidden size, H query
heads and Hkv key/value heads of size D, V vocabulary.

The forward pass takes a packed batch of tokens from many sequences with explicit positions and
no padding, so one engine step can mix prefill chunks and decode tokens (see attention.py).
Without a PagedBatch it runs one whole sequence with plain causal attention. Nothing here knows
about the widgets: core/probes.py looks inside by running these modules itself, block by block.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import PagedBatch, causal_attention, paged_attention
from .gemm import linear
from .config import ModelConfig


class Linear(nn.Module):
    """y = x W^T through gemm.linear (batch-invariant); no bias. The weight starts empty:
    checkpoints load over it, so random initialisation would be wasted time."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x):
        return linear(x, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich, 2019): LayerNorm without the mean."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (T, C)
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Rotary(nn.Module):
    """Rotary position embedding (Su et al., 2021), in Llama's 'rotate half' layout.

    Dimension i of a head is paired with i + D/2 and the pair is rotated by position * theta^(-2i/D):
    fast rotations in the first pairs, slow ones in the last.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        angles = torch.outer(torch.arange(max_positions).float(), inv_freq)  # (P, D/2)
        angles = torch.cat([angles, angles], dim=-1)                         # (P, D)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, positions):  # x: (T, heads, D), positions: (T,)
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # q, k and v projections fused into one matrix: one matmul instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, (self.H + 2 * self.Hkv) * self.D)
        self.o_proj = Linear(self.H * self.D, cfg.hidden_size)

    def forward(self, x, positions, rotary, batch: PagedBatch | None):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
        q = rotary(q.view(T, self.H, self.D), positions)        # (T, H, D)
        k = rotary(k.view(T, self.Hkv, self.D), positions)      # (T, Hkv, D)
        v = v.view(T, self.Hkv, self.D)                         # (T, Hkv, D)
        if batch is not None:
            y = paged_attention(q, k, v, self.layer, batch)     # (T, H, D)
        else:
            y, _ = causal_attention(q, k, v)                    # (T, H, D)
        return self.o_proj(y.reshape(T, self.H * self.D))       # (T, C)


class MLP(nn.Module):
    """SwiGLU (Shazeer, 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)  # gate and up, fused
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):  # (T, C)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)          # (T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rotary, batch=None):  # x: (T, C)
        x = x + self.attn(self.attn_norm(x), positions, rotary, batch)
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

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> "Transformer":
        """Build with empty weights, then adopt the checkpoint's tensors (no copy)."""
        model = cls(cfg)
        model.load_state_dict(state_dict, strict=True, assign=True)
        return model.eval().requires_grad_(False)

    def forward(self, input_ids, positions, batch: PagedBatch | None = None):
        """input_ids, positions: (T,) -> final hidden states (T, C), normalized."""
        x = self.embed_tokens(input_ids)  # (T, C)
        for block in self.layers:
            x = block(x, positions, self.rotary, batch)
        return self.norm(x)

    def logits(self, hidden):  # (N, C) -> (N, V), through the tied embedding matrix
        return linear(hidden, self.embed_tokens.weight)

    @torch.inference_mode()
    def score(self, input_ids: list[int]) -> torch.Tensor:
        """Logits for every position of one sequence, no cache: (T, V)."""
        ids = torch.tensor(input_ids, dtype=torch.long)
        return self.logits(self.forward(ids, torch.arange(len(input_ids))))
