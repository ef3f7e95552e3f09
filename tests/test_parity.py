"""Our Transformer against transformers' LlamaForCausalLM, both loaded from the same GGUF file.

The reference dequantizes the GGUF itself (its own loader, its own un-permutation of Q and K),
so agreement checks our loader, our model and our engine at once.
"""

import pytest
import torch

from core import SamplingParams
from core.model import Transformer

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
            return engine.model.logits(engine.model(step.input_ids, step.positions, step.batch))
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


def test_score_logits_match_transformers(smollm_loaded, reference_logits):
    ids, ref = reference_logits
    model = Transformer.from_state_dict(smollm_loaded.config, smollm_loaded.state_dict)
    ours = model.score(ids)
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape == (64, smollm_loaded.config.vocab_size)
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_engine_logits_match_transformers(smollm, reference_logits):
    ids, ref = reference_logits
    ours = paged_logits(smollm.engine, ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-3
    assert smollm.engine.kv_stats()["free_blocks"] == smollm.engine.kv_stats()["total_blocks"]


def test_greedy_chat_continuations_match_generate(smollm, hf_reference):
    hf_model, _ = hf_reference
    eos = smollm.engine.model_config.eos_token_id
    assert hf_model.generation_config.eos_token_id == eos
    prompts = [smollm.tokenizer.apply_chat_template(chat) for chat in CHATS]
    ours = smollm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48))
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            gen = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, max_new_tokens=48, pad_token_id=eos)
        expected = gen[0, len(prompt):].tolist()
        assert out.prompt_token_ids == prompt
        assert out.token_ids == expected, smollm.tokenizer.decode(expected)
        if expected[-1] == eos:
            assert out.finish_reason == "stop" and out.stop_reason == eos
        else:
            assert len(expected) == 48 and out.finish_reason == "length"
    assert max(len(out.token_ids) for out in ours) == 48  # at least one ran the whole length
