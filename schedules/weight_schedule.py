"""The weight schedule: access order, kernels and floor, as the pass emits and the runtime reads it."""

from __future__ import annotations

import dataclasses
import functools

from hostswap.schedules.floor import Floor, compute_floor

SCHEDULE_VERSION = 2


class ScheduleError(ValueError):
    """A schedule that is malformed or disagrees with the program it describes."""


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
    def num_probes(self) -> int:
        return len(self.probe_weight)

    @property
    def num_kernels(self) -> int:
        return len(self.kernel_ops)

    @property
    def total_bytes(self) -> int:
        return sum(self.weight_bytes)

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
        )

    # Rendering lives in schedules/render.py; these are conveniences over it.
    def table(self, budget_bytes: int | None = None) -> str:
        from hostswap.schedules.render import render_tables

        return render_tables(self, budget_bytes)

    def to_dict(self, budget_bytes: int | None = None) -> dict:
        from hostswap.schedules.render import schedule_report

        return schedule_report(self, budget_bytes)

    def plot(self, path: str, budget_bytes: int | None = None) -> None:
        from hostswap.schedules.render import plot_schedule

        plot_schedule(self, path, budget_bytes)
