"""core/model/native_decoder.py: the decoder's layers in C++ give exactly the bits of model.py's Python, in every
weight format, alone, batched and chunked; where it cannot be built the engine runs Python."""

import logging

import pytest
import torch
from kernel_paths import kernel_path  # noqa: F401 (a fixture: every kernel path this CPU offers)
from test_attention import assert_bit_identical, invariance_cases, run_step

from core import SamplingParams

from core.kernels import loader
from core.model import native_decoder
from core.model.linear import Product

FORMATS = ["fp32", "bf16", "q4_1", "q8_0"]
TEXT = "The quick brown fox jumps over the lazy dog, again and again."


def test_the_decoder_is_built_here():
    """The test set-up installs a compiler and ninja (Makefile); a silent fallback would hide a
    slower engine."""
    assert loader.extension() is not None


def python_and_native(make_engine, fmt):
    results = {}
    for use_native in (False, True):
        engine = make_engine(block_size=4, enable_prefix_caching=False, weight_format=fmt, native=use_native)
        assert (engine.view.model.native is not None) == use_native
        target = engine.tokenizer.encode(TEXT)
        for case, logits in invariance_cases(engine, target).items():
            results[f"{case}, {'C++' if use_native else 'Python'}"] = logits
    return results


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpp_and_python_give_the_same_bits_tiny(make_tiny_engine, fmt):
    assert_bit_identical(python_and_native(make_tiny_engine, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpp_and_python_give_the_same_bits_without_prepacking(make_tiny_engine, monkeypatch, fmt):
    """Where PyTorch has no oneDNN, and the CPU neither AVX-512 BF16 nor AVX2, the products are the
    plain ones (PyTorch's int4 kernel for q4_1), in C++ as in Python."""
    monkeypatch.setattr("core.model.linear.prepacking_available", lambda dtype=None: False)
    monkeypatch.setattr("core.model.linear.q4_kernel", lambda: None)
    monkeypatch.setattr("core.model.linear.f32_kernel", lambda: None)
    assert make_tiny_engine(weight_format=fmt).view.model.layers[0].mlp.down_proj.kernel.product is Product.PLAIN
    assert_bit_identical(python_and_native(make_tiny_engine, fmt))


def test_cpp_and_python_give_the_same_bits_on_onednn(make_tiny_engine, monkeypatch):
    """Where the CPU lacks AVX2 and FMA, fp32 multiplies on oneDNN's prepacked weights, rows padded
    to two, in C++ as in Python."""
    monkeypatch.setattr("core.model.linear.f32_kernel", lambda: None)
    assert make_tiny_engine(weight_format="fp32").view.model.layers[0].mlp.down_proj.kernel.product is Product.ONEDNN
    assert_bit_identical(python_and_native(make_tiny_engine, "fp32"))


@pytest.mark.real_model
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpp_and_python_give_the_same_bits_smollm(make_smollm, fmt):
    assert_bit_identical(python_and_native(lambda **s: make_smollm(**s).engine, fmt))


@pytest.fixture(params=[1, 2, 3])
def threads(request):
    """Run under a given number of torch threads (the one-region step splits its work by them), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def few_token_cases(engine, target_ids):
    """The logits after target_ids, its last token computed in steps of 1 to 9 tokens: alone, as
    the tail of a chunk (a speculative verify pass), and beside other sequences' decodes."""
    L, max_tokens = len(target_ids), engine.view.model.native.decoder.max_step_tokens
    g = torch.Generator().manual_seed(7)

    def seq(ids, rid):
        return engine.make_sequence(list(ids), SamplingParams(temperature=0.0), request_id=rid)

    def prefilled(ids, rid):
        s = seq(ids[:-1], rid)
        run_step(engine, [(s, len(ids) - 1)])
        s.token_ids.append(ids[-1])
        return s

    results = {"one chunk": run_step(engine, [(seq(target_ids, "whole"), L)])["whole"]}
    for n in (1, 2, 5, max_tokens):  # the tail of n tokens as one chunk, alone
        t = seq(target_ids, f"tail{n}")
        run_step(engine, [(t, L - n)])
        results[f"a chunk of {n}"] = run_step(engine, [(t, n)])[f"tail{n}"]
    for n in (4, max_tokens, max_tokens + 1):  # the last token's decode among n decodes
        others = [prefilled(torch.randint(3, 100, (3 + i,), generator=g).tolist(), f"o{n}.{i}") for i in range(n - 1)]
        t = prefilled(target_ids, f"among{n}")
        results[f"a decode among {n}"] = run_step(engine, [(o, 1) for o in others[:n // 2]] + [(t, 1)] +
                                                  [(o, 1) for o in others[n // 2:]])[f"among{n}"]
    return results


@pytest.mark.parametrize("eviction", [{}, {"kv_sink_tokens": 2, "kv_window": 6}], ids=["full", "window"])
def test_a_step_of_a_few_tokens_gives_the_bits_of_the_tensor_path(make_tiny_engine, threads, kernel_path, eviction):
    """A step of at most max_step_tokens tokens runs every layer in one parallel region
    (csrc/decode_step.cpp), its columns, heads and groups split between however many threads there
    are; longer steps go through the tensor kernels. Same bits, on each kernel path, with and
    without KV eviction: the last token computed by a decode alone, as the tail of chunks of 2 to
    max_step_tokens tokens, beside 3, max_step_tokens - 1 and max_step_tokens other decodes (the
    last of them on the tensor path), and within batched and chunked prefills (invariance_cases)."""
    engine = make_tiny_engine(block_size=4, enable_prefix_caching=False, weight_format="q4_1", share_cpu=False,
                              **eviction)
    assert engine.view.model.native.decoder.one_region_step
    target = engine.tokenizer.encode(TEXT)
    assert_bit_identical({**invariance_cases(engine, target), **few_token_cases(engine, target)})


@pytest.mark.real_model
@pytest.mark.parametrize("threads", [1, 3], indirect=True)
def test_a_step_of_a_few_tokens_gives_the_bits_of_the_tensor_path_smollm(make_smollm, threads):
    """The same on SmolLM2, whose nine query heads share three KV heads: with three threads each
    takes three query heads, with two (the other tests) a KV head's queries part between threads."""
    engine = make_smollm(block_size=4, enable_prefix_caching=False, weight_format="q4_1", share_cpu=False).engine
    assert engine.view.model.native.decoder.one_region_step
    target = engine.tokenizer.encode(TEXT)
    assert_bit_identical({**invariance_cases(engine, target), **few_token_cases(engine, target)})


def test_only_q4_1_on_its_own_kernel_takes_the_one_region_step(make_tiny_engine, monkeypatch):
    """The other formats, and q4_1 on PyTorch's int4 kernel (a CPU without AVX2), run every step
    through the tensor path."""
    for fmt in ("fp32", "bf16", "q8_0"):
        assert not make_tiny_engine(weight_format=fmt).view.model.native.decoder.one_region_step
    monkeypatch.setattr("core.model.linear.q4_kernel", lambda: None)
    assert not make_tiny_engine(weight_format="q4_1").view.model.native.decoder.one_region_step


def test_the_same_tokens_through_the_engine(make_tiny_engine):
    from core import SamplingParams
    outputs = []
    for use_native in (False, True):
        engine = make_tiny_engine(weight_format="q4_1", native=use_native)
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
        seqs = [engine.add_request(p, params) for p in ("Hello there", TEXT, "A")]
        while engine.has_unfinished_requests():
            engine.step()
        outputs.append([s.output_token_ids for s in seqs])
    assert outputs[0] == outputs[1]


def test_a_model_with_experts_stays_in_python(tiny_loaded):
    from test_moe import moe_of

    model = moe_of(tiny_loaded)
    assert model.config.num_experts and native_decoder.native_decoder(model) is None


def test_without_a_build_the_engine_runs_python_and_says_so(make_tiny_engine, monkeypatch, caplog):
    def fail(**kwargs):
        raise RuntimeError("no compiler here")

    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "load", fail)
    loader.extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="core.kernels.loader"):
            engine = make_tiny_engine()
        assert engine.view.model.native is None
        assert "could not be built" in caplog.text and "no compiler here" in caplog.text
        seq = engine.add_request("Hello", None)
        while engine.has_unfinished_requests():
            engine.step()
        assert seq.num_output_tokens > 0
    finally:
        loader.extension.cache_clear()  # the next engine loads the real build again


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A build killed part-way leaves torch's lock; every later start would wait on it for ever."""
    import os
    from core.kernels import loader
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = loader.build_name()
    lock = tmp_path / name / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    loader.clear_stale_lock(name, older_than_s=1800)
    assert lock.exists()                                   # a live build's lock stays
    os.utime(lock, (0, 0))                                 # dated 1970: no build runs that long
    loader.clear_stale_lock(name, older_than_s=1800)
    assert not lock.exists()


def test_each_checkout_builds_under_its_own_name():
    from core.kernels import loader
    name = loader.build_name()
    assert name.startswith("sendlens_decoder_") and name == loader.build_name()
