"""A cost model of one forward under the ``planned`` policy: what the planner compares plans by.

Every exported program has static shapes, so the graph says how much work each kernel does:
the pass records, per scheduled kernel, the work of the kernel itself and of the weightless
ops that run before it (``node_work``: FLOPs and bytes of device memory traffic). With three
device rates, ``simulate_forward`` replays the ring exactly as the runtime drives it (fills
issued at the probes of ``issue_horizon``, each after the kernel whose bytes it overwrites,
one copy engine) against one compute stream, and returns the predicted forward time.

The planner uses the prediction only to choose between plans with the same budget, so only
the rates' ratios matter: FLOPs and bytes of device memory traffic per byte copied
host-to-device. The defaults are what bench/weights.py measured on an H100 (PCIe Gen5):
54.7 GB/s pinned host-to-device, 476 TFLOP/s bf16 over a whole prefill forward, and about
2.8 TB/s for memory-bound kernels. Other GPUs of this class are within a factor of about two
in both ratios (A100: about 10,000 FLOP and 70 bytes per copied byte; H100: 8,700 and 51).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.fx


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """Throughputs the cost model assumes (see the module docstring for the defaults)."""

    h2d_bytes_per_s: float = 54.7e9
    flops_per_s: float = 476e12
    memory_bytes_per_s: float = 2.8e12

    def seconds(self, flops: int, memory_bytes: int) -> float:
        return max(flops / self.flops_per_s, memory_bytes / self.memory_bytes_per_s)


DEFAULT_RATES = DeviceRates()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _val(arg):
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def _flops(op: torch._ops.OpOverload, args: list, kwargs: dict, out) -> int:
    """FLOPs of one op from its operands' shapes; 0 for ops whose cost is memory traffic."""
    name = op._schema.name
    if name in ("aten::linear", "aten::matmul", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"):
        a = args[1] if name in ("aten::addmm", "aten::baddbmm") else args[0]
        outs = _tensors(out)
        if isinstance(a, torch.Tensor) and outs:
            return 2 * outs[0].numel() * a.shape[-1]
        return 0
    if name in ("aten::scaled_dot_product_attention", "hostswap::sdpa"):  # passes/fused_attention.py
        q, k, v = args[:3]
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return 0
        batch = math.prod(q.shape[:-2])
        flops = 2 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        return flops // 2 if causal else flops
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(op.overloadpacket) or flop_registry.get(op)
    if formula is None:
        return 0
    try:
        return int(formula(*args, out_val=out, **kwargs))
    except Exception:  # a formula that does not take this overload's arguments: count memory only
        return 0


def node_work(node: torch.fx.Node) -> tuple[int, int]:
    """(FLOPs, bytes of device memory read and written) of one graph node; (0, 0) for nodes
    that launch no kernel (placeholders, views, probes, getitem)."""
    from hostswap.passes.graph_facts import is_probe, is_view_like, underlying_op

    if node.op != "call_function" or is_view_like(node) or is_probe(node):
        return 0, 0
    op = underlying_op(node.target)
    if op is None:
        return 0, 0
    out = node.meta.get("val")
    args = [_val(a) for a in node.args]
    kwargs = {k: _val(v) for k, v in node.kwargs.items()}
    if not _tensors(out):  # checks such as aten::_assert_tensor_metadata launch nothing
        return 0, 0
    if op._schema.name == "aten::embedding":  # reads only the rows it gathers
        return 0, 2 * _nbytes(out)
    memory = _nbytes(out) + sum(_nbytes(a) for a in args) + sum(_nbytes(v) for v in kwargs.values())
    return _flops(op, args, kwargs, out), memory


def simulate_forward(
    num_kernels: int,
    probe_weight: Sequence[int],
    probe_kernel: Sequence[int],
    work: Sequence[int],
    resident: frozenset[int] | set[int],
    fills: dict[int, tuple[int, int]],
    horizon: Sequence[int],
    rates: DeviceRates = DEFAULT_RATES,
) -> tuple[float, float]:
    """(predicted seconds of one forward, when its last copy lands).

    ``work`` is the schedule's flat per-kernel work (WeightSchedule.kernel_work). ``fills``
    maps a probe whose weight is copied to (bytes, kernel whose bytes it overwrites, -1 for
    none); a streamed weight without a fill of its own is read where an earlier fill put it.
    The host is assumed ahead of the device (it only enqueues), so a fill starts when the
    copy engine is free and the kernel it waits for has ended.
    """
    kernel_end = [0.0] * num_kernels
    probes_of: list[list[int]] = [[] for _ in range(num_kernels)]
    for p, k in enumerate(probe_kernel):
        probes_of[k].append(p)
    ready: dict[int, float] = {}  # weight -> when its latest fill lands
    order = sorted(fills)
    issued = 0
    copy_free = 0.0
    t = 0.0
    for k in range(num_kernels):
        lead_flops, lead_bytes, own_flops, own_bytes = work[4 * k : 4 * k + 4]
        t += rates.seconds(lead_flops, lead_bytes)
        start = t
        for p in probes_of[k]:
            while issued < len(order) and order[issued] <= horizon[p]:
                q = order[issued]
                nbytes, waits_for = fills[q]
                begin = max(copy_free, kernel_end[waits_for] if waits_for >= 0 else 0.0)
                copy_free = begin + nbytes / rates.h2d_bytes_per_s
                ready[probe_weight[q]] = copy_free
                issued += 1
            w = probe_weight[p]
            if w not in resident:
                start = max(start, ready[w])
        t = start + rates.seconds(own_flops, own_bytes)
        kernel_end[k] = t
    tail_flops, tail_bytes = work[4 * num_kernels : 4 * num_kernels + 2]
    return t + rates.seconds(tail_flops, tail_bytes), copy_free
