"""Widget `prefix-cache` (section 16): the same question asked twice, and one system prompt shared by
several users, run with the prefix cache and without; measured on this machine.

After vLLM's automatic prefix caching (and SGLang's RadixAttention, Zheng et al., 2024): a full KV
block is named by a chained hash, hash(parent block's hash, its token ids), so a block matches only
if the whole prompt up to and including it matches. A request takes the cached blocks of its
prompt in order and stops at the first miss; the partial last block, and always the last prompt
token (its logits pick the first new token), are computed.

Message: `prefix_cache` {system, question, users, run} -> a job. It runs on two engines of its
own beside the serving one (`engine.sibling`): one with prefix caching on, one with it off, so the
measurement neither reads nor disturbs the cache and timings of the readers being served (the
serving engine's cache holds whatever the classroom sent; a fresh engine starts empty, which is
what makes "first ask: nothing cached" true). Prompts, in order: the question, the same question
again, then each user's question after the same system prompt. The scenario runs REPEATS rounds
(each with a fresh, empty cache-on engine), one engine step per slice; a prompt's TTFT is the sum
of the engine steps up to its first token (time spent serving others between slices is not
counted), and the reply gives the median over the rounds, with every round's time. `run` is the reader's "measure
again" counter: a new value is a new job, where the same inputs come from the job cache.
"""

import statistics
import time

from core.engine.block_manager import hash_block
from core.errors import InvalidParameter

from ..jobs import Progress
from .base import Widget, message, text
from .seam import machine, remeasure, run_request

MAX_SYSTEM_TOKENS = 192     # the shared system prompt, in tokens
MAX_QUESTION_TOKENS = 48    # each question
MAX_USERS = 3               # other users sharing the system prompt
REPEATS = 3                 # rounds of the whole scenario: TTFTs are medians (a shared machine is noisy)
CHUNK_TOKENS = 16           # tokens per engine step on the experiment's engines: one block, a short slice


def prefix_cache(call) -> None:
    msg = call.msg
    system = text(msg, "system")
    question = text(msg, "question")
    users = user_questions(msg)
    again = remeasure(msg)
    check_tokens(call, system, "system", MAX_SYSTEM_TOKENS)
    for name, q in [("question", question)] + [("users", u) for u in users]:
        check_tokens(call, q, name, MAX_QUESTION_TOKENS)
    prompts = [("first ask", question), ("same question again", question)]
    prompts += [(f"user {i + 1}", q) for i, q in enumerate(users)]
    encoded = [(label, q, call.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}])) for label, q in prompts]

    def work(engine):
        return (yield from measure(engine, encoded))
    call.job({"system": system, "question": question, "users": users, "remeasure": again}, work)


def user_questions(msg: dict) -> list[str]:
    users = msg.get("users", [])
    if not isinstance(users, list) or len(users) > MAX_USERS:
        raise InvalidParameter("users", f"must be a list of at most {MAX_USERS} questions")
    if not all(isinstance(u, str) and u.strip() for u in users):
        raise InvalidParameter("users", "every question must be a non-empty string")
    return users


def check_tokens(call, value: str, name: str, limit: int) -> None:
    n = len(call.tokenizer.encode(value))
    if n > limit:
        raise InvalidParameter(name, f"is {n} tokens; the most this widget takes is {limit}")


def measure(engine, prompts: list[tuple[str, str, list[int]]]):
    """Each prompt prefilled on a cache-off engine and on a cache-on engine, REPEATS times (a fresh
    cache-on engine each round, fed the prompts in the same order): median TTFTs, per-block matches."""
    bs = engine.view.config.block_size
    blocks = sum(-(-len(ids) // bs) + 1 for _, _, ids in prompts) + 4     # room for all: no eviction
    settings = dict(num_kv_blocks=blocks, max_num_seqs=1, max_num_batched_tokens=CHUNK_TOKENS, trace_steps=16)
    total = REPEATS * len(prompts)
    cold = engine.sibling(enable_prefix_caching=False, **settings)
    yield Progress(0, total, "starting the engine without the cache")
    yield from first_token(cold, [engine.view.model_config.bos_token_id] * 3)   # first-call costs out of the timings
    started = time.time()
    without = [[] for _ in prompts]
    with_cache = [[] for _ in prompts]
    for r in range(REPEATS):
        warm = engine.sibling(enable_prefix_caching=True, **settings)       # an empty cache each round
        yield Progress(r * len(prompts), total, f"round {r + 1} of {REPEATS}: a fresh engine with the cache")
        yield from first_token(warm, [engine.view.model_config.bos_token_id] * 3)  # no full block: caches nothing
        seen: set[bytes] = set()        # hashes this cache-on engine has published so far
        for i, (label, _, ids) in enumerate(prompts):
            yield Progress(r * len(prompts) + i, total, f"round {r + 1} of {REPEATS}: {label}")
            without[i].append((yield from first_token(cold, ids)))
            expected = block_matches(ids, bs, seen)
            with_cache[i].append((yield from first_token(warm, ids)) | {"blocks": expected})
            seen.update(b["hash_bytes"] for b in expected if b["full"])
    rows = [prompt_row(engine, prompt, off, on) for prompt, off, on in zip(prompts, without, with_cache)]
    second = rows[1]
    return {
        "block_size": bs, "chunk_tokens": CHUNK_TOKENS, "repeats": REPEATS,
        "shared_prefix_tokens": common_prefix(prompts[0][2], prompts[2][2]) if len(prompts) > 2 else None,
        "prompts": rows,
        "cached_tokens": second["cached_tokens"], "ttft_saved_ms": second["ttft_saved_ms"],
        "machine": machine(started),
    }


def prompt_row(engine, prompt, off: list[dict], on: list[dict]) -> dict:
    """One prompt's runs summed up: median TTFTs, and what the cache-on runs took from the cache
    (the same in every round: each round starts empty and sees the same prompts in order)."""
    label, question, ids = prompt
    first = on[0]
    t_off = statistics.median(run["ttft_ms"] for run in off)
    t_on = statistics.median(run["ttft_ms"] for run in on)
    return {
        "label": label, "question": question, "prompt_tokens": len(ids),
        "tokens": engine.view.tokenizer.token_texts(ids),
        "cached_tokens": first["cached_tokens"],
        "ttft_without_ms": t_off, "ttft_with_ms": t_on, "ttft_saved_ms": round(t_off - t_on, 3),
        "ttft_without_runs_ms": [run["ttft_ms"] for run in off], "ttft_with_runs_ms": [run["ttft_ms"] for run in on],
        "steps_without": off[0]["steps"], "steps_with": first["steps"],
        "first_token_without": off[0]["first_token"], "first_token_with": first["first_token"],
        "blocks": [{k: v for k, v in b.items() if k != "hash_bytes"} for b in first["blocks"]],
    }


def first_token(sibling, ids: list[int]):
    """Prefill ids on `sibling` one step per slice, up to the first token. -> its TTFT and cache use."""
    out = yield from run_request(sibling, ids, 1, ignore_eos=False)
    steps = out.metrics.steps
    return {"ttft_ms": round(1000 * sum(s.duration_s for s in steps), 3), "steps": len(steps),
            "cached_tokens": out.num_cached_tokens, "first_token": out.token_ids[0]}


def block_matches(ids: list[int], bs: int, seen: set[bytes]) -> list[dict]:
    """Every block of the prompt: its chained hash and whether the cache holds it. The lookup
    covers the full blocks before the last token, and stops at the first miss."""
    lookup = (len(ids) - 1) // bs           # blocks the lookup may take (the last token is computed)
    rows, parent, hit = [], None, True
    for i in range(-(-len(ids) // bs)):
        chunk = ids[i * bs:(i + 1) * bs]
        full = len(chunk) == bs
        h = hash_block(parent, chunk) if full else None
        if not full:
            status = "partial"              # never hashed: only full blocks are shared
        elif i >= lookup:
            status = "last token"           # holds the last prompt token: computed anyway
        elif hit and h in seen:
            status = "hit"
        elif hit:
            status, hit = "miss", False
        else:
            status = "after miss"           # the chain broke earlier: not even looked up
        rows.append({"index": i, "start": i * bs, "num_tokens": len(chunk), "full": full,
                     "hash": h.hex()[:12] if h else None, "hash_bytes": h,
                     "matched": status == "hit", "status": status})
        parent = h
    return rows


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


WIDGET = Widget("prefix-cache", messages=(
    message("prefix_cache", {"system", "question", "users", "run"}, prefix_cache, job=True),
))
