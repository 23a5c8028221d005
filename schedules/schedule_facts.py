"""What rendering and the pool policies read of a weight schedule, as a structural type.

``WeightSchedule`` (schedules/weight_schedule.py) satisfies it; render.py and policies.py
annotate with it instead of importing the schedule, so the schedule can import them and the
dependency runs one way: weight_schedule -> render -> policies -> schedule_facts -> floor.
"""

from __future__ import annotations

from typing import Protocol

from hostswap.schedules.experts import ExpertBlock
from hostswap.schedules.floor import Floor


class ScheduleFacts(Protocol):
    """A weight schedule, read only (see ``WeightSchedule`` for what each field means)."""

    @property
    def fqns(self) -> tuple[str, ...]: ...

    @property
    def weight_bytes(self) -> tuple[int, ...]: ...

    @property
    def probe_weight(self) -> tuple[int, ...]: ...

    @property
    def probe_kernel(self) -> tuple[int, ...]: ...

    @property
    def kernel_ops(self) -> tuple[str, ...]: ...

    @property
    def prefetch_depth(self) -> int: ...

    @property
    def pin(self) -> tuple[str, ...]: ...

    @property
    def weight_dtypes(self) -> tuple[str, ...]: ...

    @property
    def host_read(self) -> tuple[str, ...]: ...

    @property
    def host_read_bytes(self) -> tuple[int, ...]: ...

    @property
    def expert_blocks(self) -> tuple[ExpertBlock, ...]: ...

    @property
    def floor(self) -> Floor: ...

    @property
    def floor_bytes(self) -> int: ...

    @property
    def expert_scratch_bytes(self) -> int: ...

    @property
    def load_floor_bytes(self) -> int: ...

    @property
    def num_probes(self) -> int: ...

    @property
    def num_kernels(self) -> int: ...

    @property
    def total_bytes(self) -> int: ...

    @property
    def resident_bytes(self) -> int: ...

    def bytes_by_dtype(self) -> dict[str, int]: ...

    def kernel_weight_bytes(self) -> list[int]: ...
