"""Widget `kv-memory` (section 10): the calculator's presets from the models' public configs, and
the live pool's bytes per token from the engine's own KV tensors (checked against transformers)."""

import math

import pytest

from conftest import figure_value, shoot_widget, wait_ready

KVM = '[data-widget="kv-memory"]'
BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "int4": 0.5}

# From each model's config.json (num_hidden_layers, num_key_value_heads, head size =
# hidden_size / num_attention_heads); DeepSeek-V3 caches kv_lora_rank 512 + qk_rope_head_dim 64.
PUBLIC_CONFIGS = {
    "smollm2-135m": 2 * 30 * 3 * (576 // 9),
    "llama-3.1-8b": 2 * 32 * 8 * (4096 // 32),
    "llama-3.1-70b": 2 * 80 * 8 * (8192 // 64),
    "mixtral-8x7b": 2 * 32 * 8 * (4096 // 32),
    "deepseek-v3": 61 * (512 + 64),
}


def test_kv_memory_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["kv-memory"].messages
    assert m.type == "kv_pool" and m.job and m.fields == frozenset()


def test_smollm2_bf16_is_23040_bytes_per_token():
    assert PUBLIC_CONFIGS["smollm2-135m"] * BYTES["bf16"] == 23_040


def test_kv_pool_is_the_tensors_bytes_over_the_slots(ws, live_server):
    r = ws.call("kv_pool")
    assert r["type"] == "kv_pool", r
    cache = live_server.runtime.engine.view.cache
    tensors = [cache.k, cache.v]
    nbytes = sum(math.prod(t.shape) * t.element_size() for t in tensors)
    slots = cache.num_blocks * cache.block_size                   # blocks x slots per block
    assert r["kv_bytes"] == nbytes
    assert r["token_slots"] == slots == r["total_blocks"] * r["block_size"]
    assert r["live_pool_bytes_per_token"] == nbytes / slots
    h = ws.hello
    assert r["live_pool_bytes_per_token"] == 2 * h["num_layers"] * h["num_kv_heads"] * h["head_dim"] * r["bytes_per_value"]
    assert r["tensors"]["k"]["shape"] == list(cache.k.shape)
    common = {"layers": h["num_layers"], "blocks": r["total_blocks"], "KV heads": h["num_kv_heads"]}
    if r["dtype"] == "float32":
        expected = {name: {**common, "head size": h["head_dim"], "slots per block": r["block_size"]} for name in "kv"}
    else:                                                        # bfloat16, in the pairs attention multiplies
        expected = {"k": {**common, "pairs of dimensions": h["head_dim"] // 2, "slots per block": r["block_size"],
                          "dimension in the pair": 2},
                    "v": {**common, "pairs of slots": r["block_size"] // 2, "head size": h["head_dim"],
                          "slot in the pair": 2}}
    for name, tensor in (("k", cache.k), ("v", cache.v)):       # each axis named, in the tensor's order
        assert dict(zip(r["tensors"][name]["dims"], tensor.shape)) == expected[name]
        assert len(r["tensors"][name]["dims"]) == tensor.dim()


def test_kv_pool_refuses_fields_it_does_not_take(ws):
    err = ws.error({"type": "kv_pool", "id": "bad", "preset": "llama-3.1-8b"}, "bad")
    assert err["param"] == "preset", err
    assert ws.call("kv_pool")["type"] == "kv_pool"      # the connection is still usable


@pytest.mark.real_model
def test_live_pool_matches_the_transformers_config(real_ws, hf_reference):
    hf_model, _ = hf_reference
    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    r = real_ws.call("kv_pool")
    # the pool keeps bf16 exactly where attention reads bf16 (q4_1 on the engine's kernels)
    bf16 = real_ws.hello["attention_operands"] == "bf16"
    assert r["dtype"] == ("bfloat16" if bf16 else "float32") and r["bytes_per_value"] == (2 if bf16 else 4)
    assert r["live_pool_bytes_per_token"] == 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * \
        r["bytes_per_value"] == (23_040 if bf16 else 46_080) == real_ws.hello["kv_bytes_per_token"]


@pytest.mark.browser
@pytest.mark.real_model
def test_calculator_presets_in_the_browser(pg, real_ws, artifacts_dir):
    shoot_widget(pg, "kv-memory", artifacts_dir, "?preset=deepseek-v3&dtype=fp8&context=131072&batch=8")
    page = pg.page
    pg.goto("/embed/kv-memory")
    wait_ready(page, KVM)
    assert page.input_value(f'{KVM} select[name="dtype"]') == "bf16"
    for preset, values in PUBLIC_CONFIGS.items():
        page.select_option(f'{KVM} select[name="preset"]', preset)
        for dtype, b in BYTES.items():
            page.select_option(f'{KVM} select[name="dtype"]', dtype)
            per = figure_value(page, "kv_bytes_per_token", KVM)
            assert per == values * b, (preset, dtype, per)
            assert figure_value(page, "kv_bytes_total", KVM) == values * b * 8192
    assert figure_value(page, "kv_bytes_per_token", KVM) != 23_040
    page.select_option(f'{KVM} select[name="preset"]', "smollm2-135m")
    page.select_option(f'{KVM} select[name="dtype"]', "bf16")
    assert figure_value(page, "kv_bytes_per_token", KVM) == 23_040
    # the live pool: the engine's tensors over its slots (bf16 where attention is), and the
    # calculator agrees at the pool's dtype
    assert figure_value(page, "live_pool_bytes_per_token", KVM) == real_ws.call("kv_pool")["live_pool_bytes_per_token"]
    assert figure_value(page, "live_pool_bytes_per_token", KVM) == real_ws.hello["kv_bytes_per_token"]
    assert "✓" in page.inner_text(f"{KVM} .kvm-check")
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_calculator_takes_its_options_from_the_url(pg):
    page = pg.page
    pg.goto("/embed/kv-memory?preset=llama-3.1-70b&dtype=fp8&context=32768&batch=4")
    wait_ready(page, KVM)
    assert page.input_value(f'{KVM} select[name="preset"]') == "llama-3.1-70b"
    per = PUBLIC_CONFIGS["llama-3.1-70b"] * 1
    assert figure_value(page, "kv_bytes_per_token", KVM) == per
    assert figure_value(page, "kv_bytes_total", KVM) == per * 32768 * 4
    # a custom shape: the formula follows the fields
    page.fill(f'{KVM} input[name="layers"]', "10")
    assert page.input_value(f'{KVM} select[name="preset"]') == "custom"
    assert figure_value(page, "kv_bytes_per_token", KVM) == 2 * 10 * 8 * 128 * 1
    pg.assert_clean()
