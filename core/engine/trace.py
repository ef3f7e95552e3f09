"""The engine's own record of each step, for the batching widgets.

One row per step: which request did what in each batch slot (a prefill chunk of how many tokens,
or a decode producing its n-th token; idle when a slot is held but did no work), how long the
step took, and how full the KV pool was, and the blocks it moved (copy-on-write
copies, swaps to and from the host pool, each timed). Drawn as a grid, rows are steps and columns are slots:
static batching shows idle slots waiting for the longest member; continuous batching refills them.
"""

from dataclasses import asdict, dataclass, field
from enum import Enum


class StepKind(str, Enum):
    PREFILL = "prefill"  # a chunk of the prompt (or a recompute after preemption)
    DECODE = "decode"    # one new token
    IDLE = "idle"        # the slot is held but did no work this step


@dataclass
class SlotWork:
    request_id: str
    kind: StepKind
    num_tokens: int = 0            # tokens computed this step
    output_index: int | None = None  # 1-based index of the token this step produced, if any
    recompute: bool = False        # prefill again after a preemption


@dataclass
class StepTrace:
    step: int
    start_s: float                 # since the engine started
    duration_s: float
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    slots: list[SlotWork | None] = field(default_factory=list)  # by slot; None = empty
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    swapped: int = 0               # requests waiting in the host pool after the step
    swapped_out: list[str] = field(default_factory=list)  # of the preempted, those swapped out
    swapped_in: list[str] = field(default_factory=list)
    blocks_copied: int = 0         # copy-on-write copies before the forward pass
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    copy_s: float = 0.0            # measured time of the copies
    swap_s: float = 0.0            # measured time of the swaps (both ways)

    def as_dict(self) -> dict:
        return asdict(self)
