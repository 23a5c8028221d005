"""The interface every weight pool implements, and what the pools share.

A pool serves each probe of a forward, in the recorded order, with a device tensor of the
probed weight, from at most ``budget_bytes`` of device memory. The executor calls
``begin_forward``, then ``acquire`` at each probe and ``kernel_launched`` after each kernel that
reads a weight, then ``end_forward``. Both policies follow the protection contract that
schedules/floor.py proves safe above the floor: memory is reused only behind the event of the
last kernel that read it (runtime/streams.py).

- ``planned`` (runtime/planned_pool.py): residency and ring offsets fixed at load, one arena.
- ``lru`` (runtime/lru_pool.py): per-weight allocations, least-recently-used eviction.
"""

from __future__ import annotations

import dataclasses

import torch

from hostswap.runtime.streams import CopyStreams
from hostswap.schedules.floor import aligned
from hostswap.schedules.weight_schedule import WeightSchedule


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


class WeightPool:
    """Serves probes in the recorded order from at most ``budget_bytes`` of device memory."""

    # Whether a forward can be captured in a CUDA graph (no allocator calls inside a forward).
    capturable = False
    # The reader of weights in the disk tier (runtime/disk_reader.py), for a pool that has one.
    disk_reader = None

    def __init__(self, schedule: WeightSchedule, host_weights: dict[str, torch.Tensor], budget_bytes: int, device: torch.device):
        self.schedule, self.device, self.budget_bytes = schedule, device, budget_bytes
        self.host = [host_weights[f] for f in schedule.fqns]
        self.sizes = [aligned(b) for b in schedule.weight_bytes]
        self.stats = PoolStats()
        self.streams = CopyStreams(device, schedule.num_kernels)
        self._next_probe = 0
        self._launched = -1  # last kernel launched in this forward
        self._live_bytes = 0

    # --- the interface ------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self._next_probe = 0
        self._launched = -1
        self.streams.begin_forward()

    def acquire(self, probe_id: int, fqn: str) -> torch.Tensor:
        """The device tensor of the weight that probe ``probe_id`` reads, ready for its kernel."""
        raise NotImplementedError

    def kernel_launched(self, kernel: int) -> None:
        self._launched = kernel

    def end_forward(self) -> None:
        if self._next_probe != self.schedule.num_probes:
            raise ScheduleDivergenceError(
                f"forward ended after {self._next_probe} probes; the recorded schedule has {self.schedule.num_probes}"
            )
        self.streams.end_forward()
        self.stats.forwards += 1

    def prepare_capture(self) -> None:
        """Make the next forward capturable as a CUDA graph (planned pools on CUDA only)."""
        raise RuntimeError("prepare_capture is for the planned policy on CUDA")

    def disable_carry(self) -> None:
        """Issue no copy at the end of a forward for the next one (pools that do)."""

    def streamed_weights(self) -> list[int]:
        """Weight ids copied from the host after load: the ones whose host pages are worth
        registering with the driver (a resident weight is copied once)."""
        return list(range(len(self.host)))

    def collect_stats(self) -> PoolStats:
        self.stats.stall_seconds += self.streams.collect_stalls()
        return self.stats

    def close(self) -> None:
        """Free the device memory and drop the host views (the mapping goes with the last)."""
        self.host = []

    # --- shared bookkeeping -------------------------------------------------------------------
    def _typed(self, raw: torch.Tensor, w: int) -> torch.Tensor:
        """Weight ``w``'s dtype and shape over the first bytes of ``raw``."""
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
