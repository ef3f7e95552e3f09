"""Widget `block` (section 5): the stack of transformer blocks, measured on the reader's text.

Each block reads the residual stream and adds two updates to it, attention's and the MLP's (the
residual-stream view of Elhage et al., 2021, "A Mathematical Framework for Transformer Circuits"):

    x = x + Attention(RMSNorm(x));  x = x + SwiGLU_MLP(RMSNorm(x))

Message: `layers` {text} -> a job that runs the probe pass (core/inspect/probes.py) one slice at a time,
with Progress per layer, and answers for every layer and every token: the L2 norm of the residual
stream after the block, the sizes of the two updates, and the entropy of the token's attention row
(mean over heads; plus each head's entropy averaged over tokens). `embedding_norm` is the residual
stream before the first block.
"""

import torch

from core.inspect import probes

from ..jobs import Progress
from .base import Widget, encode, message, rounded, text


def layers(call) -> None:
    ids = encode(call, text(call.msg))
    inputs = {"ids": ids}

    def work(engine):
        return (yield from layers_job(engine, ids))
    call.job(inputs, work)


def layers_job(engine, ids: list[int]):
    model = engine.view.reference_model
    L = model.config.num_layers
    residual, attn_update, mlp_update, entropy, head_entropy = [], [], [], [], []
    for item in probes.slices(model, ids):
        if item is None:
            yield None
            continue
        h = item.entropy                                   # (H, T) nats, one per head and token
        residual.append(item.residual)                     # (T,)
        attn_update.append(item.attn_update)               # (T,)
        mlp_update.append(item.mlp_update)                 # (T,)
        entropy.append(h.mean(dim=0))                      # (T,)
        head_entropy.append(h.mean(dim=1))                 # (H,)
        yield Progress(item.layer + 1, L, f"layer {item.layer + 1} of {L}")
    with torch.inference_mode():
        embedding = model.embed_tokens(torch.tensor(ids, dtype=torch.long)).norm(dim=-1)  # (T,)
    mean_entropy = torch.stack(entropy).mean(dim=1)        # (L,)
    return {
        "tokens": [{"id": i, "text": t} for i, t in zip(ids, engine.view.tokenizer.token_texts(ids))],
        "num_layers": L,
        "embedding_norm": rounded(embedding),
        "residual_norm": rounded(torch.stack(residual)),           # (L, T)
        "attn_update_norm": rounded(torch.stack(attn_update)),     # (L, T)
        "mlp_update_norm": rounded(torch.stack(mlp_update)),       # (L, T)
        "attention_entropy": rounded(torch.stack(entropy)),        # (L, T), mean over heads
        "head_entropy": rounded(torch.stack(head_entropy)),        # (L, H), mean over tokens
        "mean_entropy": rounded(mean_entropy),                     # (L,)
        "max_entropy_layer": int(mean_entropy.argmax()),
    }


WIDGET = Widget("block", messages=(
    message("layers", {"text"}, layers, job=True),
))
