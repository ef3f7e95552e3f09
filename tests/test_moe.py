"""core/model/moe.py: the mixture-of-experts MLP. All experts together are the dense MLP; the grouped
product equals a plain per-token sum of its experts; a token gets the same result alone and
batched; the engine serves smollm2-135m-moe16 with the same tokens alone and batched, and the
same as a plain uncached greedy loop over the model."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bounds import SPLIT_SUM_ERROR_RATIO, against_f64, gamma, llama_logits_f64, swiglu_f32_bound
from core.config import ModelConfig
from core.errors import InvalidParameter
from core.model.model import Transformer
from core.model.moe import MoEMLP, batch_split, route
from toy_models.moe import derive, random_files, read_files


def moe_of(loaded, files=None, k: int = 2):
    cfg, sd = derive(loaded.config, loaded.state_dict, files or random_files(loaded.config))
    return Transformer.from_state_dict(dataclasses.replace(cfg, num_experts_per_token=k), sd)


def expert_by_hand(mlp: MoEMLP, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e on one row, written out: down_e(silu(gate_e x) * (up_e x))."""
    F_ = mlp.experts.down.shape[2]
    gate, up = mlp.experts.gate_up[e, :F_], mlp.experts.gate_up[e, F_:]
    return mlp.experts.down[e] @ (F.silu(gate @ x) * (up @ x))


def test_the_grouped_product_is_each_tokens_sum_of_its_experts(tiny_loaded):
    mlp = moe_of(tiny_loaded, k=3).layers[1].mlp
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(0))
    out = mlp(x)
    chosen = (x @ mlp.router.weight.T).topk(3, dim=-1).indices                 # (T, 3), by hand
    F_ = mlp.experts.down.shape[2]
    for t in range(11):
        expected = sum(expert_by_hand(mlp, int(e), x[t]) for e in chosen[t])
        # both are fp32 evaluations of the same three SwiGLU experts, summed in other orders: each
        # within swiglu_f32_bound of the exact value per expert, plus the 2 adds of the experts'
        # results (gamma_2 * sum |expert|): tests/bounds.py
        per = [(swiglu_f32_bound(x[t:t + 1], mlp.experts.gate_up[e, :F_], mlp.experts.gate_up[e, F_:],
                                 mlp.experts.down[e]), expert_by_hand(mlp, int(e), x[t]).double().abs())
               for e in chosen[t]]
        bound = sum(b[0] + gamma(2) * a for b, a in per)
        assert ((out[t].double() - expected.double()).abs() <= 2 * bound).all()
    assert route(mlp.router(x), 3).tolist() == chosen.sort(-1).values.tolist()


def test_every_expert_together_is_the_dense_mlp(tiny_loaded):
    dense = Transformer.from_state_dict(tiny_loaded.config, tiny_loaded.state_dict)
    files = random_files(tiny_loaded.config)
    files.units = [torch.randperm(128, generator=torch.Generator().manual_seed(i)) for i in range(2)]  # any order
    moe = moe_of(tiny_loaded, files, k=16)
    x = torch.randn(9, 64)
    E = moe.config.num_experts
    for block, moe_block in zip(dense.layers, moe.layers):
        # two fp32 evaluations of one SwiGLU MLP: the dense one, and the experts' (its down sum cut
        # into E chains, then E - 1 adds): each within swiglu_f32_bound of the exact value
        I = block.mlp.down_proj.weight.shape[1]
        wg, wu = block.mlp.gate_up_proj.weight[:I], block.mlp.gate_up_proj.weight[I:]
        bound = swiglu_f32_bound(x, wg, wu, block.mlp.down_proj.weight, extra_roundings=E)
        assert ((block.mlp(x).double() - moe_block.mlp(x).double()).abs() <= 2 * bound).all()
    ids = tiny_loaded.tokenizer.encode("Experts, all together, are the dense model again.")
    # the whole model: the experts' error against float64 at most SPLIT_SUM_ERROR_RATIO times the
    # dense model's own (tests/bounds.py: the same arithmetic, one sum per MLP cut into chains)
    err, bound, err_dense = against_f64(moe.score(ids), dense.score(ids), llama_logits_f64(dense, ids),
                                        SPLIT_SUM_ERROR_RATIO)
    assert err <= bound, (err, bound, err_dense)


def test_a_token_gets_the_same_result_alone_and_batched(tiny_loaded):
    mlp = moe_of(tiny_loaded, k=2).layers[0].mlp
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(3))
    batched = mlp(x)
    for t in (0, 5, 22):
        assert torch.equal(mlp(x[t:t + 1]), batched[t:t + 1])
    assert torch.equal(mlp(x[4:13]), batched[4:13])


def test_bad_settings_are_refused_by_name():
    with pytest.raises(InvalidParameter) as err:
        MoEMLP(ModelConfig(name="t", intermediate_size=100, num_experts=16, num_experts_per_token=2))
    assert err.value.param == "num_experts"
    with pytest.raises(InvalidParameter) as err:
        MoEMLP(ModelConfig(name="t", num_experts=16, num_experts_per_token=17))
    assert err.value.param == "num_experts_per_token"
    with pytest.raises(InvalidParameter) as err:
        route(torch.zeros(3, 16), 0)
    assert err.value.param == "top_k"


def test_batch_split_counts_like_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    chosen = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(40)])   # (40, 2)
    s = batch_split(chosen, 16, [1, 8, 40], draws=4, seed=7)
    g = torch.Generator().manual_seed(7)
    for i, B in enumerate([1, 8, 40]):
        largest, used = [], []
        for _ in range(4):
            counts = {}
            for t in torch.randperm(40, generator=g)[:B].tolist():
                for e in chosen[t].tolist():
                    counts[e] = counts.get(e, 0) + 1
            largest.append(max(counts.values()))
            used.append(len(counts))
        # batch_split adds the same numbers in the same order (whole counts: exact) and divides once: equal
        assert s["largest"][i] == sum(largest) / 4
        assert s["active"][i] == sum(used) / 4
        assert s["mean_active"][i] == sum(B * 2 / u for u in used) / 4
        assert s["even"][i] == B * 2 / 16


@pytest.mark.real_model
def test_all_16_experts_equal_dense_on_the_real_model(smollm_loaded):
    dense = Transformer.from_state_dict(smollm_loaded.config, smollm_loaded.state_dict)
    moe = moe_of(smollm_loaded, read_files(), k=16)
    ids = smollm_loaded.tokenizer.encode("The lighthouse keeper climbed the stairs to light the lamp, as every night.")
    inputs = [[] for _ in dense.layers]
    hooks = [b.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs[i].append(a[0])) for i, b in enumerate(dense.layers)]
    with torch.inference_mode():
        dense_logits = dense.score(ids)
    for h in hooks:
        h.remove()
    E = moe.config.num_experts
    with torch.inference_mode():
        for i, (block, moe_block) in enumerate(zip(dense.layers, moe.layers)):      # each layer, the same input
            x = inputs[i][0]
            # two fp32 evaluations of one SwiGLU MLP (the dense one, and the experts' with its down
            # sum cut into E chains, then E - 1 adds), each within swiglu_f32_bound of the exact
            # value; some layers' outputs reach ~22,000 (SmolLM2's massive activations)
            I = block.mlp.down_proj.weight.shape[1]
            wg, wu = block.mlp.gate_up_proj.weight[:I], block.mlp.gate_up_proj.weight[I:]
            bound = swiglu_f32_bound(x, wg, wu, block.mlp.down_proj.weight, extra_roundings=E)
            assert ((block.mlp(x).double() - moe_block.mlp(x).double()).abs() <= 2 * bound).all(), i
        moe_logits = moe.score(ids)
    # the whole model: the experts' error against float64 at most SPLIT_SUM_ERROR_RATIO times the
    # dense model's own (tests/bounds.py: the same arithmetic, one sum per MLP cut into chains)
    err, bound, err_dense = against_f64(moe_logits, dense_logits, llama_logits_f64(dense, ids), SPLIT_SUM_ERROR_RATIO)
    assert err <= bound, (err, bound, err_dense)
    assert torch.equal(moe_logits.argmax(-1), dense_logits.argmax(-1))


@pytest.fixture(scope="module")
def moe_loaded():
    from core.registry import load
    return load("smollm2-135m-moe16")


@pytest.mark.real_model
def test_the_engine_serves_the_moe_model_alone_and_batched(moe_loaded):
    from core import LLM, SamplingParams
    cfg = moe_loaded.config
    assert (cfg.name, cfg.num_experts, cfg.num_experts_per_token, cfg.expert_size) == ("smollm2-135m-moe16", 16, 2, 96)
    llm = LLM("smollm2-135m-moe16", loaded=moe_loaded)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time there"]
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert alone == batched
    # the engine (paged KV, one token a step) against the model's plain uncached forward, greedy
    model = llm.engine.view.model
    for p, got in zip(prompts, alone):
        ids = llm.tokenizer.encode(p)
        for _ in range(6):
            ids.append(int(model.score(ids)[-1].argmax()))
        assert ids[-6:] == got


@pytest.mark.real_model
@pytest.mark.parametrize("weight_format", ["bf16", "q4_1"])
def test_the_moe_model_is_batch_invariant_in_every_format(moe_loaded, weight_format):
    from core import LLM, SamplingParams
    llm = LLM("smollm2-135m-moe16", loaded=moe_loaded, weight_format=weight_format)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = ["Hello there", "The sky is"]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [llm.generate(p, params)[0].token_ids for p in prompts]
    # the rounding the pages name is every product's, the experts' included
    from core.model.moe import Experts
    model = llm.engine.view.model
    experts = [k.activation_rounding for m in model.modules() if isinstance(m, Experts) for pair in m.kernels for k in pair]
    assert experts and set(experts) == {model.activation_rounding()} == {llm.engine.view.info()["activation_rounding"]}
