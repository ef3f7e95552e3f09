"""Widget `prefix-cache` (section 16): cached tokens on the second ask equal the full blocks of the
shared prefix, the per-block match list agrees with the engine and with an independent hash chain,
and the cached first token is transformers' greedy token."""

import hashlib

import numpy as np
import pytest
import torch

from bounds import U64, decimal_half
from conftest import figure_value, shoot_widget, wait_ready

PC = '[data-widget="prefix-cache"]'
SYSTEM = ("You are a helpful assistant for a school science class. Answer in two or three short sentences, "
          "use plain words, give one everyday example, and say so when you are not sure.")
QUESTION = "Why is the sky blue?"
USERS = ["What makes a rainbow?", "How do magnets work?"]


def test_prefix_cache_registers_one_job():
    from app.widgets import BY_NAME
    (m,) = BY_NAME["prefix-cache"].messages
    assert m.type == "prefix_cache" and m.job and m.fields == {"system", "question", "users", "run"}


def test_prefix_cache_refuses_bad_input_naming_the_field(ws):
    good = {"type": "prefix_cache", "id": "bad", "system": SYSTEM, "question": QUESTION}
    cases = [
        ({"system": None}, "system"), ({"system": ""}, "system"), ({"system": "word " * 400}, "system"),
        ({"question": 3}, "question"), ({"question": "why " * 80}, "question"),
        ({"users": "one"}, "users"), ({"users": ["a", "b", "c", "d", "e"]}, "users"), ({"users": [""]}, "users"),
        ({"users": ["why " * 80]}, "users"), ({"run": -1}, "run"), ({"run": "1"}, "run"), ({"color": 1}, "color"),
    ]
    for change, param in cases:
        msg = {k: v for k, v in {**good, **change}.items() if v is not None}
        err = ws.error(msg, "bad")
        assert err["param"] == param, (change, err)
        assert param in err["message"] or param == "color", err
    r = measure(ws, system=SYSTEM, question=QUESTION)        # still usable
    assert r["type"] == "prefix_cache", r


def measure(ws, **fields) -> dict:
    """The job's reply, past its progress messages (which say what is being measured)."""
    mid = ws.next_id()
    ws.send({"type": "prefix_cache", "id": mid, **fields})
    while True:
        m = ws.recv_for(mid, timeout=180)
        if m["type"] != "progress":
            return m
        assert 0 <= m["done"] <= m["total"] and m["note"]


def chain(ids, bs):
    """sha256 over (parent hash, the block's token ids as int64), block by block: full blocks only."""
    out, parent = [], b""
    for i in range(len(ids) // bs):
        digest = hashlib.sha256(parent)
        digest.update(np.asarray(ids[i * bs:(i + 1) * bs], dtype=np.int64).tobytes())
        parent = digest.digest()
        out.append(parent.hex()[:12])
    return out


def check_reply(r, tokenizer):
    bs = r["block_size"]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in [QUESTION, QUESTION, *USERS]]
    assert [p["prompt_tokens"] for p in r["prompts"]] == [len(ids) for ids in prompts]
    first, again = r["prompts"][0], r["prompts"][1]
    assert first["cached_tokens"] == 0 and first["blocks"][0]["status"] == "miss"
    # the second ask: every full block before the last token
    assert again["cached_tokens"] == (len(prompts[1]) - 1) // bs * bs > 0
    assert r["cached_tokens"] == again["cached_tokens"]
    # the server rounds t_off - t_on to 3 places (half a unit), after a float64 difference (u of each
    # side) that we make again here: within decimal_half(3) + 2u (t_off + t_on), doubled for the ulps
    off, on = again["ttft_without_ms"], again["ttft_with_ms"]
    assert r["ttft_saved_ms"] == again["ttft_saved_ms"] == pytest.approx(off - on, rel=0,
                                                                         abs=decimal_half(3) + 4 * U64 * (off + on))
    for ids, p in zip(prompts[2:], r["prompts"][2:]):
        shared = 0
        while shared < min(len(ids), len(prompts[0])) and ids[shared] == prompts[0][shared]:
            shared += 1
        assert p["cached_tokens"] == min(shared // bs, (len(ids) - 1) // bs) * bs > 0   # the shared prefix's full blocks
    for ids, p in zip(prompts, r["prompts"]):
        statuses = [b["status"] for b in p["blocks"]]
        hits = sum(b["matched"] for b in p["blocks"])
        assert hits * bs == p["cached_tokens"], "the per-block list agrees with the engine's count"
        assert statuses[:hits] == ["hit"] * hits                  # matches are a prefix of the chain
        assert [b["hash"] for b in p["blocks"] if b["full"]] == chain(ids, bs)
        assert len(p["blocks"]) == -(-len(ids) // bs)
        assert p["first_token_with"] == p["first_token_without"]
        assert len(p["ttft_with_runs_ms"]) == len(p["ttft_without_runs_ms"]) == r["repeats"]
        assert p["ttft_with_ms"] == sorted(p["ttft_with_runs_ms"])[r["repeats"] // 2]      # the median
    assert r["machine"]["threads"] >= 1 and r["machine"]["measured_at"]
    return prompts


def test_second_ask_is_served_from_the_cache(ws, live_server):
    r = measure(ws, system=SYSTEM, question=QUESTION, users=USERS, run=7)
    assert r["type"] == "prefix_cache", r
    check_reply(r, live_server.runtime.engine.tokenizer)
    again = measure(ws, system=SYSTEM, question=QUESTION, users=USERS, run=7)
    assert again["machine"] == r["machine"], "the same run comes from the job cache"
    fresh = measure(ws, system=SYSTEM, question=QUESTION, users=USERS, run=8)
    assert fresh["type"] == "prefix_cache" and fresh["cached_tokens"] == r["cached_tokens"]


@pytest.mark.real_model
def test_cached_first_token_is_transformers_greedy_token(real_ws, hf_reference, smollm_loaded):
    hf_model, tokenizer = hf_reference
    r = measure(real_ws, system=SYSTEM, question=QUESTION, users=USERS, run=1)
    assert r["type"] == "prefix_cache", r
    prompts = check_reply(r, smollm_loaded.tokenizer)
    for ids, p in zip(prompts, r["prompts"]):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
        assert p["first_token_with"] == int(logits.argmax()), p["label"]


@pytest.mark.browser
@pytest.mark.real_model
def test_prefix_cache_page(pg, artifacts_dir):
    query = "?question=Why+is+the+sky+blue%3F&users=What+makes+a+rainbow%3F%0AHow+do+magnets+work%3F"
    shoot_widget(pg, "prefix-cache", artifacts_dir, query, ready_timeout=180_000)
    page = pg.page
    pg.goto(f"/embed/prefix-cache{query}")
    wait_ready(page, PC, timeout=180_000)
    assert page.input_value(f'{PC} textarea[name="users"]') == "What makes a rainbow?\nHow do magnets work?"
    cached = figure_value(page, "cached_tokens", PC)
    assert cached > 0 and cached % 16 == 0
    saved = figure_value(page, "ttft_saved_ms", PC)
    off, on = figure_value(page, "ttft_without_ms", PC), figure_value(page, "ttft_with_ms", PC)
    assert saved == pytest.approx(off - on, rel=0, abs=decimal_half(3) + 4 * U64 * (off + on))    # as in check_reply
    assert page.locator(f"{PC} .pc-brow").count() == 4
    assert page.locator(f"{PC} .pc-b.pc-hit").count() >= cached // 16
    assert "thread" in page.inner_text(f"{PC} .pc-machine")
    pg.assert_clean()
