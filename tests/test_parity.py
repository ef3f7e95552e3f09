"""Our Transformer against transformers' LlamaForCausalLM, both loaded from the same GGUF file.

The reference dequantizes the GGUF itself (its own loader, its own un-permutation of Q and K),
so agreement checks our loader, our model and our engine at once.
"""

import pytest
import torch

from bounds import SPLIT_SUM_ERROR_RATIO, against_f64, llama_logits_f64
from core import SamplingParams
from core.model.model import Transformer

pytestmark = pytest.mark.real_model

PROMPT_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens, and watched the fishing boats come home across the grey water. "
    "Nobody in the village remembered a night when the light had failed. One winter the storm "
    "came early, and for three days the sea threw itself against the rocks below the tower."
)

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Give me three tips for learning to cook."}],
]


def prompt_64(tokenizer) -> list[int]:
    ids = tokenizer.encode(PROMPT_TEXT)[:64]
    assert len(ids) == 64
    return ids


def paged_logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits of every position, computed by the engine's own path (paged KV cache)."""
    seq = engine.make_sequence(ids, SamplingParams(temperature=0.0))
    engine.block_manager.allocate(seq, len(ids))
    try:
        step = engine.runner.prepare([(seq, len(ids))])
        with torch.inference_mode():
            return engine.view.model.logits(engine.view.model(step.input_ids, step.positions, step.batch))
    finally:
        engine.block_manager.free_blocks(seq)


@pytest.fixture(scope="module")
def reference_logits(hf_reference, smollm_loaded):
    hf_model, _ = hf_reference
    ids = prompt_64(smollm_loaded.tokenizer)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]
    assert logits.dtype == torch.float32
    return ids, logits.float()


# transformers' fp32 is the same function with other kernels (MKL's sgemm, SDPA's softmax): dot
# products of the same lengths, whose a-priori rounding bounds (gamma_n * sum |a b|) are the same
# whatever the order, and the same RoPE tables (fp32 angles, one rounded product each). So its
# error against float64 is the same kind and size as ours: at most SPLIT_SUM_ERROR_RATIO times it,
# plus 4 ulps of the logit scale (tests/bounds.py: against_f64). Measured on the machine, with the
# kernels it runs, so it holds on every CPU.
OTHER_KERNELS_ERROR_RATIO = SPLIT_SUM_ERROR_RATIO


@pytest.fixture(scope="module")
def fp32_error(smollm_loaded, reference_logits):
    """(our score's logits, float64 logits of the same weights, the fp32 bound on any two fp32
    implementations' difference: each within k * our error + floor of float64)."""
    ids, _ = reference_logits
    model = Transformer.from_state_dict(smollm_loaded.config, smollm_loaded.state_dict)
    ours = model.score(ids)
    exact = llama_logits_f64(model, ids)
    _, each, _ = against_f64(ours, ours, exact, OTHER_KERNELS_ERROR_RATIO)
    return ours, exact, 2 * each


def test_score_logits_match_transformers(smollm_loaded, reference_logits, fp32_error):
    ids, ref = reference_logits
    ours, exact, pair_bound = fp32_error
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape == (64, smollm_loaded.config.vocab_size)
    err_hf, bound, err_ours = against_f64(ref, ours, exact, OTHER_KERNELS_ERROR_RATIO)
    assert err_hf <= bound, (err_hf, bound, err_ours)     # transformers computes our function, to rounding
    assert (ours - ref).abs().max().item() <= pair_bound
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# Largest logit difference from transformers fp32 on the 64-token prompt, per weight format, for
# the logits recomputed exactly (each row's top candidates; fp32 computes all of them exactly).
# fp32: derived per run (fp32_error). bf16 and q4_1 round activations to bfloat16 on the way into
# every product: see format_bound.
LOGIT_BOUND = {"fp32": 1e-3, "bf16": 0.5, "q4_1": 0.5}


@pytest.fixture(scope="module", params=["fp32", "bf16", "q4_1"])
def engine_llm(request, smollm, smollm_loaded):
    if request.param == "fp32":
        return smollm
    from core import LLM
    return LLM("smollm2-135m", loaded=smollm_loaded, weight_format=request.param)


def test_engine_logits_match_transformers(engine_llm, reference_logits, fp32_error):
    ids, ref = reference_logits
    engine = engine_llm.engine
    fmt = engine.config.weight_format.value
    ours = paged_logits(engine, ids)
    bound = fp32_error[2] if fmt == "fp32" else LOGIT_BOUND[fmt]
    assert ours.shape == ref.shape
    k = engine.config.lm_head_candidates
    top = ours.topk(k, dim=-1).indices                  # the exactly recomputed logits
    diff = (ours.gather(-1, top) - ref.gather(-1, top)).abs().max().item()
    assert diff <= bound, f"{fmt}: {diff} > {bound}"
    if fmt == "fp32":
        assert (ours - ref).abs().max().item() <= bound
    # the same next token wherever the reference's choice is clear by more than the bound
    clear = margin(ref) > 2 * bound
    assert clear.sum() >= 16
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
    if fmt == "fp32":
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert engine.view.kv_stats()["free_blocks"] == engine.view.kv_stats()["total_blocks"]


def margin(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...): how far the best token leads the second."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def test_greedy_chat_continuations_match_generate(engine_llm, hf_reference):
    """fp32: every token equal. bf16 and q4_1 (rounded weights and activations) may part from the
    reference only at a step where transformers' own two best tokens are within the format's
    logit bound of each other, and must agree on every token before it."""
    smollm = engine_llm
    fmt = smollm.engine.config.weight_format.value
    hf_model, _ = hf_reference
    eos = smollm.engine.model_config.eos_token_id
    assert hf_model.generation_config.eos_token_id == eos
    prompts = [smollm.tokenizer.apply_chat_template(chat) for chat in CHATS]
    ours = smollm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48))
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            gen = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, max_new_tokens=48, pad_token_id=eos,
                                    return_dict_in_generate=True, output_scores=True)
        expected = gen.sequences[0, len(prompt):].tolist()
        assert out.prompt_token_ids == prompt
        if fmt != "fp32" and out.token_ids != expected:
            first = next(i for i, (a, b) in enumerate(zip(out.token_ids, expected)) if a != b)
            near_tie = margin(gen.scores[first][0].float()).item()
            assert near_tie < LOGIT_BOUND[fmt], (first, near_tie, smollm.tokenizer.decode(expected))
            continue
        assert out.token_ids == expected, smollm.tokenizer.decode(expected)
        if expected[-1] == eos:
            assert out.finish_reason == "stop" and out.stop_reason == eos
        else:
            assert len(expected) == 48 and out.finish_reason == "length"
    assert max(len(out.token_ids) for out in ours) == 48  # at least one ran the whole length
