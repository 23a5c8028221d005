"""Pool decisions of the two runtime policies as plain data, shared by the runtime and ``inspect``.

The runtime pools (runtime/planned_pool.py, runtime/lru_pool.py) execute these decisions with real memory and streams;
``hostswap inspect --budget-mb`` runs the same objects without memory to report what each
forward would stream. Keeping one implementation means the report cannot drift from the
runtime.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict

from hostswap.schedules.floor import StreamSequence, aligned, lru_requirement, probe_ends, ring_is_safe, ring_placement, ring_requirement
from hostswap.schedules.schedule_facts import ScheduleFacts


class BudgetError(ValueError):
    """The budget cannot hold what the schedule needs."""


def check_budget(schedule: ScheduleFacts, budget_bytes: int, expert_scratch_bytes: int = 0) -> None:
    """Refuse a budget below the floor: the schedule's, plus (for a program with routed experts)
    the device scratch one routed-experts call gathers its picked experts into."""
    least = schedule.floor_bytes + expert_scratch_bytes
    if budget_bytes >= least:
        return
    floor = "largest pair of consecutive kernels plus prefetch headroom for prefetch_depth=" f"{schedule.prefetch_depth}"
    if expert_scratch_bytes:
        floor += f": {schedule.floor_bytes} bytes; one MoE layer's routed experts: {expert_scratch_bytes} bytes"
    raise BudgetError(
        f"weight_offload_budget_mb={budget_bytes / 2**20:.2f} is below this program's floor: "
        f"at least {least} bytes ({mb_ceil(least)} MB) are required ({floor})"
    )


def mb_ceil(nbytes: int) -> int:
    """Whole MB (2**20 bytes) that hold ``nbytes``: the smallest budget_mb that loads."""
    return -(-nbytes // 2**20)


@dataclasses.dataclass
class Action:
    """One pool step: ``load`` a weight (``demand`` or prefetch), ``evict`` one, or ``hit``."""

    kind: str  # "hit" | "load" | "evict"
    weight: int
    probe: int
    demand: bool = False


def lru_resident(schedule: ScheduleFacts, budget_bytes: int) -> set[int]:
    """Weights the lru policy loads once and never evicts: every one when all fit the budget
    (no per-probe bookkeeping and no per-kernel events are needed then), else the pinned ones."""
    if sum(aligned(b) for b in schedule.weight_bytes) <= budget_bytes:
        return set(range(len(schedule.weight_bytes)))
    ids = {f: i for i, f in enumerate(schedule.fqns)}
    return {ids[f] for f in schedule.pin}


class LruPolicy:
    """Per-weight allocations, least-recently-used victims, prefetch of the next d probes."""

    def __init__(self, schedule: ScheduleFacts, budget_bytes: int):
        check_budget(schedule, budget_bytes)
        self.schedule = schedule
        self.sizes = [aligned(b) for b in schedule.weight_bytes]
        self.pinned = lru_resident(schedule, budget_bytes)
        self.may_evict = len(self.pinned) < len(self.sizes)
        self.capacity = budget_bytes - sum(self.sizes[w] for w in self.pinned)
        self.resident: OrderedDict[int, None] = OrderedDict()
        self.used = 0
        self.protect_until: dict[int, int] = {}
        self.demanded_at: dict[int, int] = {}  # weight -> kernel whose probe last handed it out
        self.prefetched_unused: set[int] = set()
        self.launched = 0
        self.peak_used = 0

    def begin_forward(self) -> None:
        self.launched = 0
        self.protect_until.clear()
        self.demanded_at.clear()

    def kernel_launched(self, kernel: int) -> None:
        self.launched = kernel + 1

    def _protected(self, w: int) -> bool:
        return self.launched <= self.protect_until.get(w, -1)

    def _make_room(self, size: int, probe: int, actions: list[Action]) -> None:
        while self.used + size > self.capacity:
            victim = next((w for w in self.resident if not self._protected(w)), None)
            if victim is None:
                # Unreachable at or above the floor (schedules/floor.py proves it).
                raise BudgetError(f"lru pool exhausted at probe {probe}: every resident weight is protected")
            del self.resident[victim]
            self.used -= self.sizes[victim]
            actions.append(Action("evict", victim, probe))

    def evict_for_allocator(self, probe: int, allocating: int, is_loaded) -> Action | None:
        """One more victim when the allocator refuses a size that the byte count admits.

        A real allocator fragments: the bytes in use fit the budget, but no free block is
        large enough. Frees are ordered after the last kernel that read the bytes, so any
        weight may go except those the current kernel has already been handed (its launch
        will read them) and the one being allocated. In order of cost: unprotected weights
        (LRU first); weights only launched kernels read (the allocation then waits for those
        kernels); prefetched weights not yet handed out (furthest use first; they are copied
        again when asked for). ``is_loaded`` excludes weights whose load this probe has
        decided but not yet carried out. None when nothing is left.
        """
        kernel = self.schedule.probe_kernel[probe]
        movable = [w for w in self.resident if w != allocating and is_loaded(w) and self.demanded_at.get(w) != kernel]
        unprotected = [w for w in movable if not self._protected(w)]
        behind = [w for w in movable if self._protected(w) and self.protect_until.get(w, -1) <= kernel]
        ahead = sorted((w for w in movable if self.protect_until.get(w, -1) > kernel), key=lambda w: -self.protect_until[w])
        victim = next(iter(unprotected or behind or ahead), None)
        if victim is None:
            return None
        del self.resident[victim]
        self.used -= self.sizes[victim]
        return Action("evict", victim, probe)

    def _ensure(self, w: int, probe: int, demand: bool, actions: list[Action]) -> None:
        kernel = self.schedule.probe_kernel[probe]
        self.protect_until[w] = max(self.protect_until.get(w, -1), kernel + 1)
        if demand:
            self.demanded_at[w] = kernel
        if w in self.resident:
            self.resident.move_to_end(w)
            if demand:
                actions.append(Action("hit", w, probe))
            return
        self._make_room(self.sizes[w], probe, actions)
        self.resident[w] = None
        self.used += self.sizes[w]
        self.peak_used = max(self.peak_used, self.used)
        actions.append(Action("load", w, probe, demand=demand))

    def on_probe(self, probe: int) -> list[Action]:
        """Decisions at ``probe``: make its weight resident, then prefetch the next d probes."""
        actions: list[Action] = []
        w = self.schedule.probe_weight[probe]
        if w in self.pinned:
            actions.append(Action("hit", w, probe))
        else:
            self._ensure(w, probe, True, actions)
        last = min(probe + self.schedule.prefetch_depth, self.schedule.num_probes - 1)
        for q in range(probe + 1, last + 1):
            wq = self.schedule.probe_weight[q]
            if wq not in self.pinned:
                self._ensure(wq, q, False, actions)
        return actions


@dataclasses.dataclass(frozen=True)
class PlannedLayout:
    """Where every weight lives under the ``planned`` policy, fixed at load."""

    budget_bytes: int
    pinned: frozenset[int]
    resident: frozenset[int]  # kept for the program's lifetime (pinned ones included)
    resident_offsets: dict[int, int]  # weight id -> offset in the resident region
    resident_bytes: int
    ring_offset: int  # where the ring starts in the arena
    ring_bytes: int
    fill_offset: dict[int, int]  # probe id -> ring offset its weight is copied to (fills only)
    fill_waits_for: dict[int, int]  # probe id -> last kernel that read the bytes it overwrites (-1: none)
    reuse_offset: dict[int, int]  # probe id -> ring offset of a weight still there (no copy)
    streamed_bytes: int  # bytes copied host-to-device per forward
    # The forward's first fills that overwrite nothing the same forward read before them, each
    # with the last kernel of a whole forward that reads the bytes it overwrites (-1: none). The
    # runtime may issue them at the end of one forward for the next (runtime/planned_pool.py, carried fills).
    carry_waits_for: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def arena_bytes(self) -> int:
        return self.ring_offset + self.ring_bytes


def _stream_sequence(schedule: ScheduleFacts, kept: set[int]) -> tuple[StreamSequence, list[int]]:
    probes = [p for p, w in enumerate(schedule.probe_weight) if w not in kept]
    seq = StreamSequence(
        probe_weight=tuple(schedule.probe_weight[p] for p in probes),
        probe_kernel=tuple(schedule.probe_kernel[p] for p in probes),
        num_kernels=schedule.num_kernels,
        sizes=tuple(aligned(b) for b in schedule.weight_bytes),
    )
    return seq, probes


def _spread_streamed(schedule: ScheduleFacts, sizes: list[int], kept: set[int], pinned: set[int]) -> set[int]:
    """``kept`` with, in every class of equal-sized weights, the same number streamed, but those
    evenly spaced in first-access order. Resident bytes are unchanged.

    Streamed are the s of n members where floor(i*s/n) steps (Bresenham): the last member of a
    class is always streamed and the first is resident unless all are streamed. After the last
    copy of a forward ends, only the kernels behind it are left to run, with the copy engine
    idle: ending on a late streamed weight keeps that tail short.
    """
    first_access: dict[int, int] = {}
    for p, w in enumerate(schedule.probe_weight):
        first_access.setdefault(w, p)
    classes: dict[int, list[int]] = {}
    for w in sorted(first_access, key=first_access.get):
        if w not in pinned:
            classes.setdefault(sizes[w], []).append(w)
    spread = set(kept) | set(w for w in range(len(sizes)) if w not in first_access)
    for members in classes.values():
        n, s = len(members), sum(1 for w in members if w not in kept)
        for i, w in enumerate(members):
            if ((i + 1) * s) // n == (i * s) // n:
                spread.add(w)
            else:
                spread.discard(w)
    return spread


# A copy costs about 5 us beyond its bytes (an H100 profile of a streamed int8 decode step:
# 209 copies, 1.1 ms of gaps between them and 42 GB/s while busy, against 53 GB/s for large
# copies): at ~50 GB/s, the time of 256 KiB.
COPY_COST_BYTES = 256 * 1024
# Weights that cost the link more in a copy's fixed cost than in bytes, and are small beside
# the largest weight (where all are of one magnitude, none is "small").
SMALL_SHARE_OF_LARGEST = 1 / 64


def small_weight_limit(sizes: list[int]) -> float:
    """Bytes at or below which a weight counts as small."""
    return min(COPY_COST_BYTES, max(sizes, default=0) * SMALL_SHARE_OF_LARGEST)


def keep_order(sizes: list[int], candidates: set[int], small_first: bool = False) -> list[int]:
    """The order in which the planner tries to keep weights resident: largest first; with
    ``small_first``, the small weights (quantization scales and zero points, norm weights)
    before them, smallest first."""
    limit = small_weight_limit(sizes) if small_first else -1
    small = sorted((w for w in candidates if sizes[w] <= limit), key=lambda w: (sizes[w], w))
    large = sorted((w for w in candidates if sizes[w] > limit), key=lambda w: (-sizes[w], w))
    return small + large


def link_cost(layout: "PlannedLayout") -> int:
    """A forward's time on the link under ``layout``, in bytes: what it copies plus each
    copy's fixed cost."""
    return layout.streamed_bytes + len(layout.fill_offset) * COPY_COST_BYTES


# weights of one size refused with nothing kept since (at least this many, or a quarter of the
# weights of that size), after which the rest of that size are not tried
SAME_SIZE_REFUSALS = 3


def _keep_greedily(schedule: ScheduleFacts, sizes: list[int], kept: set[int], budget_bytes: int, seq: StreamSequence, ring: int,
                   small_first: bool) -> tuple[StreamSequence, int]:
    """Add weights to ``kept`` (in place) while the ring for what is left still fits beside them.

    Largest first (``keep_order``): that removes the outliers that set the ring; with
    ``small_first``, small weights before them, each saving a copy for few bytes. The ring is
    not monotone in what stays streamed (keeping one weight can pull larger ones into a
    prefetch window), so a weight refused once is tried again in later passes, until a pass
    adds nothing (within limits that keep the trials few; see below).
    Returns the stream sequence and a safe ring size for the final ``kept``.
    """
    kept_bytes = sum(sizes[w] for w in kept)
    if kept_bytes + sum(sizes[w] for w in range(len(sizes)) if w not in kept) <= budget_bytes:
        # everything fits: nothing streams, no ring (and no trial of each weight against the rest)
        kept.update(range(len(sizes)))
        return _stream_sequence(schedule, kept)[0], 0

    def fit_of(trial: set[int], trial_bytes: int):
        """(stream sequence, least safe ring) with ``trial`` resident, or None if no ring fits."""
        trial_seq, _ = _stream_sequence(schedule, trial)
        available = budget_bytes - trial_bytes
        lower = aligned(lru_requirement(trial_seq, schedule.prefetch_depth)[0])
        if lower > available:
            return None  # no ring is safe below the lru requirement: a cheap refusal
        if not trial_seq.probe_weight:
            return trial_seq, 0
        # Safety is not monotone in the ring size (wrap waste), and scanning for the smallest
        # safe ring per trial is slow: test the sizes that matter, the least possible, the
        # least that is always safe (lru requirement plus the largest streamed weight: no
        # wrap waste can then make a window overlap) and all the space that would be left.
        largest = max((trial_seq.sizes[v] for v in set(trial_seq.probe_weight)), default=0)
        candidates = sorted({lower, min(lower + largest, available), available})
        # the least safe one (each test walks the whole sequence: stop at the first that passes)
        fit = next((r for r in candidates if ring_is_safe(trial_seq, schedule.prefetch_depth, r)), None)
        return None if fit is None else (trial_seq, fit)

    # Each trial walks the whole sequence, so two things keep their number near the weights
    # kept rather than weights times passes: a run of weights that fit one after another is
    # tried together, the run doubling after each success and falling back to one weight on a
    # failure (any set accepted leaves a safe ring: accepting a run whose members one by one
    # would have needed another order is no less valid); and a weight refused is tried again
    # only once something has been kept since. A model repeats its layers, so once a quarter
    # of the weights of one size are refused with nothing kept in between, the rest of that
    # size are taken as refused (streaming a weight is always safe; the plan may keep a little
    # less).
    added, refused_at, refusals = 0, {}, {}  # refusals: (size, added) -> weights of that size refused since
    class_size = Counter(sizes)
    changed = True
    while changed:
        changed = False
        order = [w for w in keep_order(sizes, set(range(len(sizes))) - kept, small_first) if refused_at.get(w) != added]
        run, i = 1, 0
        while i < len(order):
            batch, batch_bytes = [], 0
            for w in order[i:]:
                if len(batch) == run:
                    break
                if kept_bytes + batch_bytes + sizes[w] > budget_bytes:
                    break  # (a first that does not fit leaves the batch empty: it is skipped)
                batch.append(w)
                batch_bytes += sizes[w]
            if not batch:
                i += 1
                continue
            if len(batch) == 1 and refusals.get((sizes[batch[0]], added), 0) >= max(SAME_SIZE_REFUSALS, class_size[sizes[batch[0]]] // 4):
                refused_at[batch[0]] = added  # its like were refused where they stand: stream it too
                i += 1
                continue
            fit = fit_of(kept | set(batch), kept_bytes + batch_bytes)
            if fit is None:
                if len(batch) > 1:
                    run = 1  # try the run's first weight alone
                    continue
                refused_at[batch[0]] = added
                refusals[sizes[batch[0]], added] = refusals.get((sizes[batch[0]], added), 0) + 1
                i += 1
                continue
            kept.update(batch)
            kept_bytes += batch_bytes
            seq, ring = fit
            added += 1
            changed = True
            i += len(batch)
            run *= 2
    return seq, ring


def plan_layout(schedule: ScheduleFacts, budget_bytes: int) -> PlannedLayout:
    """Keep as many weight bytes resident as the budget allows beyond what streaming needs.

    Run-ahead at depth 0. With no prefetch, the smallest safe ring holds exactly the weights of
    two consecutive kernels: each copy must wait for the kernel before the one it feeds, so
    across a stretch of resident kernels the copy engine gets one weight ahead and then idles. The
    runtime still issues each copy at its own probe, but the host runs ahead of the GPU, so a
    ring placed as depth 1 places it (safe for depth 0 too: its windows are subsets) lets the
    copy engine run one weight ahead. That layout is taken when the budget allows it and its
    ring is no larger than what the depth-0 floor reserves for streaming, so bytes streamed
    stay within total - (budget - floor). ``_plan_layout`` alone plans the smallest ring.
    """
    check_budget(schedule, budget_bytes)
    if schedule.prefetch_depth == 0:
        ahead = dataclasses.replace(schedule, prefetch_depth=1)
        if budget_bytes >= ahead.floor_bytes:
            layout = _plan_layout(ahead, budget_bytes)
            floor = schedule.floor
            if layout.ring_bytes <= floor.floor_bytes - floor.pinned_bytes:
                return layout
    return _plan_layout(schedule, budget_bytes)


def _plan_layout(schedule: ScheduleFacts, budget_bytes: int) -> PlannedLayout:
    """The layout of the two keep orders that takes the link less time (``link_cost``).

    Keeping the largest weights resident streams the fewest bytes; keeping the small ones
    first saves copies (an int8 model has a scale and a zero point beside each linear: at a
    quarter of the bf16 bytes, 209 copies a token against 62, for 1 % more bytes). Which wins
    depends on the budget, so both are planned; ties keep the largest-first layout."""
    largest_first = _plan_layout_in_order(schedule, budget_bytes, small_first=False)
    sizes = [aligned(b) for b in schedule.weight_bytes]
    limit = small_weight_limit(sizes)
    if not any(b <= limit for w, b in enumerate(sizes) if w not in largest_first.resident):
        return largest_first  # every small weight is resident already: both orders agree
    return min(largest_first, _plan_layout_in_order(schedule, budget_bytes, small_first=True), key=link_cost)


def _plan_layout_in_order(schedule: ScheduleFacts, budget_bytes: int, small_first: bool) -> PlannedLayout:
    ids = {f: i for i, f in enumerate(schedule.fqns)}
    sizes = [aligned(b) for b in schedule.weight_bytes]
    pinned = {ids[f] for f in schedule.pin}
    kept = set(pinned)
    seq, _ = _stream_sequence(schedule, kept)
    ring = ring_requirement(seq, schedule.prefetch_depth)
    seq, ring = _keep_greedily(schedule, sizes, kept, budget_bytes, seq, ring, small_first)
    # Same bytes resident, but the streamed ones spread over the forward, so that every stretch
    # of compute has copies to hide (a stretch of resident layers followed by a stretch of
    # streamed ones runs compute, then copies, one after the other). A spread set usually
    # needs a smaller ring; the room that frees is filled greedily again.
    spread = _spread_streamed(schedule, sizes, kept, pinned)
    if spread != kept:
        spread_seq, _ = _stream_sequence(schedule, spread)
        spread_ring = ring_requirement(spread_seq, schedule.prefetch_depth)
        if sum(sizes[w] for w in spread) + spread_ring <= budget_bytes:
            kept = spread
            seq, ring = _keep_greedily(schedule, sizes, kept, budget_bytes, spread_seq, spread_ring, small_first)
    kept_bytes = sum(sizes[w] for w in kept)
    # Shrink the ring to the smallest safe size when that one fits too (it usually does).
    smallest = ring_requirement(seq, schedule.prefetch_depth)
    if kept_bytes + smallest <= budget_bytes:
        ring = smallest
    seq, probes = _stream_sequence(schedule, kept)
    placement = ring_placement(seq, ring) if seq.probe_weight else None
    offsets = placement.offsets if placement else []
    resident_offsets, cursor = {}, 0
    for w in sorted(kept):
        resident_offsets[w] = cursor
        cursor += sizes[w]
    fill_offset, reuse_offset, fill_waits_for = {}, {}, {}
    # A fill waits for the last kernel that read any of the fills whose bytes it overwrites.
    last_reader: dict[int, int] = {}  # fill index -> last kernel so far that read its copy
    streamed = 0
    for i, (p, off) in enumerate(zip(probes, offsets)):
        w, kernel = schedule.probe_weight[p], schedule.probe_kernel[p]
        source = placement.source[i]
        last_reader[source] = kernel
        if source != i:
            reuse_offset[p] = off
            continue
        fill_waits_for[p] = max((last_reader[f] for f in placement.overwrites[i]), default=-1)
        fill_offset[p] = off
        streamed += schedule.weight_bytes[w]
    # Every ring read of a forward overlapping a carried fill's bytes must be over before the
    # fill (the latest of them; conservative: stream order alone would cover some).
    reads = [(off, off + sizes[schedule.probe_weight[p]], schedule.probe_kernel[p]) for p, off in zip(probes, offsets)]
    carry_waits_for = {}
    for p in sorted(fill_offset):
        if fill_waits_for[p] >= 0:
            break
        start, end = fill_offset[p], fill_offset[p] + sizes[schedule.probe_weight[p]]
        carry_waits_for[p] = max((k for a, b, k in reads if a < end and start < b), default=-1)
    return PlannedLayout(
        carry_waits_for=carry_waits_for,
        budget_bytes=budget_bytes,
        pinned=frozenset(pinned),
        resident=frozenset(kept),
        resident_offsets=resident_offsets,
        resident_bytes=kept_bytes,
        ring_offset=cursor,
        ring_bytes=ring,
        fill_offset=fill_offset,
        fill_waits_for=fill_waits_for,
        reuse_offset=reuse_offset,
        streamed_bytes=streamed,
    )


def issue_horizon(schedule: ScheduleFacts, layout: PlannedLayout) -> list[int]:
    """For each probe, the last probe whose ring fill may be issued once it is acquired.

    Prefetch depth counts streamed probes, as the ring's safety windows do (floor.windows):
    while kernel j's probes are acquired, fills run through the d-th streamed probe after
    kernel j. Counting all probes instead would let a run of resident weights starve the
    copy stream. Every such fill overwrites only bytes that kernels up to j-2 read.
    """
    seq, streamed = _stream_sequence(schedule, set(layout.resident))
    ends = probe_ends(seq)
    horizon = []
    for p in range(schedule.num_probes):
        limit = min(ends[schedule.probe_kernel[p]] + schedule.prefetch_depth, len(streamed))
        horizon.append(max(p, streamed[limit - 1]) if limit else p)
    return horizon


def replay_lru(policy: LruPolicy, schedule: ScheduleFacts, forwards: int):
    """Drive ``policy`` through ``forwards`` forwards as the runtime does, without memory.

    Yields ``(forward, action)``; a kernel counts as launched after its last probe.
    """
    for forward in range(forwards):
        policy.begin_forward()
        kernel_of = schedule.probe_kernel
        for p in range(schedule.num_probes):
            for action in policy.on_probe(p):
                yield forward, action
            if p + 1 == schedule.num_probes or kernel_of[p + 1] != kernel_of[p]:
                policy.kernel_launched(kernel_of[p])


def lru_streamed_bytes(schedule: ScheduleFacts, budget_bytes: int, forwards: int = 2) -> int:
    """Bytes the lru policy copies in a steady-state forward (the last of ``forwards``)."""
    policy = LruPolicy(schedule, budget_bytes)
    return sum(schedule.weight_bytes[a.weight] for forward, a in replay_lru(policy, schedule, forwards) if forward == forwards - 1 and a.kind == "load")
