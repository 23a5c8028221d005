"""Whether a router's picks all name experts of its block, as one device flag: one Triton
kernel where the ATen ops take four launches (two comparisons, their conjunction, a reduction).

``hostswap::routed_experts`` asserts on the flag before any expert is read (an id outside
``0..E-1`` would read another expert's rows, or bytes past the table). On CUDA the assertion
is on the device, so a decode step's ids never reach the host and the step stays one CUDA
graph; the flag's kernel is the part of that check this module makes one launch.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from hostswap.kernels.row_copy import triton_available

BLOCK = 1024  # ids a program reads per loop step

tl = None  # triton.language, bound by the first _kernel(): this module imports without Triton


@functools.lru_cache(maxsize=None)
def _kernel():
    # a module global, not a local: Triton's interpreter swaps the globals a kernel reads
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def ids_in_range(ids_ptr, ok_ptr, n, num_experts, BLOCK: tl.constexpr):
        bad = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in range(0, n, BLOCK):
            at = start + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + at, mask=at < n, other=0)
            bad += ((ids < 0) | (ids >= num_experts)).to(tl.int32)
        tl.store(ok_ptr, (tl.sum(bad, axis=0) == 0).to(tl.uint8))

    return ids_in_range


def uses_kernel(ids: torch.Tensor) -> bool:
    """Whether ``ids_in_range`` runs the Triton kernel for ``ids`` (else the ATen ops)."""
    return ids.is_cuda and triton_available() and not ids.dtype.is_floating_point and ids.dtype != torch.bool


def ids_in_range(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A 0-d bool tensor on ``ids``' device: every id is in ``0..num_experts-1``. No host sync."""
    if not uses_kernel(ids):
        return ((ids >= 0) & (ids < num_experts)).all()
    return launch(ids, num_experts)


def launch(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The kernel over ``ids`` (any device Triton runs on: the GPU, or the CPU through its
    interpreter)."""
    import triton

    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    ok = torch.empty((), dtype=torch.uint8, device=ids.device)
    block = min(BLOCK, triton.next_power_of_2(max(flat.numel(), 1)))
    with torch.cuda.device(ids.device) if ids.is_cuda else contextlib.nullcontext():
        _kernel()[(1,)](flat, ok, flat.numel(), num_experts, BLOCK=block, num_warps=1 if block <= 256 else 4)
    return ok.view(torch.bool)
