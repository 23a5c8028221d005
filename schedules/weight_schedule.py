"""The weight schedule: access order, kernels and floor, as the pass emits and the runtime reads it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import torch.fx

from hostswap.schedules.floor import Floor, compute_floor

SCHEDULE_VERSION = 1


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

    # Rendering lives in schedules/render.py; these are the conveniences DESIGN.md names.
    def table(self, budget_bytes: int | None = None) -> str:
        from hostswap.schedules.render import render_tables

        return render_tables(self, budget_bytes)

    def to_dict(self, budget_bytes: int | None = None) -> dict:
        from hostswap.schedules.render import schedule_report

        return schedule_report(self, budget_bytes)

    def plot(self, path: str, budget_bytes: int | None = None) -> None:
        from hostswap.schedules.render import plot_schedule

        plot_schedule(self, path, budget_bytes)


def _op_name(target) -> str:
    from hostswap.passes.graph_facts import underlying_op

    op = underlying_op(target)
    return str(target) if op is None else f"{op._schema.name}.{op._overloadname}"


def schedule_from_graph(
    graph: torch.fx.Graph,
    *,
    fqn_of_placeholder: Mapping[str, str],
    weight_bytes: Mapping[str, int],
    prefetch_depth: int,
    pin: Sequence[str],
) -> WeightSchedule:
    """Build the schedule of a probed graph: probes in node order, kernels as their readers."""
    from hostswap.passes.graph_facts import is_probe, is_view_like

    order = {node: i for i, node in enumerate(graph.nodes)}
    probes = [n for n in graph.nodes if is_probe(n)]
    kernel_of_probe: list[torch.fx.Node] = []
    for expected_id, node in enumerate(probes):
        probe_id = node.args[1]
        if probe_id != expected_id:
            raise ScheduleError(f"probe ids are not dense and in execution order: found {probe_id} at position {expected_id}")
        readers: set[torch.fx.Node] = set()
        frontier = list(node.users)
        while frontier:
            user = frontier.pop()
            if is_view_like(user):
                frontier.extend(user.users)
            else:
                readers.add(user)
        fqn = fqn_of_placeholder[node.args[0].name]
        if len(readers) != 1:
            names = sorted(r.name for r in readers)
            raise ScheduleError(f"probe {probe_id} of weight '{fqn}' reaches {len(readers)} kernels {names}; each kernel must read a weight through its own probe")
        kernel_of_probe.append(next(iter(readers)))
    kernels = sorted(set(kernel_of_probe), key=order.__getitem__)
    kernel_index = {k: i for i, k in enumerate(kernels)}
    fqns: list[str] = []
    weight_id: dict[str, int] = {}
    probe_weight = []
    for node in probes:
        fqn = fqn_of_placeholder[node.args[0].name]
        if fqn not in weight_id:
            weight_id[fqn] = len(fqns)
            fqns.append(fqn)
        probe_weight.append(weight_id[fqn])
    probe_kernel = [kernel_index[k] for k in kernel_of_probe]
    for p in range(1, len(probe_kernel)):
        if probe_kernel[p] < probe_kernel[p - 1]:
            raise ScheduleError(f"probe {p} runs after kernel {kernels[probe_kernel[p - 1]].name} but feeds the earlier kernel {kernels[probe_kernel[p]].name}")
    for p, (probe, kernel) in enumerate(zip(probes, kernel_of_probe)):
        if p + 1 < len(probes) and probe_kernel[p + 1] == probe_kernel[p]:
            continue
        # every probe of a kernel precedes it; the next kernel's probes come after it
        if order[probe] > order[kernel]:
            raise ScheduleError(f"probe {p} runs after its kernel {kernel.name}")
    return WeightSchedule(
        fqns=tuple(fqns),
        weight_bytes=tuple(int(weight_bytes[f]) for f in fqns),
        probe_weight=tuple(probe_weight),
        probe_kernel=tuple(probe_kernel),
        kernel_ops=tuple(_op_name(k.target) for k in kernels),
        prefetch_depth=prefetch_depth,
        pin=tuple(pin),
    )
