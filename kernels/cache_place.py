"""An expert cache's bookkeeping for one call in one Triton program.

``ExpertCache._place`` (runtime/expert_cache.py) gives each picked expert a slot, evicts
slots for the misses in the policy's order, counts the picks, stamps what it used and counts
hits and misses. As
torch ops that is about forty small kernels a block per decode step, each a launch of a few
microseconds in a replayed CUDA graph: on a many-expert model, more time than the misses'
bytes take on the bus where the cache hits well. Here it is one program of one block, the
picks one per lane and the slots one per lane of a second range: the same state afterwards
as the torch ops leave, call for call (``tests/test_cache_place.py`` compares the two).

Victims are the slots no hit of the call (nor a call of the ``recent`` before it) holds, of
lowest score first: -1 for an empty slot or an unread guess, else the expert's pick count
(``by_uses``: the lfu policy) or 0 (lru); the lowest stamp first among equal scores, the
lowest slot among equal stamps. Stamps are distinct per slot (an empty slot's below any used
one), so the order is the torch path's sorts' order too.
"""

from __future__ import annotations

import contextlib
import functools

import torch

# what a call is, and so which counters it adds to: (hits, misses, prefetched, prefetch hits, filled)
LOOKUP, FILL, GUESS = 0, 1, 2


tl = None  # triton.language, bound by the first _kernel(): this module imports without Triton


@functools.lru_cache(maxsize=None)
def _kernel():
    # a module global, not a local: Triton's interpreter swaps the globals a kernel reads
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def cache_place(ids_ptr, slot_of_ptr, expert_of_ptr, last_use_ptr, fresh_ptr, uses_ptr, clock_ptr, counters_ptr, target_ptr, copy_ptr, on_ptr,
                    k, slots, experts, never, guessed, half_life, recent, K: tl.constexpr, SLOTS: tl.constexpr, EXPERTS: tl.constexpr,
                    MODE: tl.constexpr, GATED: tl.constexpr, BY_USES: tl.constexpr):
        lane = tl.arange(0, K)
        inside = lane < k
        live = inside
        if GATED:  # a call of a row nobody reads: it changes nothing, and its slots are -1
            live = live & (tl.load(on_ptr) != 0)
        ids = tl.load(ids_ptr + lane, mask=live, other=0)
        any_live = tl.max(live.to(tl.int64), 0)
        clock = tl.load(clock_ptr) + any_live
        # the counts halved every half_life calls (guesses too: the clock ticks the same with or
        # without them), then a lookup's or fill's picks counted
        e = tl.arange(0, EXPERTS)
        uses = tl.load(uses_ptr + e, mask=e < experts, other=0)
        uses = tl.where((any_live != 0) & (clock % half_life == 0), uses >> 1, uses)
        if MODE != 2:
            uses += tl.sum(((ids[:, None] == e[None, :]) & live[:, None]).to(tl.int64), axis=0)
        tl.store(uses_ptr + e, uses, mask=e < experts)
        tl.debug_barrier()  # the counts are stored before the slots' experts read them
        slot = tl.load(slot_of_ptr + ids, mask=live, other=-1)
        hit = live & (slot >= 0)
        miss = live & (slot < 0)
        s = tl.arange(0, SLOTS).to(tl.int64)
        in_range = s < slots
        last_use = tl.load(last_use_ptr + s, mask=in_range, other=never)
        # a slot a hit holds is not evicted, nor one the recent calls stamped; of the rest an
        # empty slot or an unread guess goes first, then the lowest score, then the lowest stamp
        held = tl.sum(((slot[:, None] == s[None, :]) & hit[:, None]).to(tl.int32), axis=0) > 0
        held = held | (s >= slots) | ((recent > 0) & (last_use >= (clock - recent) * (2 * slots)))
        age = tl.where(held, never, last_use)
        holding = tl.load(expert_of_ptr + s, mask=in_range, other=experts - 1)
        spare = (holding == experts - 1) | (tl.load(fresh_ptr + s, mask=in_range, other=0) != 0)
        if BY_USES:
            count = tl.load(uses_ptr + holding, mask=in_range, other=0)
        else:
            count = tl.zeros([SLOTS], tl.int64)
        score = tl.where(held, never, tl.where(spare, -1, count))
        rank = tl.cumsum(miss.to(tl.int32), 0) - 1
        target = slot
        for r in tl.static_range(K):
            low = tl.min(score, 0)
            least = score == low
            oldest = tl.min(tl.where(least, age, never), 0)
            victim = tl.min(tl.where(least & (age == oldest), s, SLOTS), 0)
            target = tl.where(miss & (rank == r), victim, target)
            score = tl.where(s == victim, never, score)
            age = tl.where(s == victim, never, age)
        evicted = tl.load(expert_of_ptr + target, mask=live, other=0)
        before = tl.load(last_use_ptr + target, mask=live, other=0)
        fresh = tl.load(fresh_ptr + target, mask=live, other=0) != 0
        tl.debug_barrier()  # every read of the old state is done before any write
        tl.store(slot_of_ptr + evicted, tl.full([K], -1, tl.int64), mask=miss)
        tl.debug_barrier()  # an evicted expert is never one of the picks, but the sink is shared
        tl.store(slot_of_ptr + ids, target, mask=miss)
        tl.store(expert_of_ptr + target, ids, mask=live)
        # a call's hits count as used before its misses, each in pick order
        stamp = clock * (2 * slots) + lane + tl.where(miss, k, 0)
        if MODE == 2:
            tl.store(last_use_ptr + target, tl.where(miss, stamp + guessed, before), mask=live)
            tl.store(fresh_ptr + target, (miss | fresh).to(tl.int8), mask=live)
            tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + tl.sum(miss.to(tl.int64), 0))
        else:
            tl.store(last_use_ptr + target, stamp, mask=live)
            tl.store(fresh_ptr + target, tl.zeros([K], tl.int8), mask=live)
            if MODE == 0:
                tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + tl.sum(hit.to(tl.int64), 0))
                tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + tl.sum(miss.to(tl.int64), 0))
                tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + tl.sum((hit & fresh).to(tl.int64), 0))
            else:
                tl.store(counters_ptr + 4, tl.load(counters_ptr + 4) + tl.sum(miss.to(tl.int64), 0))
        tl.store(clock_ptr, clock)
        tl.store(target_ptr + lane, tl.where(live, target, -1), mask=inside)
        tl.store(copy_ptr + lane, miss.to(tl.int32), mask=inside)

    return cache_place


def cache_place(ids: torch.Tensor, slot_of: torch.Tensor, expert_of: torch.Tensor, last_use: torch.Tensor, fresh: torch.Tensor, uses: torch.Tensor,
                clock: torch.Tensor, counters: torch.Tensor, mode: int, never: int, guessed: int, on: torch.Tensor | None = None, *,
                by_uses: bool, half_life: int, recent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Place ``ids`` (distinct experts) in the cache whose state the other tensors are, as
    ``mode`` (LOOKUP, FILL or GUESS) does: (slot per id, 1 where its rows must be copied in).
    The state tensors are updated in place; no host sync. Where ``on`` (a 0-d bool device
    tensor) is false the call leaves the state as it is: slots -1, nothing to copy.
    ``by_uses``: evict by pick count before stamp (lfu); ``recent``: the calls before this
    one whose slots are held."""
    import triton

    k, slots, experts = ids.numel(), last_use.numel(), uses.numel()
    target = torch.empty(k, dtype=torch.int64, device=ids.device)
    copy = torch.empty(k, dtype=torch.int32, device=ids.device)
    with torch.cuda.device(ids.device) if ids.is_cuda else contextlib.nullcontext():
        _kernel()[(1,)](ids, slot_of, expert_of, last_use, fresh.view(torch.int8), uses, clock, counters, target, copy, clock if on is None else on,
                        k, slots, experts, never, guessed, half_life, recent, K=max(2, triton.next_power_of_2(k)), SLOTS=max(2, triton.next_power_of_2(slots)),
                        EXPERTS=max(2, triton.next_power_of_2(experts)), MODE=mode, GATED=on is not None, BY_USES=by_uses, num_warps=4)
    return target, copy

