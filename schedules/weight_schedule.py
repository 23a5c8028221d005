"""The weight schedule: access order, kernels and floor, as the pass emits and the runtime reads it."""

from __future__ import annotations

import dataclasses
import functools

from hostswap.schedules.experts import ExpertBlock, check_expert_blocks, expert_scratch_bytes
from hostswap.schedules.floor import Floor, aligned, compute_floor
from hostswap.schedules.render import plot_schedule, render_tables, schedule_report

SCHEDULE_VERSION = 4
MAX_PREFETCH_DEPTH = 1024  # far beyond any useful depth; bounds what a corrupt file may ask for


class ScheduleError(ValueError):
    """A schedule that is malformed or disagrees with the program it describes."""


def check_prefetch_depth(value, error: type[Exception] = ScheduleError) -> int:
    """``value`` if it is a prefetch depth the pass, the runtime and a stored schedule all
    accept; else ``error`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PREFETCH_DEPTH:
        raise error(f"prefetch_depth must be a non-negative int up to {MAX_PREFETCH_DEPTH}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class WeightSchedule:
    """Static weight access order of one method, and its floor budget."""

    fqns: tuple[str, ...]  # distinct weights, in first-access order (weight id = index)
    weight_bytes: tuple[int, ...]  # bytes per weight id (from the program, not stored in the .pte)
    probe_weight: tuple[int, ...]  # weight id per probe id
    probe_kernel: tuple[int, ...]  # kernel index per probe id
    kernel_ops: tuple[str, ...]  # operator of each kernel, in execution order
    prefetch_depth: int
    pin: tuple[str, ...]
    weight_dtypes: tuple[str, ...] = ()  # dtype name per weight id (from the program, not stored; quantized data is int8/uint8)
    # Weights with no probe that row gathers read in place from host memory (an embedding
    # table): outside the budget, the floor and the copies.
    host_read: tuple[str, ...] = ()
    host_read_bytes: tuple[int, ...] = ()  # per host_read entry (from the program, not stored)
    # MoE blocks whose routed-experts kernel reads picked rows of host_read tables (schedules/experts.py)
    expert_blocks: tuple[ExpertBlock, ...] = ()

    def check(self) -> "WeightSchedule":
        """Raise ScheduleError unless every id and count is in range (a schedule read from a
        file is checked before anything indexes with it)."""
        n, k = len(self.fqns), len(self.kernel_ops)
        if len(set(self.fqns)) != n or not all(isinstance(f, str) and f for f in self.fqns):
            raise ScheduleError("weight_fqns must be distinct non-empty names")
        if len(self.weight_bytes) != n or any(not isinstance(b, int) or b < 0 for b in self.weight_bytes):
            raise ScheduleError("weight_bytes must give one non-negative size per weight")
        if len(self.probe_weight) != len(self.probe_kernel):
            raise ScheduleError(f"probe_weight has {len(self.probe_weight)} entries, probe_kernel {len(self.probe_kernel)}")
        for name, ids, bound in (("probe_weight", self.probe_weight, n), ("probe_kernel", self.probe_kernel, k)):
            bad = next((i for i, v in enumerate(ids) if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < bound), None)
            if bad is not None:
                raise ScheduleError(f"{name}[{bad}] is {ids[bad]!r}, outside 0..{bound - 1}")
        if any(b < a for a, b in zip(self.probe_kernel, self.probe_kernel[1:])):
            raise ScheduleError("probe_kernel must not decrease: probes are recorded in kernel order")
        if not all(isinstance(op, str) for op in self.kernel_ops):
            raise ScheduleError("kernel_ops must be operator names")
        check_prefetch_depth(self.prefetch_depth)
        if self.weight_dtypes and len(self.weight_dtypes) != n:
            raise ScheduleError(f"weight_dtypes gives {len(self.weight_dtypes)} dtypes for {n} weights")
        if len(set(self.host_read)) != len(self.host_read) or not all(isinstance(f, str) and f for f in self.host_read):
            raise ScheduleError("host_read must be distinct non-empty names")
        both = sorted(set(self.host_read) & set(self.fqns))
        if both:
            raise ScheduleError(f"weight '{both[0]}' is both probed and read in place from host memory")
        if len(self.host_read_bytes) != len(self.host_read):
            raise ScheduleError(f"host_read_bytes gives {len(self.host_read_bytes)} sizes for {len(self.host_read)} weights")
        check_expert_blocks(self.expert_blocks, self.host_read, ScheduleError)
        unknown = [f for f in self.pin if f not in self.fqns]
        if unknown:
            raise ScheduleError(f"pin names {unknown[:3]}, which are not weights of the schedule")
        return self

    @functools.cached_property
    def floor(self) -> Floor:
        ids = {fqn: i for i, fqn in enumerate(self.fqns)}
        return compute_floor(
            self.probe_weight,
            self.probe_kernel,
            len(self.kernel_ops),
            self.weight_bytes,
            [ids[f] for f in self.pin],
            self.prefetch_depth,
        )

    @property
    def floor_bytes(self) -> int:
        return self.floor.floor_bytes

    @property
    def expert_scratch_bytes(self) -> int:
        """Device bytes a routed-experts call gathers picked experts into, at most, on a device
        that gathers them (runtime/budget.py ``expert_scratch_on`` says which)."""
        return expert_scratch_bytes(self.expert_blocks)

    @property
    def load_floor_bytes(self) -> int:
        """The least budget that loads on any device: the floor, plus the scratch of routed
        experts (none where a device reads them in place: runtime/budget.py ``load_floor_on``)."""
        return self.floor_bytes + self.expert_scratch_bytes

    @property
    def num_probes(self) -> int:
        return len(self.probe_weight)

    @property
    def num_kernels(self) -> int:
        return len(self.kernel_ops)

    @property
    def total_bytes(self) -> int:
        return sum(self.weight_bytes)

    @property
    def resident_bytes(self) -> int:
        """The budget that holds every weight in the pool: each allocation rounds up to
        ``ALIGNMENT``, so it can exceed ``total_bytes`` by a few KiB (norm weights, biases)."""
        return sum(aligned(b) for b in self.weight_bytes)

    @property
    def all_resident_budget_bytes(self) -> int:
        """The budget that keeps every weight on the device: the pool's aligned bytes, every
        expert table whole and one step's gathered experts; never below the floor."""
        return max(self.resident_bytes + sum(b.table_bytes for b in self.expert_blocks) + self.expert_scratch_bytes, self.load_floor_bytes)

    def bytes_by_dtype(self) -> dict[str, int]:
        """Weight bytes per dtype (quantized weights count their packed bytes)."""
        out: dict[str, int] = {}
        for dtype, nbytes in zip(self.weight_dtypes or ("?",) * len(self.fqns), self.weight_bytes):
            out[dtype] = out.get(dtype, 0) + nbytes
        return out

    def probe_fqns(self) -> list[str]:
        return [self.fqns[w] for w in self.probe_weight]

    def kernel_weight_bytes(self) -> list[int]:
        """Distinct weight bytes each kernel reads (pinned included)."""
        per_kernel: list[set[int]] = [set() for _ in self.kernel_ops]
        for w, k in zip(self.probe_weight, self.probe_kernel):
            per_kernel[k].add(w)
        return [sum(self.weight_bytes[w] for w in ws) for ws in per_kernel]

    def same_order(self, other: "WeightSchedule") -> bool:
        return (
            self.probe_fqns() == other.probe_fqns()
            and self.probe_kernel == other.probe_kernel
            and self.prefetch_depth == other.prefetch_depth
            and self.pin == other.pin
            and self.host_read == other.host_read
            and [b.tables for b in self.expert_blocks] == [b.tables for b in other.expert_blocks]
        )

    # Rendering lives in schedules/render.py (which reads the schedule as ScheduleFacts); these are conveniences over it.
    def table(self, budget_bytes: int | None = None, host_budget_bytes: int | None = None, experts_host: dict | None = None) -> str:
        return render_tables(self, budget_bytes, host_budget_bytes, experts_host)

    def to_dict(self, budget_bytes: int | None = None, host_budget_bytes: int | None = None, experts_host: dict | None = None) -> dict:
        return schedule_report(self, budget_bytes, host_budget_bytes, experts_host)

    def plot(self, path: str, budget_bytes: int | None = None) -> None:
        plot_schedule(self, path, budget_bytes)


def load_floor_bytes(schedules: dict[str, WeightSchedule]) -> int:
    """The least budget, in bytes, that loads a program of these methods on any device: the
    largest method's floor, plus the largest routed-experts scratch (a device buffer outside
    the pool) for a device that gathers a decode step's picks. On CUDA with Triton the products
    read them in place, and the runtime checks the floor alone."""
    return max(s.floor_bytes for s in schedules.values()) + max(s.expert_scratch_bytes for s in schedules.values())
