"""Widget `embedding` (section 3): a token's row of the embedding table, and its nearest rows.

Message: `embedding` {token_id | text, k} -> `token_id`, `row` (the token's real row: hidden_size
values), `row_norm`, and `neighbours` [{id, text, special, bytes, cosine}]: the k other rows
with the highest cosine similarity to it, over the whole table (the token itself is left out).
With `text`, the token is the text's first token, and the reply's `text_tokens` says which.

The lookup is indexing, E[token_id], as in every transformer since Bengio et al. (2003): no
multiplication, the row IS the vector. The neighbours are the classic word-vector probe
(Mikolov et al., 2013): cos(a, b) = a.b / (|a| |b|). Over SmolLM2's 49,152 x 576 table that is
one matrix-vector product, run as a job in a few row chunks so that no slice of it delays a
chat's next token by more than a few milliseconds. The result is cached by (token_id, k).
"""

import torch

from core.errors import InvalidParameter, is_int

from ..jobs import Progress
from .base import Widget, encode, integer, message, rounded
from .seam import lone_piece, pieces

MAX_K = 50
DEFAULT_K = 10
CHUNK_ROWS = 16384        # rows of the table per slice of the job (about 13 ms, measured on 2 cores)


def chosen_token(call) -> tuple[int, list[dict] | None]:
    """The token id the message asks about, and the text's tokens when it gave text."""
    msg = call.msg
    has_id, has_text = "token_id" in msg, "text" in msg
    if has_id == has_text:
        raise InvalidParameter("token_id", "give either token_id or text, not both or neither")
    if has_id:
        vocab = call.info["vocab_size"]
        value = msg["token_id"]
        if not is_int(value) or not 0 <= value < vocab:
            raise InvalidParameter("token_id", f"must be an integer from 0 to {vocab - 1}, got {value!r}")
        return value, None
    value = msg["text"]
    if not isinstance(value, str) or not value:
        raise InvalidParameter("text", "must be a non-empty string")
    ids = encode(call, value, "text")
    return ids[0], pieces(call.tokenizer, ids)


def neighbours_work(token_id: int, k: int):
    """The job: the row, then cosines against the table in chunks of rows, then the top k."""
    def work(engine):
        table = engine.view.model.embed_tokens.weight.detach()  # (V, C): one row per token
        row = table[token_id]                                # (C,): the lookup is this index
        row_norm = row.norm()
        cosines = torch.empty(table.shape[0], dtype=table.dtype)  # (V,)
        total = table.shape[0]
        for start in range(0, total, CHUNK_ROWS):
            chunk = table[start:start + CHUNK_ROWS]                 # (R, C)
            norms = chunk.norm(dim=1).clamp_min(1e-12)              # (R,)
            cosines[start:start + CHUNK_ROWS] = (chunk @ row) / (norms * row_norm.clamp_min(1e-12))
            yield progress(start + chunk.shape[0], total)
        cosines[token_id] = float("-inf")                           # the token itself is not its neighbour
        values, ids = cosines.topk(k)                               # (k,), (k,)
        tokenizer = engine.view.tokenizer
        return {
            "token_id": token_id,
            "token": lone_piece(tokenizer, token_id),
            "row": rounded(row, 7),
            "row_norm": round(float(row_norm), 6),
            "num_rows": total,
            "hidden_size": table.shape[1],
            "k": k,
            "self_excluded": True,
            "neighbours": [{**lone_piece(tokenizer, int(i)), "cosine": round(float(v), 7)}
                           for v, i in zip(values, ids)],
            "nearest_row": rounded(table[int(ids[0])], 7),          # (C,): to draw beside the row
        }
    return work


def progress(done: int, total: int) -> Progress:
    return Progress(done, total, f"cosine against rows {done:,} of {total:,}")


def embedding(call) -> None:
    token_id, text_tokens = chosen_token(call)
    k = integer(call.msg, "k", 1, MAX_K, default=DEFAULT_K)
    work = neighbours_work(token_id, k)
    if text_tokens is None:
        call.job({"token_id": token_id, "k": k}, work)
        return

    def with_text(engine):  # the same result, plus which tokens the text became
        result = yield from work(engine)
        return {**result, "text_tokens": text_tokens}
    call.job({"token_id": token_id, "k": k, "text_tokens": [t["id"] for t in text_tokens]}, with_text)


WIDGET = Widget("embedding", messages=(
    message("embedding", {"token_id", "text", "k"}, embedding, job=True),
))
