"""`smollm2-135m-moe16`: SmolLM2-135M with every MLP cut into 16 experts of 96 units and a learned
top-2 router per layer (MoEfication: Zhang et al., 2022, "MoEfication: Transformer Feed-forward
Layers are Mixtures of Experts").

Nothing here is trained but the routers. Each layer's 1,536 hidden units are reordered so that
the units of expert e sit at positions e*96 ... e*96+95 (which units go together was found by
clustering their activations on text), and the dense weights are cut along that order into the
experts' own matrices (core/model/moe.py's Experts). With all 16 experts every unit runs, and the layer
is the dense MLP again; the router chooses which 2 run for each token.

The shipped files in toy_models/data/ are small and remade by `python -m toy_models.train_router`:
- smollm2-135m-moe16.safetensors: per layer, `layers.<i>.units` (1,536 unit indices, int16, the
  experts one after another) and `layers.<i>.router` (16 x 576 fp32);
- smollm2-135m-moe16.json: the perplexity of the dense model and of top-k 1, 2, 4, 8 and 16 on
  held-out text, with the text's source and token counts.
`derive` turns any dense state dict and such files into the MoE model's (the widget `moe` does
it from the serving engine's own weights, one layer at a time).
"""

import dataclasses
import json
from pathlib import Path

import torch

from core.config import ModelConfig
from core.errors import InvalidParameter

from .registry import LoadedModel, load_smollm2

DATA = Path(__file__).resolve().parent / "data"
NAME = "smollm2-135m-moe16"
NUM_EXPERTS = 16          # experts per MLP
TOP_K = 2                 # experts the router picks per token
WEIGHTS_FILE = f"{NAME}.safetensors"
TABLE_FILE = f"{NAME}.json"


@dataclasses.dataclass
class RouterFiles:
    units: list[torch.Tensor]      # per layer: (I,) int64, the dense units in expert order
    routers: list[torch.Tensor]    # per layer: (E, C) fp32 router weights
    table: dict                    # the perplexity table and how it was made


def read_files(directory: Path | str = DATA) -> RouterFiles:
    from safetensors.torch import load_file

    directory = Path(directory)
    tensors = load_file(str(directory / WEIGHTS_FILE))
    layers = len([k for k in tensors if k.endswith(".router")])
    return RouterFiles(units=[tensors[f"layers.{i}.units"].long() for i in range(layers)],
                       routers=[tensors[f"layers.{i}.router"].float() for i in range(layers)],
                       table=json.loads((directory / TABLE_FILE).read_text()))


def write_files(directory: Path | str, units: list[torch.Tensor], routers: list[torch.Tensor], table: dict) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, (u, r) in enumerate(zip(units, routers)):
        tensors[f"layers.{i}.units"] = u.to(torch.int16).contiguous()
        tensors[f"layers.{i}.router"] = r.float().contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / TABLE_FILE).write_text(json.dumps(table, indent=1) + "\n")


def random_files(cfg: ModelConfig, num_experts: int = NUM_EXPERTS, seed: int = 0) -> RouterFiles:
    """For a model without trained routers (the random `tiny`): experts in unit order and random
    routers from a fixed seed, like its weights. No perplexity table."""
    g = torch.Generator().manual_seed(seed)
    return RouterFiles(units=[torch.arange(cfg.intermediate_size) for _ in range(cfg.num_layers)],
                       routers=[torch.randn(num_experts, cfg.hidden_size, generator=g) / cfg.hidden_size ** 0.5
                                for _ in range(cfg.num_layers)], table={})


def files_for(cfg: ModelConfig) -> RouterFiles:
    """The shipped files when they were made for this dense model, else random ones."""
    table = json.loads((DATA / TABLE_FILE).read_text())
    if table.get("dense_model") == cfg.name and table.get("num_layers") == cfg.num_layers:
        return read_files()
    return random_files(cfg)


def moe_config(cfg: ModelConfig, num_experts: int = NUM_EXPERTS, top_k: int = TOP_K) -> ModelConfig:
    name = cfg.name if cfg.num_experts else f"{cfg.name}-moe{num_experts}"
    return dataclasses.replace(cfg, name=name, num_experts=num_experts, num_experts_per_token=top_k)


def expert_weights(state_dict: dict, layer: int, units: torch.Tensor, num_experts: int) -> dict:
    """One layer's dense MLP cut into experts along `units`: -> {gate_up (E, 2F, C), down (E, C, F)}
    under the MoE model's names."""
    prefix = f"layers.{layer}.mlp."
    gate_up = state_dict[prefix + "gate_up_proj.weight"]                   # (2I, C)
    down = state_dict[prefix + "down_proj.weight"]                         # (C, I)
    (I, C), E = down.shape[::-1], num_experts
    if sorted(units.tolist()) != list(range(I)):
        raise InvalidParameter("units", f"layer {layer}: must order all {I} units once each")
    gate, up = gate_up[:I][units].view(E, I // E, C), gate_up[I:][units].view(E, I // E, C)
    return {prefix + "experts.gate_up": torch.cat([gate, up], dim=1),                    # (E, 2F, C)
            prefix + "experts.down": down[:, units].view(C, E, I // E).transpose(0, 1).contiguous()}  # (E, C, F)


def derive_layers(cfg: ModelConfig, state_dict: dict, files: RouterFiles, top_k: int = TOP_K):
    """The MoE model from a dense one, one layer per `next()` (about 20 ms each on SmolLM2): yields
    the layer done; returns (config, state dict). Tensors outside the MLPs are shared, not copied."""
    if len(files.routers) != cfg.num_layers or files.routers[0].shape[1] != cfg.hidden_size:
        raise InvalidParameter("model", f"the router files are for another model ({len(files.routers)} layers of "
                                        f"width {files.routers[0].shape[1]}), not {cfg.name}")
    E = files.routers[0].shape[0]
    sd = {k: v for k, v in state_dict.items() if ".mlp." not in k}
    for i in range(cfg.num_layers):
        sd.update(expert_weights(state_dict, i, files.units[i], E))
        sd[f"layers.{i}.mlp.router.weight"] = files.routers[i]
        yield i
    return moe_config(cfg, E, top_k), sd


def derive(cfg: ModelConfig, state_dict: dict, files: RouterFiles, top_k: int = TOP_K):
    """derive_layers all at once: -> (config, state dict)."""
    gen = derive_layers(cfg, state_dict, files, top_k)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def load_smollm2_moe16(cache_dir: Path | None = None) -> LoadedModel:
    """The entry point `smollm2-135m-moe16` (pyproject.toml): the dense model, cut into experts
    with the shipped router files."""
    dense = load_smollm2(cache_dir)
    cfg, sd = derive(dense.config, dense.state_dict, read_files())
    return LoadedModel(cfg, sd, dense.tokenizer,
                       source=f"{dense.source}; each MLP cut into {cfg.num_experts} experts of {cfg.expert_size} "
                              f"units with a trained top-{cfg.num_experts_per_token} router (MoEfication)")
