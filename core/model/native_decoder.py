"""The decoder's layers in C++ (core/kernels/csrc/decoder.cpp), for the engine's steps: the same
ATen operations as model.py, in the same order, and the same kernels of our own
(csrc/kernels.h: attention, RMSNorm, rotary embedding, SwiGLU's product, fp32, Q4_1 and Q8_0 products,
which model.py calls too), so the same bits, without Python.

A decode step of SmolLM2 is several hundred small tensor operations, and through Python each
costs more than the operation itself (the profile is in the README). Tracing or compiling the
forward was tried and dropped (torch.compile was slow to start and changed greedy tokens); this is
the forward written out once more, in C++, operation for operation, and a test holds it to the
Python one bit for bit in every weight format.

A step of at most 8 tokens in q4_1, on the engine's own kernel, goes further
(csrc/decode_step.cpp). That covers one reader decoding alone, a few readers, and a speculative
verify pass. Every layer runs in one parallel region: the threads split each phase's columns,
heads or groups and meet at barriers. Each value is computed by the same per-row function the
tensor kernels run (csrc/row_kernels.h), so the bits are the same again. The decoder's
`one_region_step` says whether this applies.

The extension is built and loaded by core/kernels/loader.py. A model with experts runs model.py's
Python with the kernels. Where the extension cannot be built, the engine runs model.py's Python
with attention.py's torch path (batch-invariant too, slower; it rounds differently).
"""

from core.config import WeightFormat
from core.kernels.loader import kernels
from core.model.attention import PagedBatch
from core.model.linear import Q4_GROUP, Product

FORMAT_CODES = {WeightFormat.FP32: 0, WeightFormat.BF16: 1, WeightFormat.Q4_1: 2, WeightFormat.Q8_0: 3}
PRODUCT_CODES = {Product.OWN: 0, Product.ONEDNN: 1, Product.PLAIN: 2}   # decoder.cpp's enum Product


class NativeDecoder:
    """A Transformer's dense layers as one C++ object, holding its tensors (no copies)."""

    def __init__(self, model, ext, num_layers: int | None = None):
        """num_layers: only the first layers (a self-speculation draft, core/engine/drafts.py)."""
        cfg = model.config
        fmt = model.weight_format
        products = model.layers[0].attn.qkv_proj.kernel   # every layer's are alike (linear.PackedLinear)
        layers = []
        for block in model.layers[:num_layers]:
            tensors = [block.attn_norm.weight, block.mlp_norm.weight]
            for linear in (block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj):
                tensors.extend(linear.kernel.tensors)
            layers.append(tensors)
        self.decoder = ext.Decoder(FORMAT_CODES[fmt], model.embed_tokens.weight, model.norm.weight,
                                   model.rotary.cos, model.rotary.sin, layers,
                                   cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                   PRODUCT_CODES[products.product], products.min_rows, Q4_GROUP)

    def forward(self, input_ids, positions, batch: PagedBatch):
        """As Transformer.forward with a PagedBatch: (T,), (T,) -> final hidden states (T, C)."""
        return self.decoder.forward(input_ids, positions, batch.cache.k, batch.cache.v, batch.slot_mapping,
                                    batch.block_tables, batch.token_seq, batch.eviction.sink_tokens,
                                    batch.eviction.window)


def native_decoder(model, num_layers: int | None = None) -> NativeDecoder | None:
    """The C++ decoder for `model` (or its first num_layers layers), or None where it cannot run
    (no build here, or experts)."""
    if model.config.num_experts:
        return None
    ext = kernels(model.config)
    return NativeDecoder(model, ext, num_layers) if ext is not None else None
