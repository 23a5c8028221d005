"""An expert cache's bookkeeping for one call in one Triton program.

``ExpertCache._place`` (runtime/expert_cache.py) gives each picked expert a slot, evicts the
least recently used slots for the misses, stamps what it used and counts hits and misses. As
torch ops that is about forty small kernels a block per decode step, each a launch of a few
microseconds in a replayed CUDA graph: on a many-expert model, more time than the misses'
bytes take on the bus where the cache hits well. Here it is one program of one block, the
picks one per lane and the slots one per lane of a second range: the same state afterwards
as the torch ops leave, call for call (``tests/test_cache_place.py`` compares the two).

Victims are the slots of lowest stamp that no hit of the call holds, lowest slot first among
equal stamps; an empty slot's stamp is below any used one and distinct per slot, so the order
is the torch path's ``topk`` order too.
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
    def cache_place(ids_ptr, slot_of_ptr, expert_of_ptr, last_use_ptr, fresh_ptr, clock_ptr, counters_ptr, target_ptr, copy_ptr, on_ptr,
                    k, slots, never, guessed, K: tl.constexpr, SLOTS: tl.constexpr, MODE: tl.constexpr, GATED: tl.constexpr):
        lane = tl.arange(0, K)
        inside = lane < k
        live = inside
        if GATED:  # a call of a row nobody reads: it changes nothing, and its slots are -1
            live = live & (tl.load(on_ptr) != 0)
        ids = tl.load(ids_ptr + lane, mask=live, other=0)
        clock = tl.load(clock_ptr) + tl.max(live.to(tl.int64), 0)
        slot = tl.load(slot_of_ptr + ids, mask=live, other=-1)
        hit = live & (slot >= 0)
        miss = live & (slot < 0)
        s = tl.arange(0, SLOTS).to(tl.int64)
        in_range = s < slots
        last_use = tl.load(last_use_ptr + s, mask=in_range, other=never)
        # a slot a hit holds is not evicted; of the rest the lowest stamp goes first
        held = tl.sum(((slot[:, None] == s[None, :]) & hit[:, None]).to(tl.int32), axis=0) > 0
        age = tl.where(held | (s >= slots), never, last_use)
        rank = tl.cumsum(miss.to(tl.int32), 0) - 1
        target = slot
        for r in tl.static_range(K):
            low = tl.min(age, 0)
            victim = tl.min(tl.where(age == low, s, SLOTS), 0)
            target = tl.where(miss & (rank == r), victim, target)
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


def cache_place(ids: torch.Tensor, slot_of: torch.Tensor, expert_of: torch.Tensor, last_use: torch.Tensor, fresh: torch.Tensor,
                clock: torch.Tensor, counters: torch.Tensor, mode: int, never: int, guessed: int, on: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Place ``ids`` (distinct experts) in the cache whose state the other tensors are, as
    ``mode`` (LOOKUP, FILL or GUESS) does: (slot per id, 1 where its rows must be copied in).
    The state tensors are updated in place; no host sync. Where ``on`` (a 0-d bool device
    tensor) is false the call leaves the state as it is: slots -1, nothing to copy."""
    import triton

    k, slots = ids.numel(), last_use.numel()
    target = torch.empty(k, dtype=torch.int64, device=ids.device)
    copy = torch.empty(k, dtype=torch.int32, device=ids.device)
    with torch.cuda.device(ids.device) if ids.is_cuda else contextlib.nullcontext():
        _kernel()[(1,)](ids, slot_of, expert_of, last_use, fresh.view(torch.int8), clock, counters, target, copy, clock if on is None else on,
                        k, slots, never, guessed, K=max(2, triton.next_power_of_2(k)), SLOTS=max(2, triton.next_power_of_2(slots)), MODE=mode,
                        GATED=on is not None, num_warps=4)
    return target, copy

