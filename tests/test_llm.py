"""The offline LLM API (vLLM's shape), finish reasons, request metrics, and the command line."""

import subprocess
import sys
from pathlib import Path

import pytest

from bounds import U64, gamma
from core import LLM, InvalidParameter, RequestOutput, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
FINISH_REASONS = {"stop", "length", "abort"}


def greedy(n=6, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture
def llm(make_tiny_llm):
    return make_tiny_llm()


def check_output(out, tokenizer):
    assert isinstance(out, RequestOutput)
    assert out.finished and out.finish_reason in FINISH_REASONS
    assert isinstance(out.prompt_token_ids, list) and out.prompt_token_ids
    assert isinstance(out.token_ids, list) and out.token_ids
    assert isinstance(out.text, str)
    assert isinstance(out.num_cached_tokens, int) and 0 <= out.num_cached_tokens < len(out.prompt_token_ids)
    assert out.outputs[0].token_ids == out.token_ids and out.outputs[0].text == out.text
    assert out.outputs[0].finish_reason == out.finish_reason
    m = out.metrics
    assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s
    assert m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == len(out.token_ids)
    assert m.token_times == sorted(m.token_times)
    assert m.token_times[0] == m.first_token_time and m.token_times[-1] <= m.finished_time
    if len(out.token_ids) > 1:
        assert m.tpot_s > 0
        # exactly, first - arrival + (last - first) <= finished - arrival; in float64, e2e, ttft, the gap
        # last - first, its divide and multiply by n - 1 and the add are 6 roundings, each relative to
        # a number at most e2e: within gamma_6 e2e, doubled for the second order
        assert m.e2e_s >= m.ttft_s + m.tpot_s * (len(out.token_ids) - 1) - 2 * gamma(6, U64) * m.e2e_s
        assert len(m.itl_s) == len(out.token_ids) - 1 and all(x >= 0 for x in m.itl_s)
    else:
        assert m.tpot_s is None
    assert set(m.as_dict()) == {"queue_s", "ttft_s", "tpot_s", "e2e_s"}


def test_a_string_prompt(llm):
    assert isinstance(llm, LLM)
    outs = llm.generate("Once upon a time", greedy())
    assert isinstance(outs, list) and len(outs) == 1
    out = outs[0]
    check_output(out, llm.tokenizer)
    assert out.prompt == "Once upon a time"
    assert out.prompt_token_ids == llm.tokenizer.encode("Once upon a time")
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_a_list_of_strings_keeps_the_order(llm):
    prompts = ["First prompt", "Second, a little longer prompt", "3"]
    outs = llm.generate(prompts, greedy())
    assert [o.prompt for o in outs] == prompts
    assert len({o.request_id for o in outs}) == 3
    for o, p in zip(outs, prompts):
        check_output(o, llm.tokenizer)
        assert o.prompt_token_ids == llm.tokenizer.encode(p)


def test_token_id_prompts(llm):
    ids = llm.tokenizer.encode("Once upon a time")
    (out,) = llm.generate(ids, greedy())
    assert out.prompt is None and out.prompt_token_ids == ids
    assert out.token_ids == llm.generate("Once upon a time", greedy())[0].token_ids
    many = llm.generate([ids, ids[:2]], greedy())
    assert [o.prompt_token_ids for o in many] == [ids, ids[:2]]


def test_one_params_per_prompt(llm):
    outs = llm.generate(["a", "b", "c"], [greedy(2), greedy(5), greedy(1)])
    assert [len(o.token_ids) for o in outs] == [2, 5, 1]
    assert all(o.finish_reason == "length" for o in outs)
    default = llm.generate("a")[0]                    # no params: SamplingParams() defaults
    assert len(default.token_ids) == SamplingParams().max_tokens


def test_wrong_number_of_params_is_refused(llm):
    with pytest.raises(InvalidParameter) as exc:
        llm.generate(["a", "b", "c"], [greedy(), greedy()])
    assert exc.value.param == "sampling_params"
    assert not llm.engine.has_unfinished_requests()


def test_bad_prompts_are_refused_before_anything_runs(llm):
    with pytest.raises(InvalidParameter) as exc:
        llm.generate({"prompt": "x"}, greedy())
    assert exc.value.param == "prompts"
    with pytest.raises(InvalidParameter) as exc:
        llm.generate(["fine", ""], greedy())           # the second is empty: neither is queued
    assert exc.value.param == "prompt"
    assert not llm.engine.has_unfinished_requests()


def test_stop_token_ids(llm):
    base = llm.generate("Once upon a time", SamplingParams(temperature=4.0, seed=3, max_tokens=12))[0]
    target = base.token_ids[4]
    cut = base.token_ids.index(target)
    out = llm.generate("Once upon a time",
                       SamplingParams(temperature=4.0, seed=3, max_tokens=12, stop_token_ids=[target]))[0]
    assert out.token_ids == base.token_ids[: cut + 1]          # ends with the stop token
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_max_tokens_means_length(llm):
    for n in (1, 7):
        out = llm.generate("Hello", greedy(n, ignore_eos=True))[0]
        assert len(out.token_ids) == n
        assert out.finish_reason == "length" and out.stop_reason is None


def test_chat_returns_one_output(llm):
    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, greedy())
    assert isinstance(out, RequestOutput)
    check_output(out, llm.tokenizer)
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(messages)
    both = llm.chat([messages, [{"role": "system", "content": "Be brief."}] + messages], greedy())
    assert isinstance(both, list) and len(both) == 2
    assert both[0].token_ids == out.token_ids


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ("hello", "messages"),
    ([{"role": "user"}], "messages[0]"),
    ([{"role": "user", "content": "a", "name": "x"}], "messages[0]"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_chat_validates_messages(llm, messages, param):
    with pytest.raises(InvalidParameter) as exc:
        llm.chat(messages, greedy())
    assert exc.value.param == param


def test_generate_leaves_the_pool_clean(llm, assert_pool_clean):
    llm.generate(["x " * 40, "y", "z " * 20], greedy(8))
    assert_pool_clean(llm.engine)


@pytest.mark.real_model
def test_end_of_sequence(smollm):
    prompt = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    eos = smollm.tokenizer.eos_token_id
    out = smollm.generate(prompt, greedy(40))[0]
    assert out.finish_reason == "stop" and out.stop_reason == eos
    assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
    assert "<|im_end|>" not in out.text and out.text.strip()
    check_output(out, smollm.tokenizer)
    longer = smollm.generate(prompt, greedy(len(out.token_ids) + 3, ignore_eos=True))[0]
    assert longer.token_ids[: len(out.token_ids)] == out.token_ids
    assert longer.finish_reason == "length" and len(longer.token_ids) == len(out.token_ids) + 3


@pytest.mark.real_model
def test_chat_on_the_real_model(smollm):
    out = smollm.chat([{"role": "user", "content": "Say hello."}], greedy(8))
    check_output(out, smollm.tokenizer)
    assert out.text.strip()


# -- the command line --------------------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "core", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_cli_generate():
    proc = run_cli("generate", "Once upon a time", "--max-tokens", "5", "--model", "tiny")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time")
    assert len(proc.stdout.strip()) > len("Once upon a time")
    assert "5 tokens" in proc.stderr and "finish: length" in proc.stderr


@pytest.mark.parametrize("args, named", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--max-tokens", "many"], "--max-tokens"),
])
def test_cli_bad_values_exit_2(args, named, capsys):
    """In this process (the values are refused before any model loads; test_cli_generate runs the
    command itself): exit status 2, the parameter named, nothing on stdout."""
    from core.__main__ import main
    try:
        status = main(["generate", "Hi", "--model", "tiny", *args])
    except SystemExit as exc:               # argparse's own refusal of a value it cannot parse
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2
    assert named in err
    assert out == ""


def test_unknown_model_is_refused():
    with pytest.raises(InvalidParameter) as exc:
        LLM("no-such-model")
    assert exc.value.param == "model"


def test_an_unknown_engine_setting_is_named(tiny_loaded):
    from core import LLM
    from core.errors import InvalidParameter
    with pytest.raises(InvalidParameter) as info:
        LLM("tiny", loaded=tiny_loaded, max_num_seq=4)  # a typo of max_num_seqs
    assert info.value.param == "max_num_seq"
