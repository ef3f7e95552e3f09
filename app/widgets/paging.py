"""Widget `paging` (section 11): the live engine's block tables, as PagedAttention keeps them.

After Kwon et al., 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention": the KV pool is cut into fixed blocks; each running request holds a block table
(its blocks, in order, anywhere in the pool); requests that begin alike point at the same blocks,
with a reference count. The picture is set against what the older way would hold for the same
requests: one contiguous buffer per request, reserved for the longest sequence it might reach.

Message: `paging` {} -> a snapshot of the serving engine (every running request, the asker's
marked `yours`), taken on its loop thread between two steps (`EngineLoop.call`: one short
function, no job). It is deliberately not a job: jobs are cached by their inputs, and a live view polled twice a second would only evict other widgets'
results from that cache (or need a fake input such as the time to dodge it). The connection's
message rate limit bounds how often a reader can ask.
"""

import logging
import time

from .base import Widget, message

log = logging.getLogger(__name__)


def paging(call) -> None:
    window = call.info["context_window"]
    mine = call.own_requests()             # this reader's requests in flight
    future = call.runtime.loop.call(lambda engine: snapshot(engine, window, mine))

    def answer(done) -> None:  # on the loop thread: only queue the reply
        try:
            call.reply(done.result())
        except Exception:
            log.exception("paging snapshot failed")
            call.error("internal_error", "the server failed to read its block tables")
    future.add_done_callback(answer)


def snapshot(engine, window: int, mine: frozenset = frozenset()) -> dict:
    """The pool and every running request's block table, read through the engine's snapshot
    methods (block_tables, kv_stats, kv_pool_map) and summed up; `mine`: the asking reader's
    engine request ids, marked `yours`."""
    kv = engine.view.kv_stats()
    tables = engine.view.block_tables()
    pool = engine.view.kv_pool_map()
    return {"time": time.time(), "context_window": window, **summarize(kv, tables, pool, window, mine)}


def summarize(kv: dict, tables: list[dict], pool: dict, window: int, mine: frozenset = frozenset()) -> dict:
    """Pool counts, each request's blocks, sharing, and the contiguous reservation's waste."""
    bs = kv["block_size"]
    refs = pool["ref_counts"]                                   # (num_blocks,)
    cached = set(pool["cached_block_ids"])
    held = sorted({b for t in tables for b in t["blocks"]})     # physical blocks in some table
    shared = [b for b in held if refs[b] > 1]
    # Between steps a running request's newest token is sampled but not yet computed: its key and
    # value are written by the next step. The slots count the tokens whose K and V are in the pool.
    tokens = sum(t["num_computed_tokens"] for t in tables)
    reserved = len(tables) * window                             # max-length buffers, one each
    # Empty slots lie only in a request's last block. Prefix-shared blocks are full; n samples
    # share their prompt's partial last block until each writes its own copy: count it once.
    empty = sum({t["blocks"][-1]: len(t["blocks"]) * bs - t["num_computed_tokens"]
                 for t in tables if t["blocks"]}.values())
    requests = [{
        "request_id": t["request_id"], "yours": t["request_id"] in mine, "num_tokens": t["num_tokens"],
        "num_computed_tokens": t["num_computed_tokens"], "num_cached_tokens": t["num_cached_tokens"],
        "blocks": t["blocks"], "ref_counts": t["ref_counts"],
        "empty_slots": len(t["blocks"]) * bs - t["num_computed_tokens"],
    } for t in tables]
    return {
        "total_blocks": kv["total_blocks"], "free_blocks": kv["free_blocks"], "used_blocks": kv["used_blocks"],
        "block_size": bs, "cached_blocks": kv["cached_blocks"],
        "cached_free_blocks": sum(1 for b in cached if refs[b] == 0),
        "shared_blocks": len(shared),
        "shared_refs": sum(refs[b] for b in shared),            # table entries that point at a shared block
        "ref_counts": refs, "cached_block_ids": sorted(cached),
        "requests": requests,
        "tokens": tokens,
        "paged_slots": len(held) * bs,
        "paged_empty_slots": empty,                              # only in each request's last block
        "paged_waste_fraction": empty / (len(held) * bs) if held else None,
        "naive_reserved_slots": reserved,
        "naive_waste_fraction": 1 - tokens / reserved if reserved else None,
        "naive_max_requests": kv["total_blocks"] * bs // window,
    }


WIDGET = Widget("paging", messages=(
    message("paging", set(), paging),
))
