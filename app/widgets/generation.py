"""Widget `generation` (section 7): the decode loop, one step per click, on the real serving engine.

Message `next_token` {prompt | messages, tokens, top, temperature, top_k, top_p, seed} -> one reply:
the `top` most likely next tokens with their raw logits and probabilities (softmax at temperature
1 over the whole vocabulary), the token the engine's own sampler chose with the given settings
(greedy at temperature 0, a seeded draw otherwise), and what the step did in the KV cache.

Each click is one engine request: the prompt plus the tokens chosen so far, with max_tokens=1 and
`top_candidates`, sent through the serving loop like a chat (batched with everyone else's
requests, counted against max_requests_per_connection). The engine's prefix cache (vLLM's
automatic prefix caching, Kwon et al., 2023) serves the full KV blocks that the previous click
computed, so a step computes only the tokens of the last, partly filled block: the newest token
and up to block_size - 1 before it. (A single request that stays in the engine, as a chat does,
computes exactly one token per decode step.) The reply says how many tokens came from the cache
and how many were computed, so the widget shows that honestly.

Sampling is the engine's: step n (n = len(tokens)) draws with seed `seed + n`, so each step draws
afresh and replaying the same steps with the same seed picks the same tokens.
"""

from core.engine.outputs import RequestOutput
from core.engine.sampling_params import MAX_SEED, MAX_TOP_CANDIDATES, SamplingParams
from core.errors import InvalidParameter, is_int

from .base import Widget, integer, message
from .seam import chat_prompt_steps

DEFAULT_TOP = 10


def chosen_tokens(msg: dict, vocab_size: int, limit: int) -> list[int]:
    """The `tokens` chosen so far: token ids, at most `limit` of them."""
    tokens = msg.get("tokens", [])
    if not isinstance(tokens, list):
        raise InvalidParameter("tokens", "must be a list of token ids")
    if len(tokens) > limit:
        raise InvalidParameter("tokens", f"has {len(tokens)} tokens; the most this server steps through is "
                                         f"{limit} (max_tokens_limit)")
    for t in tokens:
        if not is_int(t) or not 0 <= t < vocab_size:
            raise InvalidParameter("tokens", f"must be token ids from 0 to {vocab_size - 1}, got {t!r}")
    return tokens


def step_prompt(steps, tokens: list[int], prompt: list[int]):
    """The step's prompt ids in steps: the text's (or the chat template's, from `steps`, the
    seam's chat_prompt_steps), then `tokens`; `prompt` is filled with the text's ids on the way
    (the reply shows them). Call.submit runs it, on the reader's thread or, for a long text, as
    a job."""
    prompt.extend((yield from steps))
    if not prompt:
        raise InvalidParameter("prompt", "has no tokens")
    return prompt + tokens


def step_params(msg: dict, step: int, top: int) -> SamplingParams:
    seed = msg.get("seed")
    if seed is not None and (not is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise InvalidParameter("seed", f"must be an integer from 0 to {MAX_SEED}, got {seed!r}")
    return SamplingParams(
        max_tokens=1,
        temperature=msg.get("temperature", 0.0),
        top_k=msg.get("top_k", 0),
        top_p=msg.get("top_p", 1.0),
        seed=None if seed is None else (seed + step) % (MAX_SEED + 1),
        top_candidates=top,
    )


def candidate(c, text: str) -> dict:
    return {"id": c.token_id, "text": text, "logit": round(c.logit, 5), "prob": c.prob,
            "final_prob": c.final_prob}


def step_reply(out: RequestOutput, tokenizer, prompt: list[int], tokens: list[int], top: int,
               params: SamplingParams, block_size: int) -> dict:
    """The one reply of a step, from the engine's finished output."""
    cands = out.candidates[-1]                 # the top `top` by probability, then the chosen one if not among them
    chosen = out.token_ids[-1]
    texts = tokenizer.token_texts([c.token_id for c in cands] + prompt)
    shown = [candidate(c, t) for c, t in zip(cands[:top], texts)]
    chosen_entry = next(candidate(c, t) for c, t in zip(cands, texts) if c.token_id == chosen)
    kv_tokens = len(out.prompt_token_ids)      # prompt + tokens: all have keys and values after this step
    m = out.metrics
    return {
        "phase": "decode" if tokens else "prefill",
        "candidates": shown,
        "chosen": {**chosen_entry, "rank": next((i for i, c in enumerate(shown) if c["id"] == chosen), None)},
        "tail_prob": max(0.0, 1.0 - sum(c["prob"] for c in shown)),
        "ends_turn": out.finish_reason == "stop",
        "prompt": [{"id": i, "text": t} for i, t in zip(prompt, texts[len(cands):])],
        "step": len(tokens),
        "kv_cache_tokens": kv_tokens,
        "num_cached_tokens": out.num_cached_tokens,
        "num_computed_tokens": sum(s.num_tokens for s in m.steps),
        "block_size": block_size,
        "engine_steps": len(m.steps),
        "step_ms": None if m.e2e_s is None else round(m.e2e_s * 1000.0, 3),
        "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "seed": params.seed,
    }


def error_message(mid, code: str, text: str) -> dict:
    return {"type": "error", "id": mid, "code": code, "message": text, "param": None}


def next_token(call) -> None:
    steps = chat_prompt_steps(call)            # `prompt` or `messages` checked now, tokenized in submit
    tokens = chosen_tokens(call.msg, call.info["vocab_size"], call.config.max_tokens_limit)
    top = integer(call.msg, "top", 1, MAX_TOP_CANDIDATES, default=DEFAULT_TOP)
    params = step_params(call.msg, len(tokens), top)
    tokenizer, block_size = call.tokenizer, call.info["block_size"]
    prompt: list[int] = []                     # the text's ids, once tokenized (step_prompt)

    def answer(mid, out: RequestOutput) -> list[dict]:   # on the writer thread, once per engine output
        if out.error:
            return [error_message(mid, "internal_error", out.error)]
        if not out.finished:
            return []
        if out.finish_reason == "abort":
            return [error_message(mid, "aborted", "the step was aborted")]
        return [{"type": "next_token", "id": mid,
                 **step_reply(out, tokenizer, prompt, tokens, top, params, block_size)}]

    call.submit(step_prompt(steps, tokens, prompt), params, answer)


WIDGET = Widget("generation", messages=(
    message("next_token", {"prompt", "messages", "tokens", "top", "temperature", "top_k", "top_p", "seed"},
            next_token, request=True),
))
