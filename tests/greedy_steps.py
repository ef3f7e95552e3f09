"""Greedy tokens against transformers, step by step: what the real-model widget tests claim about
the engine and the model.

A widget's greedy tokens come from the engine in the server's weight format (q4_1). Its logits lie
within the format's derived bound B of transformers' fp32 logits (tests/bounds.py:
LogitBounds.bound, the probabilistic model of rounding for q4_1; twice our fp32 error against
float64 for fp32). At a step where transformers' best token leads its second by more than 2B, the
engine makes the same choice (each of the two logits may move by B, in opposite directions);
where the lead is smaller, either token is the model's choice to the format's rounding, and the
engine's is not checked against transformers there. Transformers reads the engine's own tokens
(teacher forcing: one forward over the prompt and the tokens), so every step stays comparable
after a step where the two part, rather than only the steps before it.

For q4_1, whose activations are rounded to 8 bits per group of 32, B is wide on SmolLM2 (its few
massive activations set each group's step), so few steps are clear of 2B: the same prompts are
then also run by our engine in fp32 in-process, whose bound is a few ulps of the logits, so that
nearly every step is checked: the engine is the model, and the format is judged by its quality
figures (test_parity, the quantization widget).
"""

import torch


def transformers_steps(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V) fp32: transformers' logits for each of `tokens`, given `prompt` and the
    tokens before it (one forward over prompt + tokens[:-1])."""
    if not prompt or not tokens:
        raise ValueError(f"transformers_steps: prompt ({len(prompt)} tokens) and tokens ({len(tokens)}) "
                         "must both be non-empty")
    seq = list(prompt) + list(tokens[:-1])
    with torch.inference_mode():
        logits = hf_model(torch.tensor([seq]), attention_mask=torch.ones(1, len(seq), dtype=torch.long)).logits[0]
    return logits[len(prompt) - 1:].float()


def check_greedy_steps(hf_model, prompt: list[int], tokens: list[int], bound: float) -> int:
    """Asserts that every greedy token of `tokens` (after `prompt`) whose step transformers decides
    by more than 2 * `bound` (its best leads its second by more) is transformers' best; returns the
    number of such clear steps."""
    top = transformers_steps(hf_model, prompt, tokens).topk(2, dim=-1)
    clear = (top.values[:, 0] - top.values[:, 1]).double() > 2 * bound
    best = top.indices[:, 0].tolist()
    parted = [(i, tokens[i], best[i]) for i in range(len(tokens)) if clear[i] and tokens[i] != best[i]]
    assert not parted, f"(step, ours, transformers') at steps clear of 2 x {bound:.4g}: {parted}"
    return int(clear.sum())


def check_engine_is_the_model(hf_model, logit_bounds, served, fp32, prompts: list[list[int]],
                              tokens: list[list[int]]) -> tuple[int, int]:
    """The real-model widget tests' claim, for a widget's greedy tokens `tokens[i]` after
    `prompts[i]` (ignoring end-of-text, as the widgets run):
    - they are the serving engine's own: `served` (an LLM in the server's weight format,
      in-process) generates exactly them (the engine is batch-invariant: the same bits alone as
      in the widget's batch);
    - they are transformers' wherever its choice is clear of 2 x the served format's bound
      (check_greedy_steps; logit_bounds: tests/bounds.py's LogitBounds on this machine's kernel path);
    - `fp32`, our engine in fp32, on the same prompts, gives transformers' tokens wherever clear of
      2 x fp32's bound, and at least one step is clear there (the check is not empty).
    Returns (the served format's clear steps, fp32's clear steps), over all prompts."""
    from core import SamplingParams
    from core.model.linear import q4_kernel_isa

    if len(prompts) != len(tokens):
        raise ValueError(f"check_engine_is_the_model: {len(prompts)} prompts, {len(tokens)} token lists")
    params = [SamplingParams(temperature=0.0, max_tokens=len(t), ignore_eos=True) for t in tokens]
    assert [o.token_ids for o in served.generate(prompts, params)] == tokens, "the serving engine's own tokens"
    config = served.engine.config
    if fp32.engine.config.weight_format.value != "fp32":
        raise ValueError("check_engine_is_the_model: fp32 must be an LLM in fp32")
    bound = logit_bounds.bound(config.weight_format.value, q4_kernel_isa(), config.lm_head_candidates)
    clear_served = sum(check_greedy_steps(hf_model, p, t, bound) for p, t in zip(prompts, tokens))
    ours = [o.token_ids for o in fp32.generate(prompts, params)]
    clear_fp32 = sum(check_greedy_steps(hf_model, p, t, logit_bounds.bound("fp32")) for p, t in zip(prompts, ours))
    assert clear_fp32 > 0, "no step of fp32 was clear of its bound: the comparison checked nothing"
    return clear_served, clear_fp32
