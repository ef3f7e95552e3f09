"""Widget `chat` (section 1): a real chat with the model, streamed token by token.

Messages: `generate` {messages | prompt, max_tokens, temperature, top_k, top_p, seed, stop, n,
beam_width, length_penalty} -> `accepted`, then `token` per token and `done` (finish reason,
cached tokens, timings and the request's timeline of engine steps); with n > 1 samples, each
token says which `sample` it belongs to and `done` lists every sample's ending; with beam_width,
a beam search (core/engine/beam_search.py): no tokens, and `done` lists the beams best first;
`template` {messages} -> the chat template's tokens, each labelled with where it came from.

A long chat is never rendered and tokenized on the reader's thread beside the engine: a
`template` estimated over `work_slice_tokens` tokens is answered by a job, in slices (see
`template`), and so is a long `generate`'s prompt before its request is submitted (the seam's
`chat_prompt_steps`, run by app/prompt_job.py), with the same replies. The prompt comes from the
seam, as the stepper's of section 7 (`generation`) does.
"""

from core.engine.beam_search import BeamSearchParams
from core.engine.outputs import RequestOutput
from core.engine.sampling_params import SamplingParams
from core.errors import InvalidParameter, is_int
from core.model.tokenizer import drain

from .base import Widget, message
from .seam import chat_messages, chat_prompt_steps, ms, pieces_steps


def sampling_params(msg: dict, config, **extra) -> SamplingParams:
    max_tokens = msg.get("max_tokens", config.default_max_tokens)
    if is_int(max_tokens) and max_tokens > config.max_tokens_limit:
        raise InvalidParameter("max_tokens", f"must be at most {config.max_tokens_limit} on this server")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=msg.get("temperature", 0.0),
        top_k=msg.get("top_k", 0),
        top_p=msg.get("top_p", 1.0),
        seed=msg.get("seed"),
        stop=msg.get("stop"),
        n=samples(msg, config),
        **extra,
    )


def samples(msg: dict, config) -> int:
    n = msg.get("n", 1)
    if is_int(n) and n > config.max_samples:
        raise InvalidParameter("n", f"must be at most {config.max_samples} on this server (max_samples)")
    return n


SAMPLING_ONLY = ("n", "temperature", "top_k", "top_p", "seed", "stop")  # a beam search takes none of these


def beam_params(msg: dict, config) -> BeamSearchParams | None:
    """The beam search a generate message asks for (`beam_width`, `length_penalty`), or None."""
    if "beam_width" not in msg:
        if "length_penalty" in msg:
            raise InvalidParameter("length_penalty", "applies to a beam search only: give beam_width too")
        return None
    width = msg["beam_width"]
    if is_int(width) and width > config.max_beam_width:
        raise InvalidParameter("beam_width", f"must be at most {config.max_beam_width} on this server "
                                             "(max_beam_width)")
    for name in SAMPLING_ONLY:
        if name in msg:
            raise InvalidParameter(name, "cannot be combined with beam_width: a beam search keeps the "
                                         "beam_width most likely continuations, it does not sample")
    max_tokens = msg.get("max_tokens", config.default_max_tokens)
    if is_int(max_tokens) and max_tokens > config.max_tokens_limit:
        raise InvalidParameter("max_tokens", f"must be at most {config.max_tokens_limit} on this server")
    return BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                            length_penalty=msg.get("length_penalty", 1.0))


def beam_messages(tokenizer):
    """The messages of a beam search: nothing until it ends, then done with its beams, best first."""
    samples = stream_messages(tokenizer)

    def format_output(mid, out: RequestOutput) -> list[dict]:
        messages = samples(mid, out)
        for m in messages:
            if m["type"] == "done":
                del m["samples"]
                m["beams"] = [{"beam": c.index, "text": c.text, "token_ids": c.token_ids,
                               "cum_logprob": c.cum_logprob, "finish_reason": c.finish_reason}
                              for c in out.samples]
        return messages
    return format_output


def token_message(mid, out: RequestOutput) -> dict:
    index = len(out.token_ids) - 1
    # metrics is the request's live record, which may have moved on: index it, never [-1]
    return {"type": "token", "id": mid, "index": index, "token_id": out.new_token_ids[-1],
            "text": out.new_text, "t_ms": ms(out.metrics.token_times[index] - out.metrics.arrival_time)}


def done_message(mid, out: RequestOutput, tokenizer) -> dict:
    m = out.metrics
    t0 = m.arrival_time
    stop = out.stop_reason
    return {
        "type": "done", "id": mid,
        "finish_reason": out.finish_reason,
        "stop_reason": stop,
        "stop_reason_text": tokenizer.token_texts([stop])[0] if isinstance(stop, int) else stop,
        "num_cached_tokens": out.num_cached_tokens,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "text": out.text,
        "metrics": {"queue_ms": ms(m.queue_s), "ttft_ms": ms(m.ttft_s), "tpot_ms": ms(m.tpot_s),
                    "e2e_ms": ms(m.e2e_s)},
        "timeline": {
            "first_scheduled_ms": ms(m.first_scheduled_time - t0) if m.first_scheduled_time else None,
            "first_token_ms": ms(m.ttft_s),
            "finished_ms": ms(m.e2e_s),
            "steps": [{"step": s.step, "start_ms": ms(s.start_time - t0), "duration_ms": ms(s.duration_s),
                       "kind": s.kind, "num_tokens": s.num_tokens, "batch_seqs": s.batch_seqs,
                       "batch_tokens": s.batch_tokens} for s in m.steps],
        },
    }


def sample_token_messages(mid, out: RequestOutput) -> list[dict]:
    """n > 1: a token message for each sample that got one, with the sample's index."""
    t0 = out.metrics.arrival_time
    return [{"type": "token", "id": mid, "sample": c.index, "index": len(c.token_ids) - 1,
             "token_id": c.new_token_ids[-1], "text": c.new_text,
             "t_ms": ms(c.metrics.token_times[len(c.token_ids) - 1] - t0)}
            for c in out.samples if c.new_token_ids]


def stream_messages(tokenizer):
    """The messages for one engine output of a generate request: a token, then done or error."""
    def format_output(mid, out: RequestOutput) -> list[dict]:
        messages = []
        if out.samples is not None:
            messages.extend(sample_token_messages(mid, out))
        elif out.new_token_ids:
            messages.append(token_message(mid, out))
        if out.error:
            messages.append({"type": "error", "id": mid, "code": "internal_error", "message": out.error,
                             "param": None})
        elif out.finished:
            done = done_message(mid, out, tokenizer)
            if out.samples is not None:
                done["samples"] = [{"sample": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                    "completion_tokens": len(c.token_ids), "text": c.text} for c in out.samples]
            messages.append(done)
        return messages
    return format_output


def generate(call) -> None:
    prompt = chat_prompt_steps(call)      # a long prompt is tokenized by a job, not here (Call.submit)
    beams = beam_params(call.msg, call.config)
    if beams is not None:
        call.submit(prompt, beams, beam_messages(call.tokenizer), accepted=lambda seq: {
            "prompt_tokens": seq.num_prompt_tokens, "max_tokens": beams.max_tokens, "beam_width": beams.beam_width,
            "context_window": call.info["context_window"]})
        return
    params = sampling_params(call.msg, call.config)
    call.submit(prompt, params, stream_messages(call.tokenizer), accepted=lambda seq: {
        "prompt_tokens": seq.num_prompt_tokens, "max_tokens": params.max_tokens, "n": params.n,
        "context_window": call.info["context_window"]})


def template(call) -> None:
    """The chat template's tokens. A chat whose estimate is over `work_slice_tokens` is rendered
    and labelled as a job, in slices between engine steps, never on the reader's thread."""
    messages = chat_messages(call.msg, call.config)
    tokenizer, per_slice, window = call.tokenizer, call.config.work_slice_tokens, call.info["context_window"]
    if call.inline():
        rendered = tokenizer.render_chat(messages)
        call.charge(len(rendered.token_ids))
        call.reply(drain(template_reply(tokenizer, rendered, window, len(rendered.token_ids))))
        return
    settle = call.settle_later()

    def work(engine):
        rendered = yield from tokenizer.render_chat_steps(messages, per_step=per_slice)
        settle(len(rendered.token_ids))
        return (yield from template_reply(tokenizer, rendered, window, per_slice))
    call.sliced({"messages": messages}, work)


def template_reply(tokenizer, rendered, context_window: int, per_slice: int):
    """The reply to `template`, built `per_slice` tokens at a step (a generator)."""
    # each token's text as the characters it completes, and its bytes when it holds part of one
    # (an emoji cut in two), as the tokenizer widget shows them: the same chips
    shown = yield from pieces_steps(tokenizer, rendered.token_ids, max(1, per_slice))
    return {
        "text": rendered.text, "num_tokens": len(rendered.token_ids),
        "context_window": context_window,
        "tokens": [{"id": t.id, "text": p["text"], "bytes": p["bytes"], "kind": t.kind.value, "role": t.role,
                    "message": t.message} for t, p in zip(rendered.tokens, shown)],
    }


WIDGET = Widget("chat", messages=(
    message("generate", {"messages", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "n",
                         "beam_width", "length_penalty"},
            generate, request=True),
    message("template", {"messages"}, template),
))
