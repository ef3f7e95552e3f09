"""LLMEngine serving properties on the real model, token for token, greedy unless said otherwise.

Whatever the engine does to serve many requests at once (batching, chunked prefill, the prefix
cache, preemption, the scheduling policy), each request must get exactly the tokens it gets
when it runs alone. Input validation runs on the tiny model.
"""

import ctypes
import mmap

import pytest
import torch

from core import ContextLengthExceeded, InvalidParameter, SamplingParams
from core.config import OMP_SPIN_COUNT, EngineConfig

MAX_TOKENS = 16

PROMPTS = [
    "Hello",
    "The capital of Japan is",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old "
    "woodcutter and his three daughters. Every morning the youngest daughter",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colours:",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. The astronauts were "
    "Neil Armstrong and Buzz Aldrin, while Michael Collins stayed in orbit. Their mission",
    "Water boils at",
    "Translate to French: Good morning, how are you today?",
    "The three laws of thermodynamics can be summarised as follows. The first law says that energy "
    "cannot be created or destroyed, only converted from one form to another. The second law",
    "My favourite recipe for pancakes needs flour, eggs, milk and",
    "Q: What is 12 times 12?\nA:",
    "Photosynthesis is the process by which plants",
    "A haiku about the sea:",
    "The stock market fell sharply on Monday after the central bank announced that interest "
    "rates would rise again, and analysts warned that",
    "Dear diary, today I",
    "The best way to learn a new programming language is",
]
ALONE = list(range(16))  # every prompt also runs alone: the reference


def greedy(max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def alone(smollm_loaded):
    """Token ids of each ALONE prompt, each generated alone on a fresh engine (the reference)."""
    from core import LLM

    llm = LLM("smollm2-135m", loaded=smollm_loaded, enable_prefix_caching=False)
    out = {}
    for i in ALONE:
        (result,) = llm.generate(PROMPTS[i], greedy())
        assert result.finish_reason in ("stop", "length")
        out[i] = result.token_ids
    return out


def prefill_rows(trace):
    return [w for row in trace for w in row.slots if w is not None and w.kind == "prefill"]


# -- batching ---------------------------------------------------------------------------------

@pytest.mark.real_model
def test_batched_equals_alone_in_any_order(make_smollm, alone, assert_pool_clean):
    assert len(set(PROMPTS)) == 16
    llm = make_smollm()
    together = llm.generate(PROMPTS, greedy())
    assert [o.prompt for o in together] == PROMPTS
    assert max(row.running for row in llm.engine.view.trace) == 16   # they really ran together
    for i in ALONE:
        assert together[i].token_ids == alone[i], PROMPTS[i]

    order = list(reversed(range(16)))
    order[3], order[9] = order[9], order[3]     # reversed, then two swapped
    llm2 = make_smollm()
    shuffled = llm2.generate([PROMPTS[i] for i in order], greedy())
    for out, i in zip(shuffled, order):
        assert out.token_ids == together[i].token_ids, PROMPTS[i]
        assert out.finish_reason == together[i].finish_reason
    assert_pool_clean(llm.engine)
    assert_pool_clean(llm2.engine)


# -- chunked prefill --------------------------------------------------------------------------

CHUNKED = [2, 5, 6, 8, 12]  # prompts of mixed lengths, three of them over 32 tokens


@pytest.mark.real_model
def test_chunked_prefill_gives_the_same_tokens(make_smollm, smollm, alone, assert_pool_clean):
    lengths = [len(smollm.tokenizer.encode(PROMPTS[i])) for i in CHUNKED]
    assert sum(n > 32 for n in lengths) >= 3 and min(lengths) < 32
    prompts = [PROMPTS[i] for i in CHUNKED]
    results = {}
    for budget in (7, 32, 512):
        llm = make_smollm(max_num_batched_tokens=budget, enable_prefix_caching=False)
        outs = llm.generate(prompts, greedy(max_tokens=10))
        results[budget] = [o.token_ids for o in outs]
        trace = list(llm.engine.view.trace)
        assert all(row.num_batched_tokens <= budget for row in trace)
        chunks = prefill_rows(trace)
        assert all(1 <= w.num_tokens <= budget for w in chunks)
        per_request = {}
        for w in chunks:
            per_request.setdefault(w.request_id, []).append(w.num_tokens)
        assert sorted(sum(v) for v in per_request.values()) == sorted(lengths)
        if budget < max(lengths):
            assert max(len(v) for v in per_request.values()) > 1   # some prompt was cut in chunks
        else:
            assert all(len(v) == 1 for v in per_request.values())
        assert_pool_clean(llm.engine)
    assert results[7] == results[32] == results[512]
    for k, i in enumerate(CHUNKED):
        assert results[7][k] == alone[i][:10]


# -- the prefix cache ---------------------------------------------------------------------------

SYSTEM = (
    "You are Lumen, the reference librarian of the Old Harbour Public Library. You answer "
    "questions about the library's collections, opening hours, events and services. The library "
    "opens from nine in the morning to seven in the evening on weekdays, and from ten to four on "
    "Saturdays; it is closed on Sundays and public holidays. Members may borrow up to twelve books "
    "for three weeks and renew them twice online. The local history room on the second floor holds "
    "maps, ship registers and photographs of the harbour since 1850, and may be visited by "
    "appointment. Children's story time is every Wednesday at four. Answer briefly and politely, "
    "and if you do not know something, say so and suggest asking at the front desk. Never invent "
    "a book title, an author or a date. When someone asks for a recommendation, ask first what they "
    "enjoyed reading recently, then suggest at most two books from the collection. The library also "
    "lends board games, telescopes and sewing machines, and its reading room has free wifi."
)


@pytest.mark.real_model
def test_prefix_cache_hit_on_a_shared_system_prompt(make_smollm, assert_pool_clean):
    system = {"role": "system", "content": SYSTEM}
    first = [system, {"role": "user", "content": "When do you open on Saturday?"}]
    second = [system, {"role": "user", "content": "Can I see old maps of the harbour?"}]
    llm = make_smollm()
    bs = llm.engine.config.block_size
    p1, p2 = (llm.tokenizer.apply_chat_template(c) for c in (first, second))
    shared = next(i for i, (a, b) in enumerate(zip(p1, p2)) if a != b)
    assert shared >= 200

    out1 = llm.chat(first, greedy(max_tokens=12))
    assert out1.num_cached_tokens == 0
    out2 = llm.chat(second, greedy(max_tokens=12))
    assert out2.num_cached_tokens > 0
    assert out2.num_cached_tokens % bs == 0
    assert out2.num_cached_tokens == (shared // bs) * bs
    computed = [w.num_tokens for w in prefill_rows(llm.engine.view.trace) if w.request_id == out2.request_id]
    assert sum(computed) == len(p2) - out2.num_cached_tokens   # only the rest was computed

    uncached = make_smollm(enable_prefix_caching=False)
    ref = uncached.chat(second, greedy(max_tokens=12))
    assert ref.num_cached_tokens == 0
    assert out2.token_ids == ref.token_ids
    assert out2.text == ref.text
    assert_pool_clean(llm.engine)
    assert_pool_clean(uncached.engine)


@pytest.mark.real_model
def test_prompt_of_whole_blocks_recomputes_its_last_block(make_smollm, assert_pool_clean):
    llm = make_smollm()
    bs = llm.engine.config.block_size
    ids = llm.tokenizer.encode(SYSTEM)[: 4 * bs]
    assert len(ids) == 4 * bs
    first = llm.generate(ids, greedy(max_tokens=8))[0]
    again = llm.generate(ids, greedy(max_tokens=8))[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == len(ids) - bs
    assert again.token_ids == first.token_ids
    assert again.prompt_token_ids == ids
    assert_pool_clean(llm.engine)


# -- preemption -------------------------------------------------------------------------------

@pytest.mark.real_model
def test_preemption_under_a_tiny_kv_pool_keeps_the_outputs(make_smollm, alone, assert_pool_clean):
    picked = [0, 1, 4, 6, 9, 10, 12, 14, 2, 5]     # short prompts that grow, and two long ones
    prompts = [PROMPTS[i] for i in picked]
    llm = make_smollm(num_kv_blocks=7)      # 112 token slots; the ten need ~330 (one needs 56)
    outs = llm.generate(prompts, greedy())
    trace = list(llm.engine.view.trace)
    preempted = [rid for row in trace for rid in row.preempted]
    assert preempted, "the pool was meant to be too small for every request at once"
    assert any(w.recompute for w in prefill_rows(trace))
    assert max(row.kv_blocks_used for row in trace) <= 7
    for out, i in zip(outs, picked):
        assert out.finished
        assert out.token_ids == alone[i], PROMPTS[i]
    assert_pool_clean(llm.engine)


# -- static and continuous scheduling --------------------------------------------------------

@pytest.mark.real_model
def test_continuous_beats_static_on_mixed_lengths(make_smollm, assert_pool_clean):
    lengths = [2, 14, 3, 12, 4, 10, 2, 8]
    prompts = [PROMPTS[i] for i in (1, 4, 6, 7, 9, 10, 11, 12)]
    params = [greedy(max_tokens=n, ignore_eos=True) for n in lengths]
    runs = {}
    for scheduling in ("static", "continuous"):
        llm = make_smollm(scheduling=scheduling, max_num_seqs=3)
        outs = llm.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == lengths
        assert all(o.finish_reason == "length" for o in outs)
        runs[scheduling] = ([o.token_ids for o in outs], list(llm.engine.view.trace), llm.engine.view.num_steps)
        assert_pool_clean(llm.engine)
    (static_tokens, static_trace, static_steps), (cont_tokens, cont_trace, cont_steps) = \
        runs["static"], runs["continuous"]
    assert static_tokens == cont_tokens
    assert static_steps == len(static_trace) and cont_steps == len(cont_trace)
    assert cont_steps < static_steps

    # Why: a static batch leaves a finished member's slot idle while others wait ...
    def idle(row):
        return [w for w in row.slots if w is not None and w.kind == "idle"]
    assert any(idle(row) and row.waiting > 0 for row in static_trace)
    assert all(len(row.slots) <= 3 for row in static_trace + cont_trace)
    # ... continuous batching refills the slot in the very next step.
    assert not any(idle(row) for row in cont_trace)
    refills = 0
    for row, nxt in zip(cont_trace, cont_trace[1:]):
        freed = [i for i, w in enumerate(row.slots) if w is not None and w.request_id in row.finished]
        refilled = [i for i in freed if i < len(nxt.slots) and nxt.slots[i] is not None
                    and nxt.slots[i].kind == "prefill" and nxt.slots[i].request_id not in row.finished]
        assert len(refilled) == min(len(freed), row.waiting)
        refills += len(refilled)
    assert refills >= 3


# -- aborts and sampling ----------------------------------------------------------------------

@pytest.mark.real_model
def test_abort_mid_stream_frees_every_block(make_smollm, assert_pool_clean):
    llm = make_smollm(max_num_seqs=2)
    engine = llm.engine
    params = greedy(max_tokens=30, ignore_eos=True)
    a, b, c = (engine.add_request(PROMPTS[i], params) for i in (2, 5, 13))
    streamed = {}
    for _ in range(4):
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert b.num_output_tokens > 0 and not b.is_finished
    assert c.status.value == "waiting"                     # max_num_seqs=2: c is queued
    out_b = engine.abort(b.request_id)
    assert out_b.finished and out_b.finish_reason == "abort" and out_b.stop_reason is None
    assert out_b.token_ids == streamed[b.request_id]       # what was streamed is kept
    out_c = engine.abort(c.request_id)
    assert out_c.finish_reason == "abort" and out_c.token_ids == []
    assert engine.abort(c.request_id) is None               # already gone
    assert engine.abort("no-such-request") is None
    while engine.has_unfinished_requests():
        engine.step()
    assert a.is_finished and a.finish_reason.value == "length" and a.num_output_tokens == 30
    assert_pool_clean(engine)


@pytest.mark.real_model
def test_seeded_sampling_is_the_same_in_any_batch(make_smollm, assert_pool_clean):
    llm = make_smollm()
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[3], seeded)[0]
    again = llm.generate(PROMPTS[3], seeded)[0]
    crowd = llm.generate(
        [PROMPTS[8], PROMPTS[3], PROMPTS[0], PROMPTS[13]],
        [SamplingParams(temperature=1.0, max_tokens=20), seeded, greedy(), SamplingParams(seed=1234, max_tokens=5)])
    assert alone.token_ids == again.token_ids == crowd[1].token_ids
    assert len(alone.token_ids) == 16
    other_seed = llm.generate(PROMPTS[3], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321,
                                                          max_tokens=16, ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids
    assert_pool_clean(llm.engine)


# -- input validation (tiny model) -------------------------------------------------------------

def test_empty_prompt_is_refused(make_tiny_engine):
    engine = make_tiny_engine()
    for prompt in ("", []):
        with pytest.raises(InvalidParameter) as exc:
            engine.add_request(prompt, greedy())
        assert exc.value.param == "prompt"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("bad", [[1, 2, -1], [49152], [5, 10**9], [1, 2.0], [True], "not a list".split(), None, 42])
def test_bad_token_ids_are_refused(make_tiny_engine, bad):
    engine = make_tiny_engine()
    with pytest.raises(InvalidParameter) as exc:
        engine.add_request(bad, greedy())
    assert exc.value.param == "prompt"
    assert not engine.has_unfinished_requests()


def test_prompt_longer_than_the_context_is_refused(make_tiny_engine):
    engine = make_tiny_engine(max_model_len=32)
    assert engine.max_model_len == 32
    with pytest.raises(ContextLengthExceeded) as exc:
        engine.add_request(list(range(100, 140)), greedy())
    assert exc.value.param == "prompt" and exc.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthExceeded):
        engine.add_request(list(range(100, 132)), greedy())   # 32 tokens leave no room to generate
    seq = engine.add_request(list(range(100, 131)), greedy(max_tokens=50))
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.num_tokens == 32 and seq.finish_reason.value == "length"   # stopped at the window


def test_the_pool_also_bounds_the_context(make_tiny_engine):
    engine = make_tiny_engine(num_kv_blocks=2, block_size=16)
    assert engine.max_model_len == 32
    with pytest.raises(ContextLengthExceeded):
        engine.add_request(list(range(100, 140)))


def test_bad_sampling_params_and_duplicate_ids_are_refused(make_tiny_engine):
    engine = make_tiny_engine()
    with pytest.raises(InvalidParameter) as exc:
        engine.add_request("Hi", {"temperature": 0})
    assert exc.value.param == "sampling_params"
    engine.add_request("Hi", greedy(), request_id="same")
    with pytest.raises(InvalidParameter) as exc:
        engine.add_request("Hello", greedy(), request_id="same")
    assert exc.value.param == "request_id"


@pytest.mark.parametrize("field, value", [
    ("block_size", 0), ("block_size", 1.5), ("max_num_seqs", -1), ("max_num_batched_tokens", 0),
    ("kv_cache_bytes", "1GiB"), ("trace_steps", True), ("num_kv_blocks", 0), ("max_model_len", -5),
    ("num_threads", 0), ("scheduling", "fifo"), ("share_cpu", "yes"),
])
def test_bad_engine_config_names_the_field(field, value):
    with pytest.raises(InvalidParameter) as exc:
        EngineConfig(model="tiny", **{field: value})
    assert exc.value.param == field
    assert field in str(exc.value)


def test_bad_engine_config_through_llm(tiny_loaded):
    from core import LLM
    with pytest.raises(InvalidParameter) as exc:
        LLM("tiny", loaded=tiny_loaded, max_num_seqs=0)
    assert exc.value.param == "max_num_seqs"


def test_a_sibling_shares_the_weights_and_nothing_else(make_tiny_engine):
    from core import SamplingParams

    engine = make_tiny_engine(num_kv_blocks=32)
    sib = engine.sibling(num_kv_blocks=8, max_num_seqs=2, enable_prefix_caching=False)
    assert sib.view.model.embed_tokens.weight.data_ptr() == engine.view.model.embed_tokens.weight.data_ptr()
    assert sib.view.cache is not engine.view.cache and sib.block_manager.num_blocks == 8
    assert sib.config.max_num_seqs == 2 and engine.config.max_num_seqs != 2
    params = SamplingParams(temperature=0.0, max_tokens=5)
    a = engine.add_request("Hello there", params)
    b = sib.add_request("Hello there", params)
    while engine.has_unfinished_requests() or sib.has_unfinished_requests():
        engine.step()
        sib.step()
    assert a.output_token_ids == b.output_token_ids
    assert engine.view.num_steps == sib.view.num_steps


def test_a_sibling_in_the_same_format_runs_the_same_packed_model(make_tiny_engine):
    """No second packing on the engine loop's thread (q4_1 packing of SmolLM2 takes ~0.6 s); a
    sibling in another format packs its own, over the same fp32 weights."""
    engine = make_tiny_engine(num_kv_blocks=32, weight_format="q4_1")
    same = engine.sibling(num_kv_blocks=8, max_num_seqs=2)
    assert same.view.model is engine.view.model and same.view.reference_model is engine.view.reference_model
    other = engine.sibling(num_kv_blocks=8, weight_format="fp32")
    assert other.view.model is not engine.view.model and other.view.model.weight_format.value == "fp32"
    assert other.view.model.embed_tokens.weight.data_ptr() == engine.view.model.embed_tokens.weight.data_ptr()


def test_the_widgets_reference_model_is_fp32_on_the_same_weights(make_tiny_engine):
    """A q4_1 engine serves in q4_1 and says so; the widgets' reference model multiplies the
    same weight tensors in fp32. An fp32 engine's reference is its own model."""
    engine = make_tiny_engine(num_kv_blocks=8, weight_format="q4_1")
    ref = engine.view.reference_model
    assert engine.view.info()["weight_format"] == "q4_1" and ref.weight_format.value == "fp32"
    assert ref.embed_tokens.weight.data_ptr() == engine.view.model.embed_tokens.weight.data_ptr()
    assert ref.layers[0].mlp.down_proj.weight.data_ptr() == engine.view.model.layers[0].mlp.down_proj.weight.data_ptr()
    plain = make_tiny_engine(num_kv_blocks=8)
    assert plain.view.reference_model is plain.view.model and plain.view.info()["weight_format"] == "fp32"


@pytest.mark.slow   # a fresh Python process loading torch, each
@pytest.mark.parametrize("torch_first", [True, False])
def test_the_engine_warns_when_openmp_would_spin_long(torch_first):
    """libgomp reads GOMP_SPINCOUNT when torch loads it: core sets a short spin if it is imported
    first (cpu_share.py says why), and says so when it is too late."""
    import os
    import subprocess
    import sys

    code = ("import torch\n" if torch_first else "") + (
        "import logging; logging.basicConfig()\n"
        "from core import EngineConfig, LLMEngine\n"
        "from toy_models.registry import load_tiny\n"
        "LLMEngine(EngineConfig(model='tiny', num_kv_blocks=4), load_tiny())\n"
        "import os; print('spin', os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert f"spin {OMP_SPIN_COUNT}" in out.stdout
    assert ("OpenMP keeps its default spin" in out.stderr) == torch_first


def _resident_fraction(tensor) -> float:
    """The share of the pages under `tensor`'s bytes that are in memory now (mincore(2) over exactly
    its address range: a count of a whole mapping, as /proc/self/smaps gives, also holds whatever
    memory the kernel merged into that mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.nbytes) // page) * page
    pages = (ctypes.c_ubyte * ((end - start) // page))()
    if libc.mincore(start, end - start, pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(p & 1 for p in pages) / len(pages)


def test_warmup_can_map_the_whole_kv_pool_and_leaves_it_empty(make_tiny_llm, assert_pool_clean):
    """A fresh pool's pages are mapped at each block's first write (calloc); warmup(touch_pool=True)
    maps them all at once (the benchmark's steady state), leaves every block free, and the engine's
    tokens do not change."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # 128 MiB a tensor: past glibc's largest mmap threshold (32 MiB), so each is fresh, unmapped memory
    touched, fresh = make_tiny_llm(kv_cache_bytes=256 << 20), make_tiny_llm(kv_cache_bytes=256 << 20)
    pool = touched.engine.runner.cache
    touched.engine.warmup(touch_pool=True)
    assert _resident_fraction(pool.k) == 1.0 and _resident_fraction(pool.v) == 1.0
    assert_pool_clean(touched.engine)
    tokens = [llm.generate(["Hello there"], params)[0].outputs[0].token_ids for llm in (touched, fresh)]
    assert tokens[0] == tokens[1]


# -- the KV pool's dtype (kv_cache.py: kv_cache_dtype) ------------------------------------------------

def step_logits(engine, prompts, **params):
    """Every step's logits (a copy) and each request's tokens, the requests run to the end."""
    captured, run = [], engine.runner.run
    engine.runner.run = lambda step: captured.append(run(step).clone()) or captured[-1]
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, ignore_eos=True, **params)) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return captured, [s.token_ids for s in seqs]


@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=32),                                              # chunked prefill, decodes
    dict(block_size=4, num_kv_blocks=30, preemption_mode="swap", num_swap_blocks=24,
         enable_prefix_caching=False, max_num_batched_tokens=32),                 # blocks swapped out and in
], ids=["chunked", "swapped"])
def test_q4_1_keeps_its_kv_in_bf16_with_the_bits_of_an_fp32_pool(make_tiny_engine, assert_pool_clean, settings):
    """q4_1's attention rounds keys and values to bf16 as it reads them; its pool keeps them so
    (kv_cache_dtype auto): every step's logits have the bits of an fp32 pool, block copies and
    swaps included, and every block comes back."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 41, 70, 9))]
    runs = {}
    for dtype in ("fp32", "auto"):
        engine = make_tiny_engine(weight_format="q4_1", kv_cache_dtype=dtype, **settings)
        runs[dtype] = step_logits(engine, prompts, max_tokens=12)
        assert engine.view.kv_stats()["dtype"] == ("fp32" if dtype == "fp32" else "bf16")
        if "num_swap_blocks" in settings:
            assert any(row.swapped_out for row in engine.view.trace)
        assert_pool_clean(engine)
    (fp32_logits, fp32_tokens), (bf16_logits, bf16_tokens) = runs["fp32"], runs["auto"]
    assert bf16_tokens == fp32_tokens
    assert len(bf16_logits) == len(fp32_logits) and all(torch.equal(a, b) for a, b in zip(bf16_logits, fp32_logits))


def test_the_kv_pool_dtype_follows_attention_and_says_so(make_tiny_engine):
    """auto: bf16 exactly where attention's operands are bf16 (q4_1), fp32 elsewhere; the same byte
    budget then holds twice the blocks, and the engine reports the pool's dtype and bytes a token.
    bf16 where attention reads fp32 is refused, by name."""
    budget = 1 << 20
    fp32, q4 = (make_tiny_engine(weight_format=f, kv_cache_bytes=budget) for f in ("fp32", "q4_1"))
    assert fp32.runner.cache.k.dtype == torch.float32 and q4.runner.cache.k.dtype == torch.bfloat16
    assert q4.view.kv_stats()["total_blocks"] == 2 * fp32.view.kv_stats()["total_blocks"]
    assert q4.view.info()["kv_bytes_per_token"] * 2 == fp32.view.info()["kv_bytes_per_token"]
    assert (q4.view.info()["kv_cache_dtype"], fp32.view.info()["kv_cache_dtype"]) == ("bf16", "fp32")
    assert q4.view.kv_stats()["bytes"] <= budget
    with pytest.raises(InvalidParameter) as err:
        make_tiny_engine(weight_format="fp32", kv_cache_dtype="bf16")
    assert err.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidParameter) as err:
        EngineConfig(kv_cache_dtype="int8")
    assert err.value.param == "kv_cache_dtype"
