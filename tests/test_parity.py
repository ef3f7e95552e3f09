"""Our Transformer against transformers' LlamaForCausalLM, both loaded from the same GGUF file.

The reference dequantizes the GGUF itself (its own loader, its own un-permutation of Q and K),
so agreement checks our loader, our model and our engine at once.
"""

import pytest
import torch

from bounds import OTHER_KERNELS_ERROR_RATIO, against_f64, clear_choices, format_roundings
from kernel_paths import AVX2, NATIVE, PATHS, use_path

from core import SamplingParams
from core.model.linear import q4_kernel_isa, q8_kernel

pytestmark = pytest.mark.real_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Give me three tips for learning to cook."}],
]


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
def reference_logits(hf_reference, logit_bounds):
    hf_model, _ = hf_reference
    ids = logit_bounds.ids                      # the first 64 tokens of bounds.REFERENCE_PROMPT
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]
    assert logits.dtype == torch.float32
    return ids, logits.float()


@pytest.fixture(scope="module")
def fp32_error(logit_bounds):
    """(our score's logits, float64 logits of the same weights, the fp32 bound on any two fp32
    implementations' difference: each within k * our error + floor of float64; tests/bounds.py's
    LogitBounds, OTHER_KERNELS_ERROR_RATIO)."""
    return logit_bounds.fp32, logit_bounds.exact, logit_bounds.fp32_pair


def test_score_logits_match_transformers(smollm_loaded, reference_logits, fp32_error):
    ids, ref = reference_logits
    ours, exact, pair_bound = fp32_error
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape == (64, smollm_loaded.config.vocab_size)
    err_hf, bound, err_ours = against_f64(ref, ours, exact, OTHER_KERNELS_ERROR_RATIO)
    assert err_hf <= bound, (err_hf, bound, err_ours)     # transformers computes our function, to rounding
    assert (ours - ref).abs().max().item() <= pair_bound
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def format_bound(logit_bounds, engine) -> float:
    """One number for the engine's weight format on the Q4_1 kernel path here (tests/bounds.py:
    LogitBounds.bound): fp32, twice k times our fp32 error against float64 plus a floor; bf16, q8_0
    and q4_1, the largest per-logit bound on the reference prompt's best candidates, from the
    spread of the format's roundings redrawn (the probabilistic model of rounding), plus the fp32 bound."""
    return logit_bounds.bound(engine.config.weight_format.value, q4_kernel_isa(), engine.config.lm_head_candidates)


# every weight format, and q4_1 once more on the AVX2 kernels where the CPU's own are AVX-512's
# (tests/kernel_paths.py): the same 8-bit rounding of activations, other instructions
ENGINES = ["fp32", "bf16", "q8_0", "q4_1"] + (["q4_1-avx2"] if AVX2 in PATHS else [])


@pytest.fixture(scope="module", params=ENGINES)
def engine_llm(request, smollm, smollm_loaded):
    if request.param == "fp32":
        yield smollm
        return
    if request.param == "q8_0" and q8_kernel() is None:
        # without it q8_0 runs as two 4-bit products on PyTorch's int4 kernel, which bounds.py does not emulate
        pytest.skip("q8_0's parity bound emulates the engine's Q8_0 kernel, which does not run here (no AVX2 or no C++ build)")
    from core import LLM
    fmt, _, path = request.param.partition("-")
    with pytest.MonkeyPatch.context() as patch:
        use_path(path or NATIVE, patch)          # the kernels stay this path's for the module's tests
        yield LLM("smollm2-135m", loaded=smollm_loaded, weight_format=fmt)


def test_engine_logits_match_transformers(engine_llm, reference_logits, logit_bounds):
    ids, ref = reference_logits
    engine = engine_llm.engine
    fmt = engine.config.weight_format.value
    ours = paged_logits(engine, ids)
    k = engine.config.lm_head_candidates
    # per logit: |ours - ref| <= bound, derived against float64 (tests/bounds.py: LogitBounds)
    bound = logit_bounds.logit_bound(fmt, q4_kernel_isa(), k)           # (T, V)
    assert ours.shape == ref.shape == bound.shape
    top = ours.topk(k, dim=-1).indices                  # the exactly recomputed logits ...
    best = ref.argmax(-1, keepdim=True)                 # ... and transformers' choice, which the bound covers too
    for idx in (top, best):
        diff = (ours.gather(-1, idx) - ref.gather(-1, idx)).abs().double()
        over = diff - bound.gather(-1, idx)
        assert over.max().item() <= 0, f"{fmt}: {diff.max().item()} over its bound by {over.max().item()}"
    if fmt == "fp32":
        assert (ours - ref).abs().max().item() <= logit_bounds.fp32_pair
    # the same next token wherever the reference's choice is clear of every other logit's bound
    clear = clear_choices(ref, bound)
    # a format that rounds activations to 8-bit integers per group (q4_1, and q8_0 with AVX-512
    # VNNI: llama.cpp's rounding) has a wide bound on SmolLM2, whose massive activations (~2e4)
    # set a group's step for its other 31 values: few choices are clear of it. Such a format is
    # judged by its quality figures against fp32 (test_8_bit_formats_quality_figures_...)
    assert clear.sum() >= (0 if rounds_to_8_bits(fmt) else 16), (fmt, int(clear.sum()))
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
    if fmt == "fp32":
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert engine.view.kv_stats()["free_blocks"] == engine.view.kv_stats()["total_blocks"]


def rounds_to_8_bits(fmt: str, isa: str | None = None) -> bool:
    """Whether weight format `fmt` rounds activations to 8-bit integers on kernel path `isa` (the
    one in use by default)."""
    return fmt != "fp32" and format_roundings(fmt, q4_kernel_isa() if isa is None else isa)[1] == "int8"


def margin(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...): how far the best token leads the second."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@pytest.fixture(scope="module")
def hf_generations(hf_reference, smollm):
    """transformers' greedy continuation of each chat in CHATS (48 new tokens, with their scores),
    computed once for the four weight formats' tests: {prompt token ids: generate's output}."""
    hf_model, _ = hf_reference
    eos = smollm.engine.model_config.eos_token_id
    out = {}
    for chat in CHATS:
        prompt = smollm.tokenizer.apply_chat_template(chat)
        with torch.no_grad():
            out[tuple(prompt)] = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=48, pad_token_id=eos,
                return_dict_in_generate=True, output_scores=True)
    return out


def test_greedy_chat_continuations_match_generate(engine_llm, hf_reference, hf_generations, logit_bounds):
    """fp32: every token equal. bf16, q8_0 and q4_1 (rounded weights and activations) may part from the
    reference only at a step where transformers' own two best tokens are within twice the format's
    logit bound of each other (each logit within the bound, so the lead moves by at most twice
    it), and must agree on every token before it."""
    smollm = engine_llm
    fmt = smollm.engine.config.weight_format.value
    hf_model, _ = hf_reference
    eos = smollm.engine.model_config.eos_token_id
    assert hf_model.generation_config.eos_token_id == eos
    prompts = [smollm.tokenizer.apply_chat_template(chat) for chat in CHATS]
    ours = smollm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48))
    for prompt, out in zip(prompts, ours):
        gen = hf_generations[tuple(prompt)]
        expected = gen.sequences[0, len(prompt):].tolist()
        assert out.prompt_token_ids == prompt
        if fmt != "fp32" and out.token_ids != expected:
            first = next(i for i, (a, b) in enumerate(zip(out.token_ids, expected)) if a != b)
            near_tie = margin(gen.scores[first][0].float()).item()
            assert near_tie < 2 * format_bound(logit_bounds, smollm.engine), (first, near_tie, smollm.tokenizer.decode(expected))
            continue
        assert out.token_ids == expected, smollm.tokenizer.decode(expected)
        if expected[-1] == eos:
            assert out.finish_reason == "stop" and out.stop_reason == eos
        else:
            assert len(expected) == 48 and out.finish_reason == "length"
    assert max(len(out.token_ids) for out in ours) == 48  # at least one ran the whole length


def eight_bit_engines() -> list[str]:
    """The engines of ENGINES that round activations to 8-bit integers here (rounds_to_8_bits, on
    each engine's kernel path): q4_1 on every path of the engine's kernel, q8_0 with AVX-512 VNNI."""
    from core.model.linear import q8_kernel
    out = []
    for name in ENGINES:
        fmt, _, path = name.partition("-")
        if (fmt != "q8_0" or q8_kernel() is not None) and rounds_to_8_bits(fmt, path or None):
            out.append(name)
    return out


@pytest.mark.parametrize("engine_llm", eight_bit_engines(), indirect=True)
def test_8_bit_formats_quality_figures_are_within_what_their_roundings_allow(engine_llm, logit_bounds):
    """q4_1 (and q8_0 where it rounds activations to 8 bits too: AVX-512 VNNI) is judged by its
    quality figures against fp32 (bench/quality.py, the `quantization` widget:
    app/lab/formats.compare): here on the reference prompt, against our fp32 logits. Its per-logit
    parity bound is wide (a logit's error is mostly a shift that all logits share, which the
    softmax ignores), so the figures are bounded directly: REDRAWS float32 runs of the network with
    the format's roundings redrawn (tests/bounds.py: LogitBounds.quality_bounds, the probabilistic
    model of rounding) give the top-5 agreement and KL the engine's one draw may show. The runs
    keep the LM head exact, where the engine's Q8_0 head rounds its input too (its top 64
    candidates recomputed exactly): that moves only logits outside the top 64, whose probabilities
    are too small to move the mean KL at the bound's scale."""
    engine = engine_llm.engine
    fmt = engine.config.weight_format.value
    if not rounds_to_8_bits(fmt):
        raise ValueError(f"engine_llm: {fmt} rounds no activations to 8 bits here (eight_bit_engines chose it)")
    from app.lab.formats import compare
    stats = compare(paged_logits(engine, logit_bounds.ids), logit_bounds.fp32)
    lowest_top5, highest_kl = logit_bounds.quality_bounds(fmt, q4_kernel_isa())
    assert stats["top5_agreement"] >= lowest_top5, (fmt, stats["top5_agreement"], lowest_top5)
    assert 0 < stats["kl"] <= highest_kl, (fmt, stats["kl"], highest_kl)
