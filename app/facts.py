"""The running model's figures for the walkthrough's prose: the {name} placeholders of content/.

facts(info) widens the engine's info() (its model config and pool) with the figures the prose
quotes that are derived from it, so a text about the tiny test model says what is true of it.
"""
from types import SimpleNamespace


def facts(info: dict) -> dict:
    """The running model's figures for the prose's {placeholders}, from the engine's info()."""
    real = info["model"].startswith("smollm2-135m")
    embedding = info["vocab_size"] * info["hidden_size"]
    return {**info,
            "model_label": ("SmolLM2-135M-Instruct" + (" (cut into experts)" if "moe" in info["model"] else "")
                            if real else f"the {info['model']} model"),
            "moe_expert_units": info["intermediate_size"] // 16,   # the moe widget's 16 experts
            "group": info["num_heads"] // info["num_kv_heads"],
            "rope_pairs": info["head_dim"] // 2,
            "kv_values_per_token": 2 * info["num_layers"] * info["num_kv_heads"] * info["head_dim"],
            "kv_context_mb": info["kv_bytes_per_token"] * info["context_window"] / 1e6,
            "weights_mb": info["num_params"] * info.get("bytes_per_weight", 4) / 1e6,
            "embedding_params_m": embedding / 1e6,
            "embedding_share": f"{embedding / info['num_params']:.0%}",
            "block_size_minus_one": info["block_size"] - 1,
            "allreduces_per_pass": 2 * info["num_layers"],
            **tensor_parallel_degrees(info["num_heads"], info["num_kv_heads"])}


def tensor_parallel_degrees(num_heads: int, num_kv_heads: int, up_to: int = 4) -> dict:
    """The degrees up to `up_to` that split the heads into whole groups, and those refused, in words."""
    from core.parallel.tensor_parallel import split_error

    def words(ns: list[int]) -> str:
        return " and ".join(map(str, ns)) if len(ns) < 3 else ", ".join(map(str, ns[:-1])) + f" and {ns[-1]}"

    heads = SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads)
    ok = [n for n in range(1, up_to + 1) if split_error(heads, n) is None]
    refused = [n for n in range(1, up_to + 1) if n not in ok]
    note = (f"the widget shows {words(refused)} but refuses to run {'them' if len(refused) > 1 else 'it'}"
            if refused else f"every degree up to {up_to} runs")
    return {"tp_degrees": words(ok), "tp_refused_note": note}
