"""The model's tokenizer and chat template, and which token of a prompt came from where.

Wraps the Hugging Face fast tokenizer that toy_models builds from the GGUF file (byte-level BPE,
49152 pieces). `render_chat` applies the model's own Jinja chat template and labels every token:
the message content it came from, the role wrapper around it (`<|im_start|>user\n` ...), text the
template inserts on its own (SmolLM2's default system prompt), the generation prompt that invites
the assistant's turn, and special tokens.

`encode_steps` encodes a long text in pieces, for a job that must not hold the engine's thread
for one long tokenizer call: it cuts the text only where byte-level BPE's pre-tokenizer (GPT-2's
split regex, Radford et al., 2019) always begins a new word, so the pieces' ids joined are
exactly the whole text's.
"""

import bisect
import re
import threading
from dataclasses import dataclass
from enum import Enum

from core.errors import InvalidParameter


class TokenKind(str, Enum):
    CONTENT = "content"                      # the message's own text
    WRAPPER = "wrapper"                      # the role wrapper around it
    INSERTED = "inserted"                    # text the template adds by itself (default system prompt)
    GENERATION_PROMPT = "generation_prompt"  # the opening of the assistant's turn
    SPECIAL = "special"                      # a special token (<|im_start|>, <|im_end|>, ...)


@dataclass
class ChatToken:
    id: int
    text: str            # this token alone, decoded
    kind: TokenKind
    role: str | None     # role of the message (or inserted turn) the token belongs to
    message: int | None  # index into the messages, None for inserted text


@dataclass
class RenderedChat:
    text: str
    token_ids: list[int]
    tokens: list[ChatToken]


CHARS_PER_TOKEN = 4        # about this many characters a token of English text: a step's characters per token of work


# Where GPT-2's pre-tokenizer regex (`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
# \s+(?!\S)|\s+`) always starts a new word, whatever follows: before a space that follows a
# non-space and precedes a letter (the word " The" starts at the space), and after a newline that
# follows a non-space and precedes one (the newline is a word of its own). Only ASCII is trusted
# on both sides, so Unicode's idea of a space and Python's cannot differ there.
_WORD_START = re.compile(r"(?<=[!-~])(?= [A-Za-z])|(?<=[!-~]\n)(?=[!-~])")


def drain(steps):
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


# Private-use characters mark where each message's content sits in the rendered template.
_OPEN, _MID, _CLOSE = "\ue000", "\ue001", "\ue002"


class Tokenizer:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self._lock = threading.Lock()  # the Rust tokenizer must not be entered by two threads at once
        self.eos_token_id: int = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size = len(hf_tokenizer)
        self.special_ids = {i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}
        self.special_strings = sorted((hf_tokenizer.added_tokens_decoder[i].content for i in self.special_ids),
                                      key=len, reverse=True)
        self.cuttable = _cuttable(hf_tokenizer)      # encode_steps may cut a text at word starts

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(str(path)))

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self.hf.encode(text, add_special_tokens=False)

    def encode_steps(self, text: str, per_step: int):
        """encode() as a generator that yields after each piece of about `per_step` tokens of work
        (CHARS_PER_TOKEN characters a token); returns the ids, exactly encode(text)'s. A text with
        no place to cut safely (or a tokenizer whose pre-tokenizer is not byte-level BPE's) is one
        piece."""
        size, ids, start = max(1, per_step) * CHARS_PER_TOKEN, [], 0
        while start < len(text):
            cut = _WORD_START.search(text, start + size) if self.cuttable and start + size < len(text) else None
            end = cut.start() if cut is not None else len(text)
            ids += self.encode(text[start:end])
            start = end
            yield None
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids) -> list[str]:
        """Each token decoded on its own (a piece of a multi-byte character shows as U+FFFD)."""
        with self._lock:
            return [self.hf.decode([i], skip_special_tokens=False) for i in ids]

    def vocab_pieces(self, ids) -> list[str]:
        """Each token as its vocabulary stores it: byte-level BPE writes every byte as one printable
        character (GPT-2's table), so a piece may be part of a character (the tokenizer widget
        reads the bytes back)."""
        with self._lock:
            return self.hf.convert_ids_to_tokens(list(ids))

    def render_template(self, messages, add_generation_prompt: bool = True) -> str:
        with self._lock:
            return self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_template(messages, add_generation_prompt))

    def render_chat(self, messages, add_generation_prompt: bool = True) -> RenderedChat:
        """The template applied to `messages`, with every token labelled (see TokenKind)."""
        return drain(self.render_chat_steps(messages, add_generation_prompt))

    def render_chat_steps(self, messages, add_generation_prompt: bool = True, per_step: int = 1 << 30):
        """render_chat as a generator that yields between pieces of about `per_step` tokens of work
        (CHARS_PER_TOKEN characters a token), so a long chat can be labelled in short slices; the
        one tokenizer call that encodes the text is a single piece. Returns the RenderedChat."""
        text = self.render_template(messages, add_generation_prompt)
        yield None
        labels = yield from self._char_labels(messages, text, add_generation_prompt, per_step * CHARS_PER_TOKEN)
        with self._lock:   # the Rust tokenizer's own encoding: ids and offsets without the wrapper's conversions
            enc = self.hf.backend_tokenizer.encode(text, add_special_tokens=False)
            ids, offsets = enc.ids, enc.offsets
        yield None
        tokens = []
        for lo in range(0, len(ids), per_step):
            part = ids[lo:lo + per_step]
            for tid, piece, (start, _) in zip(part, self.token_texts(part), offsets[lo:lo + per_step]):
                kind, role, message = labels[start] if start < len(labels) else (TokenKind.INSERTED, None, None)
                if tid in self.special_ids:
                    kind = TokenKind.SPECIAL
                tokens.append(ChatToken(tid, piece, kind, role, message))
            yield None
        return RenderedChat(text, ids, tokens)

    def _char_labels(self, messages, text, add_generation_prompt, per_step: int):
        """(kind, role, message index) for every character of the rendered text, yielding after
        every `per_step` characters of each pass (a generator: `yield from` it).

        Three renders, whatever the length of the chat: the text itself, the text with each
        message's content marked, and the text without the generation prompt.
        """
        plain = [(TokenKind.WRAPPER, None, None)] * len(text)
        if any(c in m["content"] for m in messages for c in (_OPEN, _MID, _CLOSE)):
            return plain  # our markers already in the text: label plainly
        # 1. Which characters are message content, and where each content begins and ends.
        marked = [{**m, "content": f"{_OPEN}{i}{_MID}{m['content']}{_CLOSE}"} for i, m in enumerate(messages)]
        raw = self.render_template(marked, add_generation_prompt)
        content_of, starts, ends = [], {}, {}
        current, pos, next_yield = None, 0, per_step
        while pos < len(raw):
            if pos >= next_yield:
                next_yield += per_step
                yield None
            ch = raw[pos]
            if ch == _OPEN:
                mid = raw.index(_MID, pos)
                current = int(raw[pos + 1:mid])
                starts[current] = len(content_of)
                pos = mid + 1
                continue
            if ch == _CLOSE:
                ends[current] = len(content_of)
                current = None
            else:
                content_of.append(current)
            pos += 1
        if len(content_of) != len(text) or len(starts) != len(messages) or len(ends) != len(messages):
            return plain  # the template altered or dropped content
        # 2. Each message's turn opens at the last special token before its content (its role
        #    wrapper, <|im_start|>user\n); text before the first turn is the template's own
        #    addition (SmolLM2's default system prompt); text after the chat is the generation prompt.
        opens = [self._last_special_before(text, ends[i - 1] if i else 0, starts[i]) for i in range(len(messages))]
        chat_end = len(text)
        if add_generation_prompt:
            without = self.render_template(messages, add_generation_prompt=False)
            if text.startswith(without):
                chat_end = len(without)
        inserted_role = self._role_after_special(text, 0)
        labels = []
        for c in range(len(text)):
            if c and c % per_step == 0:
                yield None
            if c >= chat_end:
                labels.append((TokenKind.GENERATION_PROMPT, "assistant", None))
            elif c < opens[0]:
                labels.append((TokenKind.INSERTED, inserted_role, None))
            else:
                i = bisect.bisect_right(opens, c) - 1
                kind = TokenKind.CONTENT if content_of[c] == i else TokenKind.WRAPPER
                labels.append((kind, messages[i]["role"], i))
        return labels

    def _last_special_before(self, text, lo, hi):
        """Start of the last special token in text[lo:hi], or lo if there is none."""
        best = lo
        for s in self.special_strings:
            at = text.rfind(s, lo, hi)
            if at > best:
                best = at
        return best

    def _role_after_special(self, text, at):
        for s in self.special_strings:
            if text.startswith(s, at):
                line = text[at + len(s):].split("\n", 1)[0].strip()
                return line or None
        return None


ROLES = ("system", "user", "assistant")


def validate_messages(messages) -> list[dict]:
    """A chat: a non-empty list of {"role", "content"} with known roles and string content."""
    if not isinstance(messages, list) or not messages:
        raise InvalidParameter("messages", "must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise InvalidParameter(f"messages[{i}]", "must have exactly the keys role and content")
        if m["role"] not in ROLES:
            raise InvalidParameter(f"messages[{i}].role", f"must be one of {ROLES}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise InvalidParameter(f"messages[{i}].content", "must be a string")
    return messages


def _cuttable(hf_tokenizer) -> bool:
    """May a text be encoded in pieces cut at _WORD_START? Only where the pieces cannot encode
    differently from the whole: no normalizer, byte-level BPE's own pre-tokenizer (its regex, no
    prefix space), and no added token with whitespace in it or that strips the whitespace beside
    it (an added token is matched before pre-tokenization, so one holding or eating a space or a
    newline could straddle a cut)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return False
    from tokenizers import pre_tokenizers
    pre = backend.pre_tokenizer
    if not isinstance(pre, pre_tokenizers.ByteLevel) or not pre.use_regex or pre.add_prefix_space:
        return False
    return not any(t.lstrip or t.rstrip or any(c.isspace() for c in t.content)
                   for t in hf_tokenizer.added_tokens_decoder.values())
