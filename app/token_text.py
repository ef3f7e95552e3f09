"""A token's text as a reader should see it: the characters it completes, and its raw bytes when it
holds only part of a character.

SmolLM2's tokenizer is byte-level BPE (as GPT-2's, Radford et al., 2019): the merges work on UTF-8
bytes, so a token need not hold whole characters (an emoji is four bytes, often cut into two or
three tokens). Decoding each token alone would print U+FFFD for those pieces. Here every token
keeps its raw bytes, and its `text` is the characters it completes, so the texts of all tokens
join into the tokenizer's decoding of the ids. Used by the widgets through app/widgets/seam.py.
"""

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet: each of the 256 bytes is stored in the vocabulary as one
    printable character (GPT-2's bytes_to_unicode); this maps the character back to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer, ids) -> list[tuple[bytes, bool]]:
    """(raw bytes, is special) of each token id: what the token stands for before any decoding."""
    decoder = _byte_decoder()
    pieces = tokenizer.vocab_pieces(ids)
    out = []
    for tid, piece in zip(ids, pieces):
        if tid in tokenizer.special_ids:
            out.append((piece.encode("utf-8"), True))   # added tokens are stored as plain text
        else:
            out.append((bytes(decoder[c] for c in piece), False))
    return out


def _whole(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def pieces(tokenizer, ids) -> list[dict]:
    """Each token as {id, text, special, bytes}: `text` the characters it completes (so the texts
    join into the decoded text), `bytes` its raw bytes in hex when it is not whole characters on
    its own (else None)."""
    steps = pieces_steps(tokenizer, ids, max(1, len(ids)))
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def pieces_steps(tokenizer, ids, per_step: int):
    """pieces() as a generator that yields after every `per_step` tokens; returns the list."""
    out, pending = [], b""
    for lo in range(0, len(ids), per_step):
        part = ids[lo:lo + per_step]
        for tid, (raw, special) in zip(part, token_bytes(tokenizer, part)):
            pending += raw
            text, pending = _complete(pending)
            out.append({"id": tid, "text": text, "special": special,
                        "bytes": None if _whole(raw) else raw.hex(" ")})
        yield None
    if pending:  # a text cannot end inside a character, but ids can
        out[-1]["text"] += pending.decode("utf-8", errors="replace")
    return out


def _complete(data: bytes) -> tuple[str, bytes]:
    """The whole characters at the start of data, and the bytes of an unfinished one at its end."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace"), b""   # not UTF-8 at all: show it replaced


def lone_piece(tokenizer, tid: int) -> dict:
    """One token on its own (a neighbour in a list): its text, the whole characters in it, and its
    bytes in hex when it holds part of a character."""
    raw, special = token_bytes(tokenizer, [tid])[0]
    return {"id": tid, "text": raw.decode("utf-8", errors="ignore"), "special": special,
            "bytes": None if _whole(raw) else raw.hex(" ")}
