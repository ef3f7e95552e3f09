"""Widget `tokenizer` (section 2): any text cut into the model's real tokens.

Message: `tokenize` {text} -> `tokens` [{id, text, special, bytes}], `num_tokens`, `num_words`,
`num_chars`. A short text is answered at once; one whose estimate (its bytes) is over
`work_slice_tokens` is tokenized as a job, in slices between engine steps, never on the reader's
thread beside the engine. Either way it costs the connection's work budget the tokens it makes
(app/budget.py).

SmolLM2's tokenizer is byte-level BPE (as GPT-2's, Radford et al., 2019): the text is first
turned into UTF-8 bytes, and the merges work on bytes, so a token need not hold whole
characters (an emoji is four bytes, often cut into two or three tokens). Decoding each token
alone would print U+FFFD for those pieces, and the pieces would no longer join back into the
text. Here every token keeps its raw bytes, and its `text` is the characters it completes: the
`text` of all tokens joined is exactly the tokenizer's decoding of the ids (for this tokenizer,
which has no normalizer, the text itself).

Special strings typed in the text are matched as added tokens before BPE runs, exactly as the
engine tokenizes a prompt: `<|im_start|>` typed by a user is ONE special token (id 1), not
eleven characters. That is what this widget shows, because that is what the model receives.
"""

from core.model.tokenizer import drain

from .base import Widget, message, text
from .seam import pieces_steps


def tokenize(call) -> None:
    value = text(call.msg, "text")
    tokenizer, per_slice, vocab_size = call.tokenizer, call.config.work_slice_tokens, call.info["vocab_size"]
    if call.inline():
        ids = tokenizer.encode(value)
        call.charge(len(ids))
        steps = pieces_steps(tokenizer, ids, max(1, len(ids)))
        call.reply(drain(reply(value, ids, steps, vocab_size)))
        return
    settle = call.settle_later()

    def work(engine):
        ids = tokenizer.encode(value)                      # one tokenizer call: a single slice
        settle(len(ids))
        yield None
        return (yield from reply(value, ids, pieces_steps(tokenizer, ids, per_slice), vocab_size))
    call.sliced({"text": value}, work)


def reply(value: str, ids: list[int], steps, vocab_size: int):
    tokens = yield from steps
    return {
        "tokens": tokens,
        "num_tokens": len(ids),
        "num_words": len(value.split()),      # runs of non-whitespace characters
        "num_chars": len(value),              # Unicode code points
        "num_bytes": len(value.encode("utf-8")),
        "vocab_size": vocab_size,
    }


WIDGET = Widget("tokenizer", messages=(
    message("tokenize", {"text"}, tokenize),
))
