"""Widget `chunked-prefill` (section 15): a long prompt arrives while requests decode, measured
with the prompt prefilled in one step and in chunks of a token budget.

Without chunking, the step that admits a prompt computes all of its tokens, and every request that
was decoding waits for that step: its inter-token latency (ITL) jumps by the whole prefill. With
chunked prefill (Agrawal et al., 2024, "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve"; vLLM's `enable_chunked_prefill`), each step has a token budget: the decoders go
first with one token each, and the prompt takes what is left, over several steps. The decoders'
gaps stay near one decode step; the long prompt's own TTFT grows a little.

The job runs the same scenario twice on sibling engines of the serving one (their own KV pool and
scheduler, prefix caching off), one engine step per slice:
1. `decoders` short requests are admitted and decode WARM_STEPS tokens;
2. the long prompt (`prompt_tokens` tokens of prose) arrives;
3. stepping continues until it has its first token and AFTER_STEPS more decode steps have run.
Run "unchunked" has a token budget of prompt + decoders (the whole prompt fits one step); run
"chunked" has the reader's `budget`, counted in plain tokens as in Sarathi-Serve (the serving
engine also shrinks chunks deep into a long prompt, `chunk_context_tokens`; at these prompt
lengths that would blur the picture without changing it). Each decoder's ITLs come from its own token times
(RequestOutput.metrics), each step's token counts from the engine's step trace.

Message: `chunked_prefill` (old name `chunked-prefill`) {decoders, prompt_tokens, budget, run} -> a job (cached by its inputs;
`run` is the reader's "measure again" counter). The largest slice is the unchunked run's prefill
step, by design: that step is the stall being shown, so prompt_tokens is capped at MAX_PROMPT.
"""

from core.engine.sampling_params import SamplingParams
from core.errors import InvalidParameter

from ..jobs import EXCLUSIVE, Progress
from .base import Widget, alias, integer, message
from .seam import filler_ids, machine, ms, remeasure, run_request

MIN_PROMPT, MAX_PROMPT, DEFAULT_PROMPT = 32, 512, 256   # the long prompt (its unchunked step is one slice)
MAX_DECODERS, DEFAULT_DECODERS = 8, 4
MIN_BUDGET, MAX_BUDGET, DEFAULT_BUDGET = 16, 256, 64   # always more than MAX_DECODERS
DECODER_PROMPT = 8        # tokens of each decoder's own short prompt
WARM_STEPS = 4            # decode steps before the long prompt arrives
AFTER_STEPS = 4           # decode steps after its first token
DECODER_TEXTS = ("Tell me about the sea.", "Name three colours.", "What is a river?", "Count to ten.",
                 "Describe a forest.", "Why do birds sing?", "What is bread?", "Say something kind.")


def chunked_prefill(call) -> None:
    msg = call.msg
    decoders = integer(msg, "decoders", 1, MAX_DECODERS, default=DEFAULT_DECODERS)
    prompt_tokens = integer(msg, "prompt_tokens", MIN_PROMPT, MAX_PROMPT, default=DEFAULT_PROMPT)
    budget = integer(msg, "budget", MIN_BUDGET, MAX_BUDGET, default=DEFAULT_BUDGET)
    if budget >= prompt_tokens:
        raise InvalidParameter("budget", f"must be less than prompt_tokens ({prompt_tokens}) for the prompt "
                                         f"to be cut into chunks, got {budget}")
    inputs = {"decoders": decoders, "prompt_tokens": prompt_tokens, "budget": budget, "remeasure": remeasure(msg)}

    def work(engine):
        return (yield from chunked_prefill_job(engine, **inputs))
    call.job(inputs, work)


def chunked_prefill_job(engine, decoders: int, prompt_tokens: int, budget: int, remeasure: int):
    per_run = WARM_STEPS + 2 + -(-prompt_tokens // max(1, budget - decoders)) + AFTER_STEPS
    total = 2 * per_run
    done = 0
    runs = {}
    for mode, step_budget in (("unchunked", prompt_tokens + decoders), ("chunked", budget)):
        scenario = run_scenario(engine, decoders, prompt_tokens, step_budget, chunked=mode == "chunked")
        while True:
            try:
                item = next(scenario)
            except StopIteration as stop:
                runs[mode] = stop.value
                break
            if item is EXCLUSIVE:           # the one-piece prefill: run it while nobody is served
                yield item
                continue
            done = min(done + 1, total - 1)
            yield Progress(done, total, f"{mode}: a {prompt_tokens}-token prompt beside {decoders} decoders")
    return {"machine": machine(), "run": remeasure, "decoders": decoders, "prompt_tokens": prompt_tokens,
            "budget": budget, "runs": runs,
            "max_itl_ms_unchunked": runs["unchunked"]["max_itl_ms"],
            "max_itl_ms_chunked": runs["chunked"]["max_itl_ms"]}


def run_scenario(engine, decoders: int, prompt_tokens: int, step_budget: int, chunked: bool):
    """One run, one engine step per `next()`; returns its decoders' ITLs and its step trace."""
    block = engine.view.config.block_size
    tokens_each = DECODER_PROMPT + WARM_STEPS + AFTER_STEPS + prompt_tokens + 8   # room to decode throughout
    blocks = decoders * -(-tokens_each // block) + -(-(prompt_tokens + 2) // block) + 2
    sibling = engine.sibling(num_kv_blocks=blocks, max_num_seqs=decoders + 1, max_num_batched_tokens=step_budget,
                         enable_chunked_prefill=chunked, enable_prefix_caching=False,
                         chunk_context_tokens=0)   # the textbook budget in tokens (the server also weighs context)
    params = SamplingParams(temperature=0.0, max_tokens=tokens_each - DECODER_PROMPT, ignore_eos=True)
    yield from run_request(sibling, filler_ids(sibling.view.tokenizer, 4), 2, ignore_eos=False)  # first calls pay setup
    seqs = [sibling.add_request((sibling.view.tokenizer.encode(DECODER_TEXTS[i]) * DECODER_PROMPT)[:DECODER_PROMPT], params)
            for i in range(decoders)]
    while min(len(s.metrics.token_times) for s in seqs) < WARM_STEPS + 1:
        sibling.step()
        yield
    first_step = sibling.view.num_steps
    long = sibling.add_request(filler_ids(sibling.view.tokenizer, prompt_tokens), SamplingParams(temperature=0.0, max_tokens=1))
    arrival = long.metrics.arrival_time
    while not long.is_finished:
        if not chunked and long.num_computed_tokens == 0:
            yield EXCLUSIVE                  # this step prefills the whole prompt: a long slice
        sibling.step()
        yield
    for _ in range(AFTER_STEPS):
        sibling.step()
        yield
    for s in seqs:
        sibling.abort(s.request_id)
    return scenario_result(sibling, seqs, long, arrival, first_step, step_budget, chunked)


def scenario_result(sibling, seqs, long, arrival: float, first_step: int, step_budget: int, chunked: bool) -> dict:
    """Each decoder's gaps (time of the token since the long prompt's arrival, gap before it)
    and each step of the run from the engine's trace."""
    decoders = []
    for s in seqs:
        t = s.metrics.token_times
        decoders.append([{"t_ms": ms(b - arrival), "itl_ms": ms(b - a)} for a, b in zip(t, t[1:])])
    steps = [{"step": st.step, "t_ms": ms(st.start_s + sibling.view.start_time - arrival), "ms": ms(st.duration_s),
              "prefill_tokens": st.num_prefill_tokens, "decode_tokens": st.num_decode_tokens}
             for st in sibling.view.trace if st.step >= first_step]
    return {"chunked": chunked, "step_budget": step_budget, "decoders": decoders, "steps": steps,
            "decoder_prompts": [s.token_ids[:s.num_prompt_tokens] for s in seqs],
            "decoder_tokens": [s.output_token_ids for s in seqs],       # greedy: the same in both runs
            "long_first_token": long.output_token_ids[0],
            "max_itl_ms": max(g["itl_ms"] for d in decoders for g in d),
            "max_prefill_tokens_in_a_step": max(st["prefill_tokens"] for st in steps),
            "prefill_steps": sum(1 for st in steps if st["prefill_tokens"] > 0),
            "long_ttft_ms": ms(long.metrics.ttft_s)}


MESSAGE = message("chunked_prefill", {"decoders", "prompt_tokens", "budget", "run"}, chunked_prefill, job=True)
WIDGET = Widget("chunked-prefill", messages=(MESSAGE, alias("chunked-prefill", of=MESSAGE)))
