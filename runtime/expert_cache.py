"""A device cache of one MoE block's experts, run entirely on the device.

A decode step's experts are known only on the device (the router's top-k), and a graphed
decode step replays fixed launches with no host sync. So the cache's bookkeeping is device
tensors updated by device ops, the same ops every step:

- ``slot_of[e]``: the slot holding expert ``e``, or -1;
- ``expert_of[s]``: the expert in slot ``s``, or ``num_experts`` (empty);
- ``uses[e]``: how often lookups picked expert ``e`` lately, cached or not (each lookup adds
  one per pick; every ``HALF_LIFE`` calls, guesses included, the counts are halved);
- ``last_use[s]``: when slot ``s`` was last read, in steps and picks;
- ``hits``/``misses``: counters, read by the host only when it asks for stats.

A step looks its top-k up; each miss takes a slot that no hit of the same lookup holds, and
its rows are copied from the tables in mapped host memory by a kernel that skips the hits
(kernels/row_copy.py): a hit reads no host byte. Which slot: the policy's (``POLICIES``).
``lfu`` (the default) evicts the expert picked least often lately, the least recently used
among equals: routers have favourites, so how often an expert was picked predicts its next
pick better than when it last was, and one token's rare picks do not push a favourite out.
``lru`` evicts the least recently used. Either way an empty slot goes first, then a guess no
lookup has read. The step's experts are
then read from the slots. Where the routed-experts kernel reads its products in place (CUDA),
it leaves the gate/up and down rows out of the lookup's copy (``left``) and its products fill
the missed slots as they read the rows from the tables. Index ``num_experts`` of ``slot_of`` is a sink: writes that a hit
must not make go there, so no step branches on the host. On CUDA with Triton the bookkeeping
of a call is one kernel (kernels/cache_place.py) instead of some forty small ones; elsewhere
it is the torch ops below, which leave the same state.

A block's misses are on the decode step's critical path: nothing after the block can run
until its rows are in. So the block before it guesses them (``guess``, ``prefetch``): the
routed-experts kernel of block L scores block L+1's experts with L+1's own router on L's
residual stream (a layer early), and once L's products are queued, the cache brings the best
scored experts it lacks in on a side stream, while L+1's attention runs and the bus would
otherwise be idle. The guess names L+1's whole predicted top-k, at most ``prefetching`` of it
missing: the cached experts among them come in as hits, which the placement holds, so a
guessed miss never evicts what the same guess predicts L+1 will read. L+1's lookup waits for that copy (``settle``) and then misses only where
the guess was wrong. The guess copies a few experts (``prefetching``, at most the block's top-k): the
bus is idle for about one attention, and a guess that has not landed when the lookup comes
holds the step up, whether it was right or wrong. A guessed miss takes the slot the policy
evicts and ranks below every expert a lookup read until a lookup reads it, so a wrong guess is
evicted first (a guess adds nothing to ``uses``);
``fresh`` marks the slots a prefetch filled until a lookup reads them, so ``stats`` can say
how many guesses were used (``prefetch_hits``) against those made (``prefetched``).

A captured batched decode step (several tokens, kernels/routed_experts.py) looks its tokens
up one after another, misses copied in by the lookup, and reads every pair from the slots.
Each lookup of a group is told how many lookups before it belong to the group (``recent``):
the slots those stamped are held as its own hits are, so no token evicts an expert another
token of its group is about to read, whatever the policy. A
row no sequence holds looks nothing up: its lookup's ``live`` flag, read on the device, turns
the call into one that changes and counts nothing.

A prefill chunk reads its union, each expert once (kernels/routed_grouped.py): those the
cache holds from their slots (``held_like``; counted in ``chunk_hits``), the others in place
over the bus, which it does not copy into slots; it then ``fill``s the cache with its last row's experts, stamped as a lookup would stamp them, so the first decode step
finds the experts the latest token used, as every later step does (``filled`` counts them).
A padded last chunk's last row is padding, which repeats the prompt's last token at a later
position: its experts are a close guess at that token's, not always the same.
"""

from __future__ import annotations

import torch

from hostswap.kernels.cache_place import FILL, GUESS, LOOKUP, cache_place
from hostswap.kernels.row_copy import masked_row_copy, triton_available
from hostswap.schedules.experts import plan_expert_cache, resident_blocks

HALF_LIFE = 256  # calls between halvings of the pick counts: hundreds of picks rank the favourites, and a new prompt's take over within as many tokens
# how a miss chooses its slot
POLICIES = {"lfu": f"least frequently used lately (picks counted, halved every {HALF_LIFE} calls), then least recently used",
            "lru": "least recently used"}
DEFAULT_POLICY = "lfu"
GUESSED = -(2**62)  # added to a guessed expert's stamp until a lookup reads it: it goes first, oldest guess first
PREFETCH = "next-layer router on the residual stream"


def ranks_by_uses(policy: str) -> bool:
    """Whether ``policy`` ranks a cache's victims by pick count before their stamps."""
    return policy == "lfu"


class ExpertCache:
    """``slots`` experts of one block's stacked tables on the device, evicted as ``policy``
    says (``POLICIES``), looked up and filled by device ops only."""

    def __init__(self, block: str, num_experts: int, unit_bytes: int, slots: int, top_k: int, device: torch.device, prefetch: int = 0,
                 fused: bool | None = None, policy: str = DEFAULT_POLICY, half_life: int = HALF_LIFE):
        if not top_k <= slots < num_experts:
            raise ValueError(f"an expert cache of {block} needs top_k ({top_k}) to {num_experts - 1} slots, not {slots}")
        check_prefetch(prefetch, ((block, top_k),))
        check_policy(policy)
        self.block, self.slots, self.top_k, self.num_experts = block, slots, top_k, num_experts
        self.policy, self.half_life = policy, int(half_life)
        self.by_uses = ranks_by_uses(policy)
        self.nbytes = slots * unit_bytes
        self.tables: tuple[torch.Tensor | None, ...] | None = None  # made at the first lookup, in the kernel's order of tables
        self.sources: tuple[torch.Tensor | None, ...] | None = None  # the block's tables, as the first lookup gave them
        self.prefetching = int(prefetch)  # missing experts a guess may bring in per call (0: none)
        # the bookkeeping as one Triton kernel (default: on CUDA where Triton is there) or torch ops
        self.fused = (device.type == "cuda" and triton_available()) if fused is None else fused
        # a prefetch runs beside the compute on the GPU; on the CPU in line (the same bookkeeping)
        self.stream = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None
        self._pending = False  # a prefetch was queued that no lookup has waited for yet
        self.fresh = torch.zeros(slots, dtype=torch.bool, device=device)
        self.slot_of = torch.full((num_experts + 1,), -1, dtype=torch.int64, device=device)
        self.expert_of = torch.full((slots,), num_experts, dtype=torch.int64, device=device)
        # picks per expert lately (index num_experts: the sink, an empty slot's), counted under either policy
        self.uses = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
        # stamps: an empty slot's is the lowest (one per slot, the first slot first), a guess's
        # below any lookup's (GUESSED + time)
        self.last_use = torch.iinfo(torch.int64).min + torch.arange(slots, dtype=torch.int64, device=device)
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        # hits, misses, prefetched, prefetch hits, filled: one tensor, so one kernel adds to it
        self._counters = torch.zeros(5, dtype=torch.int64, device=device)
        self.hits, self.misses, self.prefetched, self.prefetch_hits, self.filled = self._counters.unbind()
        # experts calls of several tokens (prefill chunks) read from the slots: the grouped kernel adds to it
        self.chunk_hits = torch.zeros((), dtype=torch.int64, device=device)
        self._never = torch.iinfo(torch.int64).max

    def lookup(self, ids: torch.Tensor, sources: tuple[torch.Tensor | None, ...], left: tuple[int, ...] = (),
               rows: torch.Tensor | None = None, live: torch.Tensor | None = None, recent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots of ``ids`` (one token's distinct top-k), the missed ones filled from
        ``sources`` (the block's tables, in the order the cache was built with; their rows
        ``rows`` where given, else the experts' own), and 1 per id that missed. The tables at
        positions ``left`` are not copied: the caller's products fill their missed rows as they
        read them (``routed_gemv``'s ``fill_from``). Where ``live`` (a 0-d bool device tensor)
        is false the token is a batch row nobody reads: the lookup changes and counts nothing,
        its slots are -1 and it copies nothing. ``recent``: the slots the ``recent`` calls
        before this one stamped are held, as its own hits are (a batched step's group: their
        products have not read them yet); at most ``slots // top_k - 1``. Calls of this cache,
        counted by its clock: no guess or fill may come between a group's lookups (none does: a
        batched step guesses nothing, and its lookups follow one another)."""
        if not 0 <= recent < max(1, self.slots // self.top_k):
            raise ValueError(f"the expert cache of {self.block} holds the slots of at most {self.slots // self.top_k - 1} calls before a lookup, not {recent}")
        return self._use(ids, sources, LOOKUP, left, rows, live, recent)

    def fill(self, ids: torch.Tensor, sources: tuple[torch.Tensor | None, ...], rows: torch.Tensor | None = None) -> None:
        """Bring ``ids`` (distinct experts: a prefill chunk's last row's) in as a lookup of them
        would, counted as filled rather than as hits or misses. Eager: a captured step never fills."""
        self._use(ids, sources, FILL, rows=rows)

    def _use(self, ids: torch.Tensor, sources: tuple[torch.Tensor | None, ...], mode: int, left: tuple[int, ...] = (), rows: torch.Tensor | None = None,
             live: torch.Tensor | None = None, recent: int = 0):
        """Place ``ids`` as used now, once any queued prefetch is in: (slot per id, 1 where it missed)."""
        ids = ids.reshape(-1)
        self._make_tables(sources, ids.device)
        self.settle()
        return self._place(ids, sources, mode, left, rows, live, recent)

    def _make_tables(self, sources: tuple[torch.Tensor | None, ...], device: torch.device) -> None:
        """The slots' tables, made at the first call (a warm-up forward runs before any capture)."""
        if self.tables is not None:
            return
        self.tables = tuple(None if t is None else torch.empty((self.slots, *t.shape[1:]), dtype=t.dtype, device=device) for t in sources)
        if sum(t.numel() * t.element_size() for t in self.tables if t is not None) != self.nbytes:
            raise ValueError(f"the expert cache of {self.block} was sized for {self.nbytes} bytes; its tables' rows take another size")
        self.sources = tuple(sources)

    def held_like(self, sources: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """(slot_of, (gate_up slots, down slots), chunk_hits) for a call of several tokens to
        read the experts the cache holds from their slots, where the slots are laid out as the
        rows of ``sources`` (the block's tables; else None: every expert is read from the
        tables). The slots are made here if no lookup or fill has made them yet: the warm-up's
        prefill chunk, which comes first, then runs the kernel every later chunk runs."""
        self._make_tables(sources, sources[0].device)
        gate_up, down = sources[0], sources[1]
        for table, slots in zip((gate_up, down), self.tables):
            if slots is None or slots.dtype != table.dtype or slots.shape[1:] != table.shape[1:] or slots.stride()[1:] != table.stride()[1:]:
                return None
        return self.slot_of, (self.tables[0], self.tables[1]), self.chunk_hits

    def guess(self, scores: torch.Tensor) -> torch.Tensor:
        """The next lookup's predicted picks, best first, from ``scores`` (one token's router
        logits for this block), of which at most ``prefetching`` are not in the cache: the best
        scored experts the cache lacks, and beside them the best scored cached ones, which a
        prefetch holds (a guessed miss never evicts an expert the guess itself predicts; the
        other missing experts give way). Read on the current stream, in order with the lookups.
        Once a lookup or fill made the tables the cache holds at least top_k experts, so every
        pick is allowed; before that a prefetch does nothing."""
        self.settle()  # a prefetch no lookup joined (the next block failed before its lookup) is in before slot_of is read
        scores = scores.reshape(-1)
        cached = self.slot_of[: self.num_experts] >= 0
        missing = torch.topk(scores.masked_fill(cached, float("-inf")), self.prefetching).indices
        allowed = cached.index_fill(0, missing, True)
        return torch.topk(scores.masked_fill(~allowed, float("-inf")), self.top_k).indices

    def prefetch(self, ids: torch.Tensor) -> None:
        """Bring ``ids`` (a guess at the next lookup's experts) into slots ahead of that lookup:
        on the side stream after what the current stream has queued, which the next
        ``lookup`` (or ``settle``) waits for. Nothing before the first lookup made the slots."""
        if self.sources is None or not self.prefetching:
            return
        ids = ids.reshape(-1)
        if self.stream is None:
            self._prefetch(ids)
            return
        self.stream.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(self.stream):
            self._prefetch(ids)
        ids.record_stream(self.stream)  # made on the current stream, read on this one
        self._pending = True

    def _prefetch(self, ids: torch.Tensor) -> None:
        self._place(ids, self.sources, GUESS)

    def settle(self) -> None:
        """Make the current stream wait for a queued prefetch (before the slots are read)."""
        if self._pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._pending = False

    def _place(self, ids: torch.Tensor, sources, mode: int, left: tuple[int, ...] = (), rows: torch.Tensor | None = None,
               live: torch.Tensor | None = None, recent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Give each of ``ids`` a slot (its own on a hit; else the slot the policy evicts
        first of those no hit of these ids, nor any of the ``recent`` calls before, holds),
        copy the missed rows in, stamp the slots and count the
        call as ``mode`` (LOOKUP, FILL or GUESS): the slot per id. A lookup or fill counts
        its picks in ``uses``, stamps its slots as used now and marks them read; a guess (GUESS)
        counts nothing, stamps nothing it found, and ranks its misses below every expert a
        lookup read: a wrong guess is the first to go, so guesses evict mostly earlier
        guesses, not what lookups keep reading. The tables
        at positions ``left`` are not copied; ``rows``: the sources' row of each id (default: the id).
        ``live`` false: the call leaves the state as it is. Returns (slot per id, 1 where it missed)."""
        if self.fused:
            target, copy = cache_place(ids, self.slot_of, self.expert_of, self.last_use, self.fresh, self.uses, self.clock, self._counters, mode,
                                       self._never, GUESSED, None if live is None else live.reshape(()).view(torch.uint8),
                                       by_uses=self.by_uses, half_life=self.half_life, recent=recent)
        elif live is None:
            target, copy = self._place_ops(ids, mode, recent)
        else:  # placed, then undone where the row is not live: device ops, no host sync
            state = (self.slot_of, self.expert_of, self.uses, self.last_use, self.fresh, self.clock, self._counters)
            before = [t.clone() for t in state]
            target, copy = self._place_ops(ids, mode, recent)
            for now, then in zip(state, before):
                now.copy_(torch.where(live, now, then))
            target, copy = torch.where(live, target, -1), torch.where(live, copy, 0)
        for at, (source, table) in enumerate(zip(sources, self.tables)):
            if table is not None and at not in left:
                masked_row_copy(source, table, ids if rows is None else rows.reshape(-1), target, copy)
        return target, copy

    def _place_ops(self, ids: torch.Tensor, mode: int, recent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``_place``'s bookkeeping as torch ops: (slot per id, 1 where its rows must be copied in)."""
        used = mode != GUESS
        self.clock += 1
        # halved every half_life calls, guesses included (with or without them the halving keeps
        # its pace), then a lookup's or fill's picks counted
        self.uses.copy_(torch.where(self.clock % self.half_life == 0, self.uses >> 1, self.uses))
        if used:
            self.uses.index_put_((ids,), torch.ones_like(ids), accumulate=True)
        slot = self.slot_of[ids]
        hit = slot >= 0
        miss = ~hit
        # the step's hits are not evicted, nor the slots the recent calls stamped; of the other
        # slots an empty one goes first, then an unread guess, then by the policy's order
        held = torch.zeros(self.slots, dtype=torch.int64, device=ids.device).scatter_reduce_(0, slot.clamp(min=0), hit.to(torch.int64), "amax") > 0
        if recent:
            held |= self.last_use >= (self.clock - recent) * (2 * self.slots)
        age = torch.where(held, self._never, self.last_use)
        spare = (self.expert_of == self.num_experts) | self.fresh
        score = torch.where(held, self._never, torch.where(spare, -1, self.uses[self.expert_of] if self.by_uses else 0))
        by_age = torch.argsort(age, stable=True)
        victims = by_age[torch.argsort(score[by_age], stable=True)][: ids.numel()]
        rank = (torch.cumsum(miss.to(torch.int64), 0) - 1).clamp(min=0)
        target = torch.where(hit, slot, victims[rank])
        sink = torch.full_like(ids, self.num_experts)
        evicted = self.expert_of[target]
        self.slot_of.index_put_((torch.where(miss, evicted, sink),), torch.full_like(ids, -1))
        self.slot_of.index_put_((torch.where(miss, ids, sink),), torch.where(miss, target, -1))
        self.expert_of.index_put_((target,), ids)
        # a step's hits count as used before its misses, each in pick order: an order with no
        # ties, below the next call's whatever its number of ids (at most the slots)
        k = ids.numel()
        order = torch.arange(k, device=ids.device) + torch.where(miss, k, 0)
        stamp = self.clock * (2 * self.slots) + order
        self.last_use.index_put_((target,), stamp if used else torch.where(miss, stamp + GUESSED, self.last_use[target]))
        guessed = self.fresh[target]  # the slot held a guess no lookup has read
        self.fresh.index_put_((target,), miss | guessed if mode == GUESS else torch.zeros_like(guessed))
        counted = {LOOKUP: (hit, miss, None, hit & guessed, None), FILL: (None, None, None, None, miss),
                   GUESS: (None, None, miss, None, None)}[mode]
        for counter, add in zip(self._counters.unbind(), counted):
            if add is not None:
                counter += add.sum()
        return target, miss.to(torch.int32)

    def counts(self) -> tuple[int, int, int, int, int]:
        """(hits, misses, prefetched, prefetch hits, filled) since load: a host sync."""
        return tuple(self._counters.tolist())


def check_policy(policy) -> None:
    """Refuse an expert cache policy that is not one of ``POLICIES``."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"expert_cache_policy must be one of {tuple(POLICIES)}, got {policy!r}")


def check_prefetch(prefetch: int, blocks) -> None:
    """Refuse a guess of more experts than a block picks: ``blocks`` are (name, top_k) pairs,
    every routed block of the program, cached or not (a budget that gives no block a cache
    does not hide a bad value)."""
    for block, top_k in blocks:
        if not 0 <= prefetch <= top_k:
            raise ValueError(f"expert_prefetch asks {int(prefetch)} guessed experts per block; {block} picks {top_k} per token")


def place_experts(blocks, room_bytes: int, device: torch.device, prefetch: int = 0, unguessed: frozenset[str] = frozenset(),
                  policy: str = DEFAULT_POLICY) -> tuple[frozenset[str], dict[str, ExpertCache]]:
    """The blocks kept whole on the device, and a cache for each block given fewer slots than
    it has experts (``plan_expert_cache`` over ``room_bytes``), each prefetching up to
    ``prefetch`` guessed experts a step but those of ``unguessed`` (blocks whose tables are on
    disk: a guess copies from the tables by expert id, on the device, which needs them in
    host memory whole). ``policy``: the caches' eviction (``POLICIES``)."""
    slots = plan_expert_cache(blocks, room_bytes)
    caches = {b.block: ExpertCache(b.block, b.num_experts, b.unit_bytes, slots[b.block], b.top_k, device, 0 if b.block in unguessed else prefetch,
                                   policy=policy)
              for b in blocks if 0 < slots[b.block] < b.num_experts}
    return resident_blocks(slots, blocks), caches


def expert_read_stats(block, reads, resident: bool, cache: ExpertCache | None) -> dict:
    """One block's reads for ``stats``: experts read from the device (resident tables, cache
    hits) and over the bus (misses), and the cache behind them."""
    cache_hits, cache_misses, prefetched, prefetch_hits, filled = cache.counts() if cache is not None else (0, 0, 0, 0, 0)
    chunk_hits = int(cache.chunk_hits) if cache is not None else 0
    hits = reads.experts if resident else cache_hits + chunk_hits
    return {"calls": reads.calls, "experts": reads.experts, "hits": hits, "misses": reads.experts - hits,
            # over the bus: every miss, and every expert a prefetch or a prefill's fill brought in
            "bytes": (reads.experts - hits + prefetched + filled) * block.unit_bytes, "resident": resident,
            "cache_slots": block.num_experts if resident else cache.slots if cache is not None else 0,
            "cache_policy": cache.policy if cache is not None else None,
            "prefetch": f"{PREFETCH}, {cache.prefetching} per step" if cache is not None and cache.prefetching else None,
            # the decode steps' lookups alone
            "cache_hits": cache_hits, "cache_misses": cache_misses,
            # experts calls of several tokens (prefill chunks) read from the slots, not over the bus
            "chunk_hits": chunk_hits,
            # experts a guess brought in, and those of them a lookup then read (counted among cache_hits)
            "prefetched": prefetched, "prefetch_hits": prefetch_hits,
            # experts a call of several tokens (a prefill chunk) brought in after reading its union
            # in place: its last row's, for the decode step after it
            "filled": filled}
