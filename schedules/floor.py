"""The floor: the least GPU budget at which both runtime policies are guaranteed to run.

Notation. Kernels K_0..K_{m-1} in execution order; W(K_j) the streamed (not pinned) weights
K_j reads; probes p_0..p_{N-1} in execution order, all probes of K_j before K_j; end_j the
index of the first probe after K_j; d the prefetch depth; size(w) a weight's bytes rounded up
to ALIGNMENT (what an allocation of it takes).

Runtime contract (both policies, see runtime/pool.py and the pools beside it). When the executor reaches probe p it
makes p's weight resident and then starts copies of the weights of probes p+1..p+d. A weight
is *protected* (may not be evicted or overwritten) from the moment its copy is issued until
the kernel after its reader has been launched: K_{j-1}'s weights stay while K_j's probes and
prefetches run, because K_{j-1} was launched asynchronously and may not have read them yet.
Memory of an evicted weight is reused only after an event recorded behind the last kernel
that read it (stream-ordered reuse), so a launched kernel never reads overwritten bytes,
whatever the budget; the protection rule is what keeps the *not yet launched* readers safe.

Window. Just before K_j is launched the protected set is exactly
    Window_j = W(K_{j-1}) ∪ W(K_j) ∪ {w(p_q) : end_j <= q < end_j + d}
(earlier prefetch targets are all inside it, because the prefetch window only slides
forward), and every protected set at any other moment is a subset of some Window_j.

LRU requirement. lru_bytes = max_j sum(size(w) for w in Window_j).
Proof of safety: at any probe, let P be the protected set, P ⊆ Window_j for the current j,
so sum(size(P)) <= lru_bytes <= capacity. Evicting unprotected weights in LRU order frees
everything outside P, so an allocation of a weight w in Window_j always finds room; no
protected weight is ever chosen as a victim. Tightness: at capacity lru_bytes - 1 the
window that attains the maximum cannot be resident at once before its kernel launches.

Planned requirement. The planned policy streams through a ring arena: weights are placed
at a cursor in probe order, wrapping to offset 0 when the next one does not fit before the
end, and a weight already in the ring and not overwritten is reused. It is safe iff no
Window_j has two members overlapping in the ring (then nothing protected is overwritten;
older occupants are overwritten only after their release events). The wrap wastes at most
one weight's size, so the ring may need more than lru_bytes; ring_bytes is the smallest
ring size in ALIGNMENT steps from lru_bytes upwards at which the placement is safe (the
scan grows by ring_step(), which bounds it to a fraction of the largest weight above the
true minimum). The planner at load uses the same function, so the check is exact for what
the runtime does.

floor_bytes = pinned_bytes + max(lru_bytes, ring_bytes).
"""

from __future__ import annotations

import bisect

import dataclasses
from collections.abc import Sequence

ALIGNMENT = 512


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclasses.dataclass(frozen=True)
class StreamSequence:
    """The streamed part of a schedule as plain data: what both policies and the floor use."""

    probe_weight: tuple[int, ...]  # weight id per streamed probe, in execution order
    probe_kernel: tuple[int, ...]  # kernel index per streamed probe (non-decreasing)
    num_kernels: int
    sizes: tuple[int, ...]  # aligned bytes per weight id (all weights, pinned ones unused)


def kernel_weights(seq: StreamSequence) -> list[set[int]]:
    weights: list[set[int]] = [set() for _ in range(seq.num_kernels)]
    for w, k in zip(seq.probe_weight, seq.probe_kernel):
        weights[k].add(w)
    return weights


def probe_ends(seq: StreamSequence) -> list[int]:
    """end_j: index of the first probe after kernel j."""
    ends = [0] * seq.num_kernels
    q = 0
    for j in range(seq.num_kernels):
        while q < len(seq.probe_kernel) and seq.probe_kernel[q] <= j:
            q += 1
        ends[j] = q
    return ends


def windows(seq: StreamSequence, prefetch_depth: int) -> list[set[int]]:
    """Window_j for every kernel j (see the module docstring)."""
    per_kernel = kernel_weights(seq)
    ends = probe_ends(seq)
    result = []
    for j in range(seq.num_kernels):
        window = set(per_kernel[j])
        if j > 0:
            window |= per_kernel[j - 1]
        window.update(seq.probe_weight[ends[j] : ends[j] + prefetch_depth])
        result.append(window)
    return result


def window_bytes(seq: StreamSequence, window: set[int]) -> int:
    return sum(seq.sizes[w] for w in window)


def lru_requirement(seq: StreamSequence, prefetch_depth: int) -> tuple[int, int]:
    """(lru_bytes, the kernel j whose window attains it); (0, -1) when nothing is streamed."""
    best, best_j = 0, -1
    for j, window in enumerate(windows(seq, prefetch_depth)):
        b = window_bytes(seq, window)
        if b > best:
            best, best_j = b, j
    return best, best_j


@dataclasses.dataclass(frozen=True)
class RingPlacement:
    """Where each streamed probe's weight sits in the ring, and which copy it reads.

    Indices are positions in the stream sequence. ``source[i] == i`` for a fill (the weight is
    copied to ``offsets[i]``); otherwise ``source[i]`` is the earlier fill whose bytes, still
    intact, probe i reads. ``overwrites[i]`` lists, for a fill, the earlier fills whose bytes
    it overwrites.
    """

    offsets: list[int]
    source: list[int]
    overwrites: dict[int, list[int]]


def ring_placement(seq: StreamSequence, ring_size: int) -> RingPlacement | None:
    """Place every streamed probe's weight in a ring of ``ring_size`` bytes, or None if a
    weight does not fit at all. Reuse: a weight still intact in the ring is not placed again.
    The one simulation of the ring: the floor's safety check and the planned layout read it."""
    offsets: list[int] = []
    source: list[int] = []
    overwrites: dict[int, list[int]] = {}
    cursor = 0
    # weight id -> index of the fill holding it; a weight is intact while nothing placed after
    # it overlapped its bytes.
    live: dict[int, int] = {}
    # the live placements, disjoint and in ring order (so their ends are in order too): the
    # ones a new placement overlaps are one run of them, found by bisection
    occupants: list[tuple[int, int, int]] = []  # (start, end, fill index)
    occupant_ends: list[int] = []
    for i, w in enumerate(seq.probe_weight):
        size = seq.sizes[w]
        if size > ring_size:
            return None
        if w in live:
            offsets.append(offsets[live[w]])
            source.append(live[w])
            continue
        if cursor + size > ring_size:
            cursor = 0
        start, end = cursor, cursor + size
        lo = hi = bisect.bisect_right(occupant_ends, start)
        while hi < len(occupants) and occupants[hi][0] < end:
            hi += 1
        overwritten = sorted(fill for _, _, fill in occupants[lo:hi])
        for fill in overwritten:
            live.pop(seq.probe_weight[fill], None)
        occupants[lo:hi] = [(start, end, i)]
        occupant_ends[lo:hi] = [end]
        live[w] = i
        offsets.append(start)
        source.append(i)
        overwrites[i] = overwritten
        cursor = end
    return RingPlacement(offsets, source, overwrites)


def ring_is_safe(seq: StreamSequence, prefetch_depth: int, ring_size: int) -> bool:
    placement = ring_placement(seq, ring_size)
    if placement is None:
        return False
    offsets = placement.offsets
    # The offset each weight has at kernel j is the one of its latest probe at or before the
    # window's last member; members of a window are placed between end_{j-2} and end_j + d.
    ends = probe_ends(seq)
    for j in range(seq.num_kernels):
        first = ends[j - 2] if j >= 2 else 0
        last = min(ends[j] + prefetch_depth, len(seq.probe_weight))
        # A weight re-placed inside the window occupies both places until the window ends.
        placed = {(offsets[q], seq.probe_weight[q]) for q in range(first, last)}
        intervals = sorted((off, off + seq.sizes[w]) for off, w in placed)
        for (s0, e0), (s1, _e1) in zip(intervals, intervals[1:]):
            if s1 < e0:
                return False
    return True


def ring_step(seq: StreamSequence) -> int:
    largest = max((seq.sizes[w] for w in set(seq.probe_weight)), default=ALIGNMENT)
    return max(ALIGNMENT, aligned(largest // 64))


def ring_requirement(seq: StreamSequence, prefetch_depth: int, lower_bound: int | None = None) -> int:
    """Smallest ring size (scanned from the LRU requirement in ring_step() steps) that is safe."""
    if not seq.probe_weight:
        return 0
    size = lower_bound if lower_bound is not None else lru_requirement(seq, prefetch_depth)[0]
    size = aligned(size)
    step = ring_step(seq)
    # Terminates: at lru_bytes + largest weight the wrap waste cannot make a window overlap.
    while not ring_is_safe(seq, prefetch_depth, size):
        size += step
    return size


@dataclasses.dataclass(frozen=True)
class Floor:
    floor_bytes: int
    pinned_bytes: int
    lru_bytes: int
    ring_bytes: int
    floor_kernel: int  # j whose window sets lru_bytes (pair K_{j-1}, K_j); -1 if none
    pair_bytes: int  # bytes(W(K_{j-1}) ∪ W(K_j)) of that pair
    headroom_bytes: int  # what the prefetch window adds on top of the pair


def compute_floor(
    probe_weight: Sequence[int],
    probe_kernel: Sequence[int],
    num_kernels: int,
    weight_bytes: Sequence[int],
    pinned: Sequence[int],
    prefetch_depth: int,
) -> Floor:
    sizes = tuple(aligned(b) for b in weight_bytes)
    pinned_set = set(pinned)
    streamed = [(w, k) for w, k in zip(probe_weight, probe_kernel) if w not in pinned_set]
    seq = StreamSequence(
        probe_weight=tuple(w for w, _ in streamed),
        probe_kernel=tuple(k for _, k in streamed),
        num_kernels=num_kernels,
        sizes=sizes,
    )
    lru_bytes, j = lru_requirement(seq, prefetch_depth)
    ring_bytes = ring_requirement(seq, prefetch_depth, lower_bound=lru_bytes)
    pinned_bytes = sum(sizes[w] for w in pinned_set)
    pair_bytes = 0
    if j >= 0:
        per_kernel = kernel_weights(seq)
        pair = per_kernel[j] | (per_kernel[j - 1] if j > 0 else set())
        pair_bytes = window_bytes(seq, pair)
    return Floor(
        floor_bytes=pinned_bytes + max(lru_bytes, ring_bytes),
        pinned_bytes=pinned_bytes,
        lru_bytes=lru_bytes,
        ring_bytes=ring_bytes,
        floor_kernel=j,
        pair_bytes=pair_bytes,
        headroom_bytes=lru_bytes - pair_bytes,
    )
