"""Streaming detokenization and stop strings.

Byte-level BPE tokens are not characters: one emoji can take several tokens, and a token alone
may decode to half a character (U+FFFD). Text is released only once it is whole, decoding a
short window of recent tokens rather than the whole output each step (as vLLM's incremental
detokenizer does). When stop strings are set, the last few characters are held back until it
is clear they do not begin a stop string, so a client never sees text that is then taken back.
"""


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: earlier tokens no longer change the text
        self.read_offset = 0    # tokens up to here are already in self.text
        self.text = ""          # all text so far
        self.released = 0       # characters of self.text already handed out

    def append(self, token_id: int) -> str | None:
        """Add one token; return the stop string it completed, if any (the text is cut there)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        after = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            search_from = max(0, len(self.text) - self.holdback)
            self.text += new
            hits = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) != -1]
            if hits:
                at, s = min(hits)
                self.text = self.text[:at]
                return s
        return None

    def drop_held_back(self) -> None:
        """On abort: text held back near a stop string was never shown, and now never will be,
        so the final text is exactly what was streamed."""
        self.text = self.text[: self.released]

    def release(self, finished: bool) -> str:
        """Text that is now safe to show and was not shown before."""
        end = len(self.text) if finished else max(self.released, len(self.text) - self.holdback)
        out = self.text[self.released:end]
        self.released = end
        return out
