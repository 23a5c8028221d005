"""The weight schedule of a probed graph: probes in node order, kernels as their readers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.fx

from hostswap.passes.graph_facts import is_probe, underlying_op, views_and_readers
from hostswap.schedules.custom_ops import ROUTED_EXPERTS_OPERATOR, ROUTED_EXPERTS_TABLES
from hostswap.schedules.experts import ExpertBlock, shared_dtype
from hostswap.schedules.weight_schedule import ScheduleError, WeightSchedule


def _op_name(target) -> str:
    op = underlying_op(target)
    return str(target) if op is None else f"{op._schema.name}.{op._overloadname}"


def expert_blocks(graph: torch.fx.Graph, fqn_of_placeholder: Mapping[str, str], weight_bytes: Mapping[str, int], host_read: Sequence[str],
                  weight_dtypes: Mapping[str, str] | None = None) -> tuple[ExpertBlock, ...]:
    """The routed-experts kernels of a graph whose tables are read in place, in node order."""
    blocks = []
    for node in graph.nodes:
        op = underlying_op(node.target) if node.op == "call_function" else None
        if op is None or op._schema.name != ROUTED_EXPERTS_OPERATOR:
            continue
        bound = dict(zip((a.name for a in op._schema.arguments), node.args)) | dict(node.kwargs)
        tables = [fqn_of_placeholder.get(bound[name].name) for name in ROUTED_EXPERTS_TABLES if isinstance(bound.get(name), torch.fx.Node)]
        if not tables or not all(t in host_read for t in tables):
            continue  # its tables are streamed whole (gather_from_host=False)
        num_experts = bound["gate_up"].meta["val"].shape[0]
        blocks.append(ExpertBlock(
            block=bound["block"], tables=tuple(tables), top_k=int(bound["top_k_index"].meta["val"].shape[-1]),
            tokens=int(bound["hidden"].meta["val"].shape[0]), num_experts=int(num_experts),
            unit_bytes=sum(int(weight_bytes[t]) for t in tables) // int(num_experts),
            dtype=shared_dtype([weight_dtypes.get(t, "") for t in tables] if weight_dtypes else []),
        ))
    return tuple(blocks)


def schedule_from_graph(
    graph: torch.fx.Graph,
    *,
    fqn_of_placeholder: Mapping[str, str],
    weight_bytes: Mapping[str, int],
    prefetch_depth: int,
    pin: Sequence[str],
    weight_dtypes: Mapping[str, str] | None = None,
    host_read: Sequence[str] = (),
) -> WeightSchedule:
    """Build the schedule of a probed graph: probes in node order, kernels as their readers."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    probes = [n for n in graph.nodes if is_probe(n)]
    kernel_of_probe: list[torch.fx.Node] = []
    for expected_id, node in enumerate(probes):
        probe_id = node.args[1]
        if probe_id != expected_id:
            raise ScheduleError(f"probe ids are not dense and in execution order: found {probe_id} at position {expected_id}")
        _, readers = views_and_readers(node)
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
        weight_dtypes=tuple(weight_dtypes[f] for f in fqns) if weight_dtypes else (),
        host_read=tuple(host_read),
        host_read_bytes=tuple(int(weight_bytes[f]) for f in host_read),
        expert_blocks=expert_blocks(graph, fqn_of_placeholder, weight_bytes, host_read, weight_dtypes),
    )
