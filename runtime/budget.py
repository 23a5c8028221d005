"""The weight budget a program loads with: checked when given, chosen when ``"auto"``.

A loaded program holds three kinds of device memory: the weight pool (the budget), program
state such as a KV cache, and the activation arenas. The last two are fixed by the program;
the budget is the user's choice, or, with ``"auto"``, what the device has free after them and
a margin, capped at the weights' total (a larger pool holds nothing more).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from hostswap.kernels.routed_gemv import reads_in_place_on
from hostswap.runtime.host_memory import available_host_memory
from hostswap.runtime.pool import PoolCreationError
from hostswap.schedules.custom_ops import SDPA_OPERATOR
from hostswap.schedules.experts import expert_scratch_bytes
from hostswap.schedules.op_facts import grouped_in_place, may_read_grouped
from hostswap.schedules.policies import BudgetError, mb_ceil
from hostswap.schedules.pte_program import evalue_scalar, torch_dtype

AUTO = "auto"
# What "auto" leaves free beyond the program's own memory: the CUDA context's growth, cuBLAS
# and attention workspaces, allocator rounding and the caller's own tensors (the prompt, the
# logits it keeps). A share of the device, so that a large GPU keeps a larger reserve.
AUTO_MARGIN_SHARE = 0.05
AUTO_MARGIN_MIN_BYTES = 512 * 2**20


def check_mb_argument(name: str, budget_mb, zero: str | None = None) -> None:
    """Refuse, naming the argument ``name``, what is neither ``"auto"`` nor a finite number of
    MB above 0 (or 0 and above, where ``zero`` says what 0 means)."""
    if isinstance(budget_mb, str):
        if budget_mb != AUTO:
            raise ValueError(f"{name} must be a number of MB or 'auto', got {budget_mb!r}")
        return
    if isinstance(budget_mb, bool) or not isinstance(budget_mb, (int, float)):
        raise ValueError(f"{name} must be a number of MB or 'auto', got {budget_mb!r} ({type(budget_mb).__name__})")
    if not math.isfinite(budget_mb) or budget_mb < 0 or (budget_mb == 0 and zero is None):
        least = "above 0" if zero is None else f"0 or more (0: {zero})"
        raise ValueError(f"{name} must be a finite number of MB {least}, got {budget_mb!r}")


def check_budget_argument(budget_mb) -> None:
    """Refuse what is neither ``"auto"`` nor a positive finite number of MB."""
    check_mb_argument("weight_offload_budget_mb", budget_mb)


def free_memory(device: torch.device) -> int:
    """Bytes the program's memory may take: free device memory on CUDA, available RAM on the CPU
    (the page cache the kernel can drop counted in, a container's limit counted against)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_memory()


def total_memory(device: torch.device) -> int:
    """The device's whole memory (the CPU's: physical RAM)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_margin(total_bytes: int) -> int:
    return max(AUTO_MARGIN_MIN_BYTES, int(total_bytes * AUTO_MARGIN_SHARE))


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class AutoBudget:
    """The budget ``"auto"`` chose and the figures it came from."""

    budget_bytes: int
    free_bytes: int
    state_bytes: int
    activation_bytes: int
    margin_bytes: int
    weight_bytes: int  # every probed weight: the most a pool can hold
    floor_bytes: int

    @property
    def all_resident(self) -> bool:
        return self.budget_bytes >= self.weight_bytes

    def explain(self, device) -> str:
        left = self.free_bytes - self.state_bytes - self.activation_bytes - self.margin_bytes
        why = (f"{_mib(self.free_bytes)} free on {device} - KV cache and other state {_mib(self.state_bytes)} - activations "
               f"{_mib(self.activation_bytes)} - margin {_mib(self.margin_bytes)} = {_mib(left)}")
        if self.all_resident:
            return f"weight budget auto: {_mib(self.budget_bytes)}, every weight resident ({why}; the weights total {_mib(self.weight_bytes)})"
        return (f"weight budget auto: {_mib(self.budget_bytes)} of {_mib(self.weight_bytes)} of weights, the rest streamed ({why}; "
                f"floor {_mib(self.floor_bytes)})")


def auto_budget(*, free_bytes: int, total_bytes: int, state_bytes: int, activation_bytes: int, weight_bytes: int, floor_bytes: int,
                device="cuda") -> AutoBudget:
    """The largest budget that leaves the program's state, its activations and a margin free
    (``AUTO_MARGIN_SHARE`` of the device's ``total_bytes``, at least ``AUTO_MARGIN_MIN_BYTES``),
    capped at ``weight_bytes`` (or the floor, where that is more). Raises ``BudgetError`` naming both the room and the floor
    where the room is below the floor."""
    margin = auto_margin(total_bytes)
    room = free_bytes - state_bytes - activation_bytes - margin
    if room < floor_bytes:
        raise BudgetError(
            f"weight_offload_budget_mb='auto': {device} has {_mib(free_bytes)} free; after the KV cache and other state "
            f"({_mib(state_bytes)}), the activations ({_mib(activation_bytes)}) and a margin of {_mib(margin)}, "
            f"{_mib(max(room, 0))} is left for weights, below this program's floor of {floor_bytes} bytes ({mb_ceil(floor_bytes)} MB). "
            "Free GPU memory, export with a shorter max_seq_len (a smaller KV cache), or give a budget in MB"
        )
    # every weight resident, but never below the floor: where the two largest kernels and the
    # prefetch headroom come to more than all the weights (a small model with a large head),
    # the floor is what loads
    budget = min(room, max(weight_bytes, floor_bytes))
    return AutoBudget(budget_bytes=int(budget), free_bytes=free_bytes, state_bytes=state_bytes, activation_bytes=activation_bytes,
                      margin_bytes=margin, weight_bytes=weight_bytes, floor_bytes=floor_bytes)


def check_device_memory(device, weight_bytes: int, state_bytes: int, activation_bytes: int, free_bytes: int) -> None:
    """Refuse, before allocating, what the device cannot hold, naming all three parts."""
    need = weight_bytes + state_bytes + activation_bytes
    if need > free_bytes:
        raise PoolCreationError(
            f"{device} has {free_bytes / 2**20:.1f} MiB {'of RAM available' if torch.device(device).type == 'cpu' else 'free'}; this program needs {need / 2**20:.1f} MiB: weights "
            f"{weight_bytes / 2**20:.1f} MiB (the budget), state such as a KV cache {state_bytes / 2**20:.1f} MiB, "
            f"activations {activation_bytes / 2**20:.1f} MiB. Lower weight_offload_budget_mb (the floor is the least) "
            "or export with a shorter max_seq_len (or fewer sequences, max_batch_size)"
        )


def expert_scratch_on(schedules, device: torch.device) -> int:
    """Device bytes, outside the pool, that a routed-experts call of these methods' schedules
    gathers its picks into on ``device``: none for a block whose products read its picks in
    place there (kernels/routed_gemv.py)."""
    return max(expert_scratch_bytes(tuple(b for b in s.expert_blocks if not reads_in_place_on(device, b.dtype))) for s in schedules.values())


def load_floor_on(schedules, device: torch.device) -> int:
    """The least budget, in bytes, that loads a program of these methods' schedules on
    ``device``: the largest method's floor plus what ``device`` gathers routed experts into."""
    return max(s.floor_bytes for s in schedules.values()) + expert_scratch_on(schedules, device)


def grouped_attention_scratch_on(program, device: torch.device) -> int:
    """The most device bytes one grouped-query attention call of ``program`` allocates to
    repeat its key and value heads on ``device``, outside the planned arenas.

    Where SDPA reads grouped heads in place (``op_facts.grouped_in_place``: CUDA in 16 bits
    with a fused kernel for the call) none. Elsewhere ``hostswap::sdpa`` repeats key and value
    to the query's heads first, a temporary of the allocator's that the caching allocator then
    keeps: 2 x query heads x positions x width per call, 1 GiB for a float32 8B Llama over 32k
    positions. The load counts it beside the activations, as it counts the experts' scratch.
    Calls of one shape are asked once (on CUDA, with tensors of the call's shapes)."""
    most, asked = 0, {}
    for plan in program.execution_plan:
        operators = [op.name for op in plan.operators]
        for chain in plan.chains:
            for instruction in chain.instructions:
                call = instruction.instr_args
                if type(call).__name__ != "KernelCall" or operators[call.op_index] != SDPA_OPERATOR:
                    continue
                query, key, value, mask = (plan.values[i].val for i in call.args[:4])
                dropout, causal, scale, gqa = (_scalar(plan.values[i]) for i in call.args[4:8])
                if not gqa or key.sizes[-3] == query.sizes[-3]:
                    continue
                shapes = tuple((tuple(t.sizes), torch_dtype(t.scalar_type)) if type(t).__name__ == "Tensor" else None for t in (query, key, value, mask))
                where = (shapes, dropout, causal, scale)
                if where not in asked:
                    asked[where] = _grouped_in_place_for(shapes, dropout, causal, scale, device)
                if not asked[where]:
                    group = query.sizes[-3] // key.sizes[-3]
                    itemsize = torch_dtype(key.scalar_type).itemsize
                    most = max(most, group * (math.prod(key.sizes) + math.prod(value.sizes)) * itemsize)
    return most


def _scalar(value):
    """An EValue's Python value; None for a None."""
    return None if type(value.val).__name__ == "Null" else evalue_scalar(value)


def _grouped_in_place_for(shapes, dropout, causal, scale, device: torch.device) -> bool:
    """``grouped_in_place`` for a call of these (sizes, dtype) of query, key, value and mask
    (None: no mask); tensors to ask SDPA with are made only where it can say yes."""
    if not may_read_grouped(device.type, shapes[0][1]):
        return False
    q, k, v, mask = (torch.empty(shape[0], dtype=shape[1], device=device) if shape is not None else None for shape in shapes)
    return grouped_in_place(q, k, v, mask, dropout, causal, scale)
