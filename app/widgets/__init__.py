"""The widgets: the one place where each is registered.

Adding a widget: write app/widgets/<name>.py (its WIDGET: message types, checks, handlers),
static/js/widgets/<name>.js (`mount(root, ctx)` returning an unmount), static/css/widgets/<name>.css
(scoped to `[data-widget="<name>"]`) and tests/widgets/test_<name>.py, then add its module to
WIDGETS below. Nothing else changes: the page, the embeds, the websocket and the docs check read
this list. A widget imports seam.py and base.py, never another widget (tests/widgets/test_seam.py).
"""

from . import (attention, batching, block, chat, chunked_prefill, economics, embedding, gemm, generation,
               kv_cache, kv_eviction, kv_memory, moe, paging, phases, pipeline, positions, prefix_cache,
               quantization, sharing, slo, speculative, tensor_parallel, throughput_latency, tokenizer)

WIDGETS = [
    chat.WIDGET,
    tokenizer.WIDGET,
    embedding.WIDGET,
    positions.WIDGET,
    block.WIDGET,
    attention.WIDGET,
    generation.WIDGET,
    phases.WIDGET,
    kv_cache.WIDGET,
    kv_memory.WIDGET,
    paging.WIDGET,
    sharing.WIDGET,
    gemm.WIDGET,
    throughput_latency.WIDGET,
    batching.WIDGET,
    chunked_prefill.WIDGET,
    prefix_cache.WIDGET,
    tensor_parallel.WIDGET,
    pipeline.WIDGET,
    moe.WIDGET,
    quantization.WIDGET,
    kv_eviction.WIDGET,
    speculative.WIDGET,
    slo.WIDGET,
    economics.WIDGET,
]

BY_NAME = {w.name: w for w in WIDGETS}
MESSAGE_TYPES = {m.type: m for w in WIDGETS for m in w.messages}  # message type (or old name) -> its handler
ALIASES = {t: m.alias_of for t, m in MESSAGE_TYPES.items() if m.alias_of}  # old name -> current name


def _check_unique() -> None:
    seen: dict[str, str] = {}
    for w in WIDGETS:
        for m in w.messages:
            if m.type in seen or m.type == "abort":
                raise RuntimeError(f"message type {m.type!r} of widget {w.name!r} is already taken")
            seen[m.type] = w.name


_check_unique()
