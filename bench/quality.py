"""The quantization table of `python -m bench`: each of our weight formats against fp32, in the
same run as the speed rows.

For every `ours <format>` engine of the run: the weight bytes a decode step reads, and on the held-out
text of the MoE perplexity table (toy_models/train_router.py's text_pieces: 8 pieces of 256 tokens
of Python's documentation topics, each its own sequence) the perplexity, the share of positions
whose top-5 next tokens are fp32's, and the mean KL(fp32 || format) (app/lab/formats.py, the
`quantization` widget's maths). The logits come from each engine's own model, whole sequences at a
time (Transformer.score: the format's products, its LM head with the top candidates recomputed).
"""

import math

import torch

from app.lab.formats import compare, nll_sum


def quantization_table(systems) -> dict:
    """{format: {weight_bytes, perplexity, top5_agreement, kl}} for our engines; {} without fp32."""
    from toy_models.train_router import Settings, text_pieces

    ours = {s.weight_format: s for s in systems if hasattr(s, "weight_format")}
    if "fp32" not in ours:
        return {}
    _, held, about = text_pieces(ours["fp32"].engine.view.tokenizer, Settings())
    with torch.inference_mode():
        reference = [ours["fp32"].engine.view.model.score(piece) for piece in held]
        table = {}
        for fmt, system in ours.items():
            model = system.engine.view.model
            logits = reference if fmt == "fp32" else [model.score(piece) for piece in held]
            nll = sum(nll_sum(lg, piece) for lg, piece in zip(logits, held))
            stats = compare(torch.cat(logits), torch.cat(reference))
            table[fmt] = {"weight_bytes": model.decode_weight_bytes(),
                          "perplexity": math.exp(nll / sum(len(p) - 1 for p in held)),
                          "top5_agreement": stats["top5_agreement"], "kl": stats["kl"]}
    return {"formats": table, "text": about["source"], "held_out": about["held_out"],
            "positions": sum(len(p) for p in held)}
