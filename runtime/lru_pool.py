"""The ``lru`` weight pool: per-weight allocations, least-recently-used eviction, prefetch.

Which weight to load, prefetch or evict at each probe is decided by
``schedules.policies.LruPolicy`` (plain data, shared with ``hostswap inspect``); this pool
carries the decisions out with real memory: blocks from an allocator capped at the budget
(runtime/allocators.py), copies and stream-ordered frees on the copy stream.
"""

from __future__ import annotations

import torch

from hostswap.runtime.allocators import CudaMemPool, HostAllocator
from hostswap.runtime.pool import PoolCreationError, PoolStats, WeightPool
from hostswap.schedules.policies import LruPolicy, replay_lru
from hostswap.schedules.weight_schedule import WeightSchedule


class LruPool(WeightPool):
    """Loads each weight at its probe (or a prefetch) into its own block; evicts LRU victims."""

    # The allocator off CUDA, where the byte cap is the policy's alone.
    host_allocator_type = HostAllocator

    def __init__(self, schedule: WeightSchedule, host_weights: dict[str, torch.Tensor], budget_bytes: int, device: torch.device, warm: bool = True):
        super().__init__(schedule, host_weights, budget_bytes, device)
        self.lru = LruPolicy(schedule, budget_bytes)
        self._readers: list[list[int]] = [[] for _ in range(schedule.num_kernels)]
        for p, w in enumerate(schedule.probe_weight):
            self._readers[schedule.probe_kernel[p]].append(w)
        self._tensor: dict[int, torch.Tensor] = {}
        self._handle: dict[int, object] = {}
        self._ready: dict[int, object] = {}
        self._last_reader: dict[int, int] = {}
        self._prefetched: set[int] = set()
        if device.type == "cuda":
            try:
                self.allocator = CudaMemPool(device, budget_bytes)
            except PoolCreationError:
                raise
            except Exception as e:  # bindings missing or too old
                raise PoolCreationError(f"cannot create the capped CUDA memory pool: {e}") from e
        else:
            self.allocator = self.host_allocator_type(device, budget_bytes)
        if warm and device.type == "cuda":
            self._rehearse()
        for w in sorted(self.lru.pinned):
            self._load(w, demand=False, count=False)
        if self.lru.pinned:
            # pinned weights never move: wait for their copies once here, not at every probe
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            for w in self.lru.pinned:
                self._ready.pop(w, None)

    # --- the interface ------------------------------------------------------------------------
    def begin_forward(self) -> None:
        super().begin_forward()
        self.lru.begin_forward()

    def kernel_launched(self, kernel: int) -> None:
        super().kernel_launched(kernel)
        if not self.lru.may_evict:
            return
        self.streams.kernel_launched(kernel)
        self.lru.kernel_launched(kernel)
        for w in self._readers[kernel]:
            self._last_reader[w] = kernel

    def acquire(self, probe_id: int, fqn: str) -> torch.Tensor:
        self._check_probe(probe_id, fqn)
        w = self.schedule.probe_weight[probe_id]
        if not self.lru.may_evict:  # the budget holds every weight, all loaded at load time
            self.stats.hits += 1
            return self._tensor[w]
        for action in self.lru.on_probe(probe_id):
            if action.kind == "evict":
                self._evict(action.weight)
            elif action.kind == "load":
                self._load(action.weight, demand=action.demand, probe=probe_id)
            elif action.kind == "hit":
                self.stats.hits += 1
                if action.weight in self._prefetched:
                    self.stats.prefetches_used += 1
                    self._prefetched.discard(action.weight)
        self.streams.compute_waits(self._ready.get(w))
        return self._tensor[w]

    def streamed_weights(self) -> list[int]:
        return [w for w in range(len(self.host)) if w not in self.lru.pinned]

    def close(self) -> None:
        super().close()
        if self.allocator is None:
            return
        stream = self.streams.copy_stream
        for w in list(self._handle):
            self.allocator.free(self._handle.pop(w), stream)
        self._tensor.clear()
        self.allocator.close()
        self.allocator = None

    # --- memory -------------------------------------------------------------------------------
    def _allocate(self, w: int, probe: int, policy: LruPolicy, evict, is_loaded, stats: PoolStats | None) -> tuple[object, torch.Tensor]:
        """Allocate weight ``w``'s bytes, evicting further victims while the allocator refuses.

        The policy keeps the bytes in use within the budget, but a real allocator fragments:
        the driver pool maps memory in chunks, and freed blocks of other sizes need not leave
        one large enough. So evict until the allocation succeeds (policy.evict_for_allocator
        says which weights may go), and hand wholly free chunks back to the driver when that
        can make room for a new chunk.
        """
        size = self.sizes[w]
        stream = self.streams.copy_stream
        # Evict first: a free is stream-ordered and costs nothing now. Once the frees add up to
        # the size, the driver refuses for want of a chunk, not of bytes: hand wholly free chunks
        # back without waiting after each further eviction (below the total budget lru copies
        # nearly every weight every forward, so an extra victim costs almost no bytes), and
        # wait for the copy stream's frees, which stalls the host and drains the copy queue,
        # only when nothing is left to evict.
        freed, trimmed, waited = 0, False, False
        while True:
            got = self.allocator.try_alloc(size, stream, stats)
            if got is not None:
                return got
            if freed >= size and not trimmed:
                self.allocator.trim(stream, wait=False)
                trimmed = True
                if stats is not None:
                    stats.pool_trims += 1
                continue
            action = policy.evict_for_allocator(probe, w, is_loaded)
            if action is not None:
                freed += evict(action.weight)
                trimmed = False
                if stats is not None:
                    stats.fragmentation_evictions += 1
                continue
            if not waited:
                self.allocator.trim(stream, wait=True)
                waited = True
                if stats is not None:
                    stats.pool_trims += 1
                continue
            raise PoolCreationError(
                f"the capped pool refused {size} bytes for '{self.schedule.fqns[w]}' at probe {probe} with only the"
                f" current kernel's weights left to evict ({policy.used} of {self.budget_bytes} budget bytes in use):"
                " the pool is fragmented; use policy='planned', whose fixed layout cannot fragment, or a larger budget"
            )

    def _rehearse(self) -> None:
        """Replay two forwards' allocations and frees (no copies) through the driver pool at load.

        Warms the pool (first-forward allocator work moves to load) and finds out at load, not
        mid-forward, whether the capped pool can serve this schedule at this budget at all.
        """
        stream = self.streams.copy_stream
        live: dict[int, object] = {}
        policy = LruPolicy(self.schedule, self.budget_bytes)

        def evict(w: int) -> int:
            self.allocator.free(live.pop(w), stream)
            return self.sizes[w]

        try:
            for w in sorted(policy.pinned):
                live[w] = self._allocate(w, 0, policy, evict, live.__contains__, None)[0]
            for _, action in replay_lru(policy, self.schedule, forwards=2):
                if action.kind == "evict":
                    evict(action.weight)
                elif action.kind == "load":
                    live[action.weight] = self._allocate(action.weight, action.probe, policy, evict, live.__contains__, None)[0]
        except PoolCreationError as e:
            raise PoolCreationError(f"the lru pool cannot serve this schedule at weight_offload_budget_mb={self.budget_bytes / 2**20:.2f}: {e}") from None
        finally:
            for handle in live.values():
                self.allocator.free(handle, stream)
            torch.cuda.synchronize(self.device)

    def _load(self, w: int, demand: bool, count: bool = True, probe: int = 0) -> None:
        handle, raw = self._allocate(w, probe, self.lru, self._evict, self._handle.__contains__, self.stats if count else None)
        self._handle[w] = handle
        tensor = self._typed(raw, w)
        self._ready[w] = self.streams.copy(tensor, self.host[w])
        self._tensor[w] = tensor
        self._account(self.sizes[w])
        if count:
            self.stats.bytes_h2d += self.schedule.weight_bytes[w]
            if demand:
                self.stats.misses += 1
            else:
                self.stats.prefetches_issued += 1
                self._prefetched.add(w)

    def _evict(self, w: int) -> int:
        if w in self._prefetched:
            self.stats.prefetches_wasted += 1
            self._prefetched.discard(w)
        self.stats.evictions += 1
        # Reuse of the bytes waits for the last kernel that read them (stream-ordered free).
        self.streams.copy_waits_for_kernel(self._last_reader.get(w, -1))
        self.allocator.free(self._handle.pop(w), self.streams.copy_stream)
        del self._tensor[w]
        self._ready.pop(w, None)
        self._account(-self.sizes[w])
        return self.sizes[w]
