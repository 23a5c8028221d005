"""MoE blocks in a schedule: each expert a unit that the router picks at run time.

A routed-experts kernel (``hostswap::routed_experts``) reads the rows of its block's stacked
tables that the router names: an expert is one row of each table, ``unit_bytes`` together.
The tables are outside the static order (they are read in place from host memory, as row
gathers), so what a call reads is a count of units, not a list of weights:

- a call of one token (a decode step) reads its top-k experts' rows, with no host sync:
  ``top_k`` units. On CUDA with Triton its products read the rows where they lie; elsewhere
  they are gathered into device scratch first, which the floor counts (``scratch_bytes``)
  for a device that gathers;
- a larger call (a prefill chunk, a batched decode step) reads each expert of the union once,
  in place or from a device cache's slots: at most ``num_experts`` units, no scratch. (On
  CUDA a kernel multiplies an expert by at most 256 of a chunk's tokens, 64 of a captured
  step's, at once: past that many tokens a much-picked expert is read again.) A captured
  batched step learns its union on the device, or runs its (token, expert) pairs through the
  block's cache where it has one.

With budget to spare once every streamed weight is resident, experts are kept on the device
(``plan_expert_cache``): each block gets slots for as many experts as fit, its whole tables
where all do (resident), else a cache its decode steps look up and fill (runtime/expert_cache.py).
"""

from __future__ import annotations

import dataclasses

# table dtypes whose picked rows a decode step's products read where they lie on CUDA with
# Triton (kernels/routed_gemv.py): no gathered scratch there
READ_IN_PLACE_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class ExpertBlock:
    """One routed-experts kernel of a method."""

    block: str  # the experts module's name in the model
    tables: tuple[str, ...]  # FQNs of its stacked tables (gate_up, down, biases)
    top_k: int  # experts per token
    tokens: int  # tokens per call of the method
    num_experts: int  # rows of each table (from the program, not stored)
    unit_bytes: int  # one expert: a row of every table (from the program, not stored)
    dtype: str = ""  # its tables' dtype where they share one, else "" (from the program, not stored)

    @property
    def table_bytes(self) -> int:
        return self.num_experts * self.unit_bytes

    @property
    def gathers_pairs(self) -> bool:
        """Its calls take the pair path: one token, its top-k read (gathered first where the
        device cannot read them in place), no host sync."""
        return self.tokens == 1

    @property
    def read_in_place_on_cuda(self) -> bool:
        """Whether a decode step on CUDA with Triton reads its picks where they lie (no scratch)."""
        return self.dtype in READ_IN_PLACE_DTYPES

    @property
    def scratch_bytes(self) -> int:
        """Device bytes one call gathers its experts into, where a device gathers them (one
        whose products cannot read the picked rows in place: kernels/routed_gemv.py)."""
        return self.tokens * self.top_k * self.unit_bytes if self.gathers_pairs else 0

    @property
    def units_per_call(self) -> tuple[int, int]:
        """(fewest, most) experts one call reads: the pairs, or the union of a chunk."""
        if self.gathers_pairs:
            return self.tokens * self.top_k, self.tokens * self.top_k
        return self.top_k, min(self.num_experts, self.tokens * self.top_k)


def check_expert_blocks(blocks: tuple[ExpertBlock, ...], host_read: tuple[str, ...], error: type[Exception]) -> None:
    """Raise ``error`` unless each block is named once, has tables, reads them in place and
    has a positive top-k no larger than its experts."""
    names = [b.block for b in blocks]
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise error("expert blocks must be distinct non-empty names")
    for b in blocks:
        if not b.tables or any(t not in host_read for t in b.tables):
            raise error(f"expert block '{b.block}' names tables {list(b.tables)}; each must be read in place (host_read)")
        if not (isinstance(b.top_k, int) and 0 < b.top_k <= b.num_experts) or not (isinstance(b.tokens, int) and b.tokens > 0):
            raise error(f"expert block '{b.block}' has top_k={b.top_k!r} of {b.num_experts} experts and tokens={b.tokens!r}")


def shared_dtype(dtypes) -> str:
    """The one dtype a block's tables share, else "" (none known, or several)."""
    return dtypes[0] if dtypes and all(d == dtypes[0] for d in dtypes) else ""


def expert_scratch_bytes(blocks: tuple[ExpertBlock, ...]) -> int:
    """Device bytes the largest call gathers experts into (blocks run one after another)."""
    return max((b.scratch_bytes for b in blocks), default=0)


def plan_expert_cache(blocks: tuple[ExpertBlock, ...], room_bytes: int) -> dict[str, int]:
    """Device slots per block (block -> experts held) in ``room_bytes``, the budget beyond
    every streamed weight: each resident weight saves its bytes every token, a cached expert
    only when picked, so experts take what the streamed weights leave. The same number of
    slots for every block (the most that fit), up to its experts (then its tables are
    resident whole); a block offered fewer than its top-k gets none."""
    if not blocks:
        return {}
    def need(slots: int) -> int:
        return sum(min(slots, b.num_experts) * b.unit_bytes for b in blocks)
    low, high = 0, max(b.num_experts for b in blocks)
    while low < high:  # the most slots that fit
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid) <= room_bytes else (low, mid - 1)
    return {b.block: (min(low, b.num_experts) if min(low, b.num_experts) >= min(b.top_k, b.num_experts) else 0) for b in blocks}


def resident_blocks(slots: dict[str, int], blocks: tuple[ExpertBlock, ...]) -> frozenset[str]:
    """The blocks whose slots hold every expert: their whole tables on the device."""
    return frozenset(b.block for b in blocks if slots.get(b.block, 0) >= b.num_experts)


def bytes_read_per_call(blocks: tuple[ExpertBlock, ...], resident: frozenset[str] = frozenset()) -> tuple[int, int]:
    """(fewest, most) expert bytes one call of the method reads over the bus: its blocks'
    units, less the resident blocks'."""
    fewest = sum(b.units_per_call[0] * b.unit_bytes for b in blocks if b.block not in resident)
    most = sum(b.units_per_call[1] * b.unit_bytes for b in blocks if b.block not in resident)
    return fewest, most
