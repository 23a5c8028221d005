"""The device weight pool: serves every probe from a budget-capped pool, two policies.

``lru`` follows the ExecuTorch weight-offload RFC (per-weight allocations, LRU eviction, prefetch on a copy
stream; on CUDA the allocations come from a ``cudaMemPool_t`` whose maximum size is the
budget). ``planned`` fixes residency and ring offsets at load (schedules/policies.py) and
copies into one arena, so a forward makes no allocator calls and can be captured in a CUDA
graph. Both follow the protection contract that schedules/floor.py proves safe above the
floor; memory is reused only behind the event of the last kernel that read it.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from hostswap.schedules.floor import aligned
from hostswap.schedules.policies import LruPolicy, issue_horizon, plan_layout, replay_lru
from hostswap.schedules.weight_schedule import WeightSchedule

POLICIES = ("lru", "planned")


class PoolCreationError(RuntimeError):
    """The device pool could not be created; carries the system-level cause."""


class ScheduleDivergenceError(RuntimeError):
    """The program asked for a probe the recorded schedule did not predict."""



@dataclasses.dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_h2d: int = 0
    prefetches_issued: int = 0
    prefetches_used: int = 0
    prefetches_wasted: int = 0
    stall_seconds: float = 0.0
    peak_weight_bytes: int = 0
    forwards: int = 0
    allocations: int = 0  # lru on CUDA: cudaMallocFromPoolAsync calls
    allocation_seconds: float = 0.0  # host time spent in them
    pool_trims: int = 0  # lru: allocations retried after handing wholly free chunks back
    fragmentation_evictions: int = 0  # lru: victims beyond the byte count, for a refused allocation
    fills_carried: int = 0  # planned on CUDA: fills issued at the end of a forward for the next
    bytes_carried: int = 0  # their bytes (counted in bytes_h2d too)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Streams:
    """Copy stream, per-kernel release events and the waits between them; no-ops on CPU.

    The calls here run once per probe or kernel on the host, and in a forward that copies
    bound the host leads the GPU only by what it saves: a copy issued late is a copy engine
    idle (prefetch depth 0 issues each copy at its own probe). So: the compute stream is looked
    up once per forward, a copy is one cudaMemcpyAsync on the copy stream (no stream switch,
    no dispatch), callers may pass a reusable completion event, and the timing events that
    measure stalls are reused once read.
    """

    def __init__(self, device: torch.device, num_kernels: int, measure_stalls: bool = True):
        self.cuda = device.type == "cuda"
        self.device = device
        self.measure_stalls = measure_stalls and self.cuda
        self._stall_pairs: list[tuple] = []  # (before, after) timing events, recorded, unread
        self._stall_free: list[tuple] = []  # read ones, for reuse
        self._stall_seconds = 0.0  # read from completed pairs, not yet collected
        self.copy_stream = None  # CPU: copies are synchronous
        self._compute = None
        self._capturing = False
        if self.cuda:
            from hostswap.runtime.ptd import _cudart

            self._cudart = _cudart()
            self._h2d = self._cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
            self.copy_stream = torch.cuda.Stream(device)
            self._copy_handle = self.copy_stream.cuda_stream
            self.kernel_events = [torch.cuda.Event() for _ in range(num_kernels)]
            # timed: the pool reads the last forward's copy span and compute tail from them
            self.forward_start = torch.cuda.Event(enable_timing=True)
            self.copies_done = torch.cuda.Event(enable_timing=True)
            self.forward_end = torch.cuda.Event(enable_timing=True)
            self._timed = False  # a whole forward has recorded all three

    @property
    def compute_stream(self):
        """The stream the current forward runs on (looked up at begin_forward)."""
        return self._compute if self._compute is not None else torch.cuda.current_stream(self.device)

    def begin_forward(self) -> None:
        if self.cuda:
            self._compute = torch.cuda.current_stream(self.device)
            self._capturing = torch.cuda.is_current_stream_capturing()
            if not self._capturing:  # an event query would invalidate a capture
                self._read_stalls(wait=False)
            # Copies of this forward may overwrite what the previous one's kernels still read.
            self.forward_start.record(self._compute)
            self.copy_stream.wait_event(self.forward_start)
            self._timed = False  # until this forward ends: a failed one leaves no timing behind

    def end_forward(self) -> None:
        if self.cuda:
            self.copies_done.record(self.copy_stream)
            self._compute.wait_event(self.copies_done)
            self.forward_end.record(self._compute)
            self._timed = not self._capturing

    def last_forward_times(self) -> tuple[float, float] | None:
        """(seconds from the start of the last forward to its last copy, seconds its kernels ran
        after that copy), or None while that forward is still running (or none was timed).
        Read before the next begin_forward records its start."""
        if not (self.cuda and self._timed and self.forward_end.query()):
            return None
        return self.forward_start.elapsed_time(self.copies_done) / 1e3, self.copies_done.elapsed_time(self.forward_end) / 1e3

    def kernel_launched(self, kernel: int) -> None:
        if self.cuda:
            self.kernel_events[kernel].record(self._compute)

    def copy_waits_for_kernel(self, kernel: int) -> None:
        if self.cuda and kernel >= 0:
            self.copy_stream.wait_event(self.kernel_events[kernel])

    def copy(self, dst: torch.Tensor, src: torch.Tensor, event=None):
        """Host-to-device copy on the copy stream; returns its completion event (None on CPU),
        ``event`` if one is given (re-recorded: the caller no longer waits on its last record)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        if dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.numel() == src.numel():
            (err,) = self._cudart.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), self._h2d, self._copy_handle)
            if err != self._cudart.cudaError_t.cudaSuccess:
                self._cudart.cudaGetLastError()
                _, name = self._cudart.cudaGetErrorName(err)
                raise RuntimeError(f"cudaMemcpyAsync of {src.numel() * src.element_size()} bytes to {self.device} failed: {name.decode()}")
        else:
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(src, non_blocking=True)
        if event is None:
            event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event

    def compute_waits(self, event) -> None:
        if event is None:
            return
        compute = self._compute
        if self.measure_stalls and not self._capturing and not event.query():
            before, after = self._stall_free.pop() if self._stall_free else (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            before.record(compute)
            compute.wait_event(event)
            after.record(compute)
            self._stall_pairs.append((before, after))
        else:
            compute.wait_event(event)

    def _read_stalls(self, wait: bool) -> None:
        """Add the stall time of recorded pairs that have completed (all, after a synchronise
        when ``wait``) and free them for reuse."""
        if not self._stall_pairs:
            return
        if wait:
            torch.cuda.synchronize(self.device)
        pending = []
        for before, after in self._stall_pairs:
            if wait or after.query():
                self._stall_seconds += before.elapsed_time(after) / 1e3
                self._stall_free.append((before, after))
            else:
                pending.append((before, after))
        self._stall_pairs = pending

    def collect_stalls(self) -> float:
        self._read_stalls(wait=True)
        seconds, self._stall_seconds = self._stall_seconds, 0.0
        return seconds


class _CudaMemPool:
    """Per-weight allocations from a cudaMemPool_t capped at the budget (cuda-python bindings)."""

    def __init__(self, device: torch.device, max_bytes: int):
        from hostswap.runtime.ptd import _cudart

        self.cudart = cudart = _cudart()
        props = cudart.cudaMemPoolProps()
        props.allocType = cudart.cudaMemAllocationType.cudaMemAllocationTypePinned
        props.location.type = cudart.cudaMemLocationType.cudaMemLocationTypeDevice
        props.location.id = device.index if device.index is not None else torch.cuda.current_device()
        props.maxSize = max_bytes
        err, self.pool = cudart.cudaMemPoolCreate(props)
        self._check(err, f"cudaMemPoolCreate(maxSize={max_bytes})")
        # Keep freed memory in the pool: the budget is the cap, trimming would only add latency.
        uint64 = getattr(cudart, "cuuint64_t", None)
        if uint64 is None:
            from cuda.bindings import driver

            uint64 = driver.cuuint64_t
        threshold = uint64(max_bytes)
        (err,) = cudart.cudaMemPoolSetAttribute(self.pool, cudart.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold, threshold)
        self._check(err, "cudaMemPoolSetAttribute(ReleaseThreshold)")
        self.device = device
        self.max_bytes = max_bytes

    def _check(self, err, what: str) -> None:
        if err != self.cudart.cudaError_t.cudaSuccess:
            self.cudart.cudaGetLastError()
            _, name = self.cudart.cudaGetErrorName(err)
            raise PoolCreationError(f"{what} failed: {name.decode()}")

    def try_alloc(self, nbytes: int, stream: torch.cuda.Stream, stats: PoolStats | None = None) -> tuple[int, torch.Tensor] | None:
        """An allocation of ``nbytes`` ordered on ``stream``; None when the capped pool refuses."""
        t0 = time.perf_counter()
        err, ptr = self.cudart.cudaMallocFromPoolAsync(nbytes, self.pool, stream.cuda_stream)
        if stats is not None:
            stats.allocations += 1
            stats.allocation_seconds += time.perf_counter() - t0
        if err == self.cudart.cudaError_t.cudaErrorMemoryAllocation:
            self.cudart.cudaGetLastError()
            return None
        self._check(err, f"cudaMallocFromPoolAsync({nbytes} bytes)")
        ptr = int(ptr)
        return ptr, torch.as_tensor(_CudaArray(ptr, nbytes), device=self.device)

    def trim(self, stream: torch.cuda.Stream, wait: bool) -> None:
        """Hand wholly free chunks back to the driver, so that a block larger than any free
        block inside the reserved chunks can be mapped within the cap. A chunk is released
        only once the frees ordered on it have happened: ``wait`` waits for ``stream`` first."""
        if wait:
            stream.synchronize()
        (err,) = self.cudart.cudaMemPoolTrimTo(self.pool, 0)
        self._check(err, "cudaMemPoolTrimTo")

    def free(self, ptr: int, stream: torch.cuda.Stream) -> None:
        (err,) = self.cudart.cudaFreeAsync(ptr, stream.cuda_stream)
        self._check(err, "cudaFreeAsync")

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.cudart.cudaMemPoolDestroy(self.pool)


class _CudaArray:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


class _HostAllocator:
    """The lru allocator off CUDA: one tensor per weight; the byte cap is the policy's."""

    def __init__(self, device: torch.device, max_bytes: int):
        self.device = device

    def try_alloc(self, nbytes: int, stream, stats: PoolStats | None = None) -> tuple[None, torch.Tensor]:
        return None, torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def trim(self, stream, wait: bool) -> None:
        pass

    def free(self, handle, stream) -> None:
        pass

    def close(self) -> None:
        pass


class WeightPool:
    """Serves probes in the recorded order from at most ``budget_bytes`` of device memory."""

    def __init__(self, schedule: WeightSchedule, host_weights: dict[str, torch.Tensor], budget_bytes: int, device: torch.device, policy: str = "planned", warm: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.schedule, self.policy_name, self.device = schedule, policy, device
        self.budget_bytes = budget_bytes
        self.host = [host_weights[f] for f in schedule.fqns]
        self.sizes = [aligned(b) for b in schedule.weight_bytes]
        self.stats = PoolStats()
        self.streams = _Streams(device, schedule.num_kernels)
        self._next_probe = 0
        self._launched = -1  # last kernel launched in this forward
        self._live_bytes = 0
        self._readers: list[list[int]] = [[] for _ in range(schedule.num_kernels)]
        for p, w in enumerate(schedule.probe_weight):
            self._readers[schedule.probe_kernel[p]].append(w)
        if policy == "lru":
            self._init_lru(warm)
        else:
            self._init_planned()

    # --- bookkeeping shared by both policies -------------------------------------------
    def _typed(self, raw: torch.Tensor, w: int) -> torch.Tensor:
        host = self.host[w]
        return raw[: host.numel() * host.element_size()].view(host.dtype).view(host.shape)

    def _account(self, delta: int) -> None:
        self._live_bytes += delta
        self.stats.peak_weight_bytes = max(self.stats.peak_weight_bytes, self._live_bytes)

    def _check_probe(self, probe_id: int, fqn: str) -> None:
        expected = self._next_probe
        if expected >= self.schedule.num_probes or probe_id != expected or self.schedule.fqns[self.schedule.probe_weight[expected]] != fqn:
            want = "the end of the schedule" if expected >= self.schedule.num_probes else f"probe {expected} ('{self.schedule.fqns[self.schedule.probe_weight[expected]]}')"
            raise ScheduleDivergenceError(
                f"probe sequence diverged from the recorded schedule: the program asked for probe {probe_id} ('{fqn}') where the schedule has {want}"
            )
        self._next_probe += 1

    def begin_forward(self) -> None:
        self._next_probe = 0
        if self.policy_name == "planned":
            self._decide_carry()  # from the last forward's timing, before its events are re-recorded
        self.streams.begin_forward()
        if self.policy_name == "lru":
            self.lru.begin_forward()
        else:
            self._issued = 0
            self._prefetched_fills = set()
            self._forward_bytes = 0
            carried, self._carried = self._carried, []
            if carried:  # copied at the end of the previous forward (end_forward)
                self._prefetched_fills.update(carried)
                self._issued = carried[-1] + 1
                if torch.cuda.is_current_stream_capturing():
                    # A replay runs after the previous one has finished, carried copies
                    # included (one graph launch after the other on the launching stream), and
                    # the first after prepare_capture's synchronised copies: nothing to wait for
                    # inside the graph, and an event recorded outside it cannot be waited on.
                    for q in carried:
                        self._ring_ready[q] = None
        self._launched = -1
        # Fills issued now, before the inputs are bound and the executor starts: the copy
        # engine starts about 0.2 ms earlier in a forward it bounds. On release (depth >= 1):
        # every leading fill that overwrites nothing this forward reads, which includes all the
        # first probe would issue. Otherwise, on CUDA, those the first probe would issue
        # (issue_horizon; each overwrites nothing this forward reads, or _issue_fill refuses).
        if self.policy_name == "planned" and self.issue_on_release:
            self._issue_released_fills()
        elif self.policy_name == "planned" and self.schedule.num_probes and self.device.type == "cuda":
            self._issue_fills_through(self._issue_through[0], None)

    def end_forward(self) -> None:
        if self._next_probe != self.schedule.num_probes:
            raise ScheduleDivergenceError(
                f"forward ended after {self._next_probe} probes; the recorded schedule has {self.schedule.num_probes}"
            )
        self.streams.end_forward()
        self.stats.forwards += 1
        if self.policy_name == "planned" and self._carry_count:
            self._carry_fills()

    # --- planned: fills carried into the next forward ------------------------------------------
    def _decide_carry(self) -> None:
        """How many of the next forward's first fills to issue at the end of each forward.

        When copies bound a forward, it ends with kernels that run after its last copy while
        the copy engine idles (in prefill, the last layer's MLP and the head behind the last
        streamed attention projection: about 2 ms on the benchmark's model). The first fills of
        the next forward can copy in that idle tail. As many are carried as the measured tail
        hides at the bandwidth the forward's own copies achieved; none where the tail is short
        (decode): carrying there would only move copies from one forward to the other and
        leave the copy engine waiting at the next forward's head for the host to reach a probe
        that may issue more. Measured, not modelled: the decision follows the workload.
        """
        if self._carry_frozen or not (self.carry_allowed and self.layout.carry_waits_for):
            return
        times = self.streams.last_forward_times()
        if times is None or self._forward_bytes <= 0:
            return  # keep the last decision
        span_s, tail_s = times
        if span_s <= 0:
            return
        hidden = tail_s * self._forward_bytes / span_s  # bytes the idle tail could copy
        count, total = 0, 0
        for q in self._carry_order:
            total += self.schedule.weight_bytes[self.schedule.probe_weight[q]]
            if total > hidden:
                break
            count += 1
        self._carry_count = count

    def _carry_fills(self) -> None:
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and not self._carry_frozen:
            return  # a graph's carried fills must match what prepare_capture placed
        for q in self._carry_order[: self._carry_count]:
            self.stats.bytes_carried += self._copy_fill(q, self.layout.carry_waits_for[q])
            self.stats.fills_carried += 1
            self._carried.append(q)
        if capturing:
            # Join the copy stream back into the captured work: the graph ends when its carried
            # copies have, and the next replay (stream-ordered after it) finds them done.
            self.streams.compute_stream.wait_stream(self.streams.copy_stream)

    def prepare_capture(self) -> None:
        """Fix the carry for a CUDA graph and place the fills its replays will take as carried.

        Call after at least one eager forward has finished (synchronised) and before capturing
        one. The carry count is decided once from that forward's measured tail and frozen: the
        captured forward skips the first ``_carry_count`` fills at its start and copies them at
        its end for the next replay, so the graph's idle tail copies as an eager forward's
        does. Here those fills are copied once, synchronously, for the first replay.
        """
        if self.policy_name != "planned" or self.device.type != "cuda":
            raise RuntimeError("prepare_capture is for the planned policy on CUDA")
        self._decide_carry()
        self._carry_frozen = True
        torch.cuda.synchronize(self.device)  # every reader of the ring has finished
        self._carried = []
        for q in self._carry_order[: self._carry_count]:
            self._copy_fill(q, -1)
            self._carried.append(q)
        torch.cuda.synchronize(self.device)

    def kernel_launched(self, kernel: int) -> None:
        self._launched = kernel
        if self.policy_name == "lru":
            if not self.lru.may_evict:
                return
            self.streams.kernel_launched(kernel)
        elif kernel in self._awaited_kernels:
            self.streams.kernel_launched(kernel)
            if self.issue_on_release:
                self._issue_released_fills()
        if self.policy_name == "lru":
            self.lru.kernel_launched(kernel)
            for w in self._readers[kernel]:
                self._last_reader[w] = kernel

    def acquire(self, probe_id: int, fqn: str) -> torch.Tensor:
        self._check_probe(probe_id, fqn)
        return self._acquire_lru(probe_id) if self.policy_name == "lru" else self._acquire_planned(probe_id)

    def collect_stats(self) -> PoolStats:
        self.stats.stall_seconds += self.streams.collect_stalls()
        return self.stats

    # --- lru -------------------------------------------------------------------------------
    def _init_lru(self, warm: bool) -> None:
        self.lru = LruPolicy(self.schedule, self.budget_bytes)
        self._tensor: dict[int, torch.Tensor] = {}
        self._handle: dict[int, object] = {}
        self._ready: dict[int, object] = {}
        self._last_reader: dict[int, int] = {}
        self._prefetched: set[int] = set()
        if self.device.type == "cuda":
            try:
                self.allocator = _CudaMemPool(self.device, self.budget_bytes)
            except PoolCreationError:
                raise
            except Exception as e:  # bindings missing or too old
                raise PoolCreationError(f"cannot create the capped CUDA memory pool: {e}") from e
        else:
            self.allocator = _HostAllocator(self.device, self.budget_bytes)
        if warm and self.device.type == "cuda":
            self._rehearse_lru()
        for w in sorted(self.lru.pinned):
            self._load(w, demand=False, count=False)
        if self.lru.pinned:
            # pinned weights never move: wait for their copies once here, not at every probe
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for w in self.lru.pinned:
                self._ready.pop(w, None)

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

    def _rehearse_lru(self) -> None:
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

    def _acquire_lru(self, probe_id: int) -> torch.Tensor:
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

    # --- planned -----------------------------------------------------------------------------
    def _init_planned(self) -> None:
        self.layout = layout = plan_layout(self.schedule, self.budget_bytes)
        try:
            self.arena = torch.empty(layout.arena_bytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            raise PoolCreationError(f"cannot allocate the {layout.arena_bytes}-byte weight arena on {self.device}: {e}") from e
        self._account(layout.arena_bytes)
        self._resident: dict[int, torch.Tensor] = {}
        for w, offset in layout.resident_offsets.items():
            t = self._typed(self.arena[offset : offset + self.sizes[w]], w)
            self.streams.copy(t, self.host[w])
            self._resident[w] = t
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._ring_tensor: dict[int, torch.Tensor] = {}  # probe -> tensor in the ring
        self._ring_ready: dict[int, object] = {}
        for p, offset in {**layout.fill_offset, **layout.reuse_offset}.items():
            w = self.schedule.probe_weight[p]
            start = layout.ring_offset + offset
            self._ring_tensor[p] = self._typed(self.arena[start : start + self.sizes[w]], w)
        # reuse probe -> the fill probe whose copy it reads
        self._source_fill: dict[int, int] = {}
        last_fill: dict[tuple[int, int], int] = {}
        for p in range(self.schedule.num_probes):
            w = self.schedule.probe_weight[p]
            if p in layout.fill_offset:
                last_fill[(w, layout.fill_offset[p])] = p
            elif p in layout.reuse_offset:
                self._source_fill[p] = last_fill[(w, layout.reuse_offset[p])]
        # One completion event per ring fill, re-recorded at each of its copies.
        self._fill_events = {q: torch.cuda.Event() for q in layout.fill_offset} if self.device.type == "cuda" else {}
        self._issued = 0
        self._prefetched_fills: set[int] = set()
        # Only kernels that a ring fill waits for need an event (none when all is resident).
        waited = list(layout.fill_waits_for.values()) + list(layout.carry_waits_for.values())
        self._awaited_kernels = frozenset(k for k in waited if k >= 0)
        self._carry_order = sorted(layout.carry_waits_for)
        self._carry_count = 0
        self._carried: list[int] = []
        self._forward_bytes = 0
        self.carry_allowed = self.device.type == "cuda"
        self._carry_frozen = False  # prepare_capture: fixed for a CUDA graph
        self._issue_through = issue_horizon(self.schedule, layout)
        # Depth >= 1: a fill is also issued as soon as the last kernel reading the ring bytes
        # it overwrites has been launched (_issue_released_fills), not only through the depth
        # horizon at each probe. Depth 0, the no-prefetch reference, issues each copy at its
        # own probe.
        self.issue_on_release = self.schedule.prefetch_depth >= 1

    def _issue_fill(self, q: int) -> None:
        waits_for = self.layout.fill_waits_for[q]
        if waits_for > self._launched:
            # The event of a kernel not launched in this forward still holds the previous
            # forward's record: waiting on it would let the copy overwrite live bytes.
            raise ScheduleDivergenceError(
                f"ring fill for probe {q} ('{self.schedule.fqns[self.schedule.probe_weight[q]]}') must wait for kernel {waits_for}, "
                f"but only kernels up to {self._launched} have been launched in this forward"
            )
        self._forward_bytes += self._copy_fill(q, waits_for)

    def _copy_fill(self, q: int, waits_for: int) -> int:
        """Copy probe ``q``'s weight into its ring slot after kernel ``waits_for``; its bytes."""
        self.streams.copy_waits_for_kernel(waits_for)
        w = self.schedule.probe_weight[q]
        self._ring_ready[q] = self.streams.copy(self._ring_tensor[q], self.host[w], self._fill_events.get(q))
        self.stats.bytes_h2d += self.schedule.weight_bytes[w]
        return self.schedule.weight_bytes[w]

    def _issue_fills_through(self, last: int, probe_id: int | None) -> None:
        """Issue every ring fill up to probe ``last``; one for ``probe_id`` itself is a miss."""
        while self._issued <= last:
            q = self._issued
            if q in self.layout.fill_offset:
                self._issue_fill(q)
                if q == probe_id:
                    self.stats.misses += 1
                else:
                    self.stats.prefetches_issued += 1
                    self._prefetched_fills.add(q)
            self._issued += 1

    def _issue_released_fills(self) -> None:
        """Issue, in order, every next ring fill whose bytes the kernels launched so far release.

        The depth horizon issues a fill only a fixed number of streamed probes ahead, so at the
        head of a forward, after the carried fills, the copy engine waits for the host to reach
        the probe that issues the next one (on the H100 bench, 1.1 ms of a 23 ms prefill at
        75 %) although its ring slot was released by a kernel launched long before. Issued
        here, the copy waits on the GPU for that kernel's event (as every fill does), so the
        copy stream runs as far ahead as the ring allows. Stream order is kept: fills are
        issued in probe order, and the first one not yet released stops the walk.
        """
        waits_for, n = self.layout.fill_waits_for, self.schedule.num_probes
        while self._issued < n:
            q = self._issued
            if q in waits_for:
                if waits_for[q] > self._launched:
                    return
                self._issue_fill(q)
                self.stats.prefetches_issued += 1
                self._prefetched_fills.add(q)
            self._issued += 1

    def _acquire_planned(self, probe_id: int) -> torch.Tensor:
        layout = self.layout
        w = self.schedule.probe_weight[probe_id]
        self._issue_fills_through(self._issue_through[probe_id], probe_id)
        if w in self._resident:
            self.stats.hits += 1
            return self._resident[w]
        if probe_id in layout.fill_offset:
            if probe_id in self._prefetched_fills:
                self._prefetched_fills.discard(probe_id)
                self.stats.prefetches_used += 1
            self.streams.compute_waits(self._ring_ready[probe_id])
        else:
            self.stats.hits += 1
            self.streams.compute_waits(self._ring_ready[self._source_fill[probe_id]])
        return self._ring_tensor[probe_id]

    def close(self) -> None:
        if self.policy_name == "lru" and self.allocator is not None:
            stream = self.streams.copy_stream
            for w in list(self._handle):
                self.allocator.free(self._handle.pop(w), stream)
            self._tensor.clear()
            self.allocator.close()
            self.allocator = None
