"""Rotary position embedding in one Triton kernel: ``x * cos + rotate_half(x) * sin``.

``hostswap::rotary`` (passes/fused_rotary.py) is what transformers' ``apply_rotary_pos_emb``
computes for the queries and for the keys: a product by ``cos``, the two halves of the last
dimension swapped with the second negated, a product by ``sin``, and their sum. As ATen ops that
is five launches each (two products, a negation, a concatenation, a sum); here it is one. Each
value is rounded where the ATen ops round it (after each product, after the sum) and nothing
is fused across a rounding, so the result is bitwise theirs.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from hostswap.kernels.row_copy import triton_available

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_DIM = 4  # leading dimensions are padded to three

tl = None  # triton.language, bound by the first _kernel(): this module imports without Triton


@functools.lru_cache(maxsize=None)
def _kernel():
    # a module global, not a local: Triton's interpreter swaps the globals a kernel reads
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def rotary_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, d1, d2, half, xs0, xs1, xs2, xs3, cs0, cs1, cs2, cs3, ss0, ss1, ss2, ss3,
                    BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i0, i1, i2 = row // (d1 * d2), (row // d2) % d1, row % d2
        cols = tl.arange(0, BLOCK)
        ok = cols < 2 * half
        first = cols < half
        partner = tl.where(first, cols + half, cols - half)
        x_row = x_ptr + i0 * xs0 + i1 * xs1 + i2 * xs2
        x = tl.load(x_row + cols * xs3, mask=ok, other=0.0)
        other = tl.load(x_row + partner * xs3, mask=ok, other=0.0)
        c = tl.load(cos_ptr + i0 * cs0 + i1 * cs1 + i2 * cs2 + cols * cs3, mask=ok, other=0.0)
        s = tl.load(sin_ptr + i0 * ss0 + i1 * ss1 + i2 * ss2 + cols * ss3, mask=ok, other=0.0)
        rotated = tl.where(first, -other, other)
        dtype = out_ptr.dtype.element_ty
        # ATen rounds each product to the tensors' dtype, then the sum
        straight = (x.to(tl.float32) * c.to(tl.float32)).to(dtype)
        turned = (rotated.to(tl.float32) * s.to(tl.float32)).to(dtype)
        tl.store(out_ptr + row * (2 * half) + cols, (straight.to(tl.float32) + turned.to(tl.float32)).to(dtype), mask=ok)

    return rotary_rows


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The ATen ops of transformers' ``apply_rotary_pos_emb`` for one tensor, one for one."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def uses_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``rotary_into`` runs the Triton kernel for these tensors (else the ATen ops)."""
    return (x.is_cuda and triton_available() and x.dtype in DTYPES and cos.dtype == sin.dtype == out.dtype == x.dtype
            and 1 <= x.dim() <= MAX_DIM and out.is_contiguous() and cos.device == sin.device == x.device)


def rotary_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rotary_reference(x, cos, sin)`` written into ``out`` (of ``x``'s shape and dtype)."""
    if not uses_kernel(x, cos, sin, out):
        return out.copy_(rotary_reference(x, cos, sin))
    return launch(x, cos, sin, out)


def launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The kernel over ``x``'s rows into contiguous ``out``; ``cos`` and ``sin`` broadcast to
    ``x``'s shape (any device Triton runs on: the GPU, or the CPU through its interpreter)."""
    import triton

    if x.numel() == 0:
        return out
    shape = (1,) * (MAX_DIM - x.dim()) + tuple(x.shape)
    # views all three: leading dimensions of 1 added, cos and sin broadcast by zero strides
    xv, cv, sv = x.reshape(shape), cos.expand(x.shape).reshape(shape), sin.expand(x.shape).reshape(shape)
    d0, d1, d2, d = shape
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _kernel()[(d0 * d1 * d2,)](xv, cv, sv, out, d1, d2, d // 2, *xv.stride(), *cv.stride(), *sv.stride(),
                                   BLOCK=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 4,
                                   enable_fp_fusion=False)  # a product fused into the sum (an FMA) would round once, ATen rounds twice
    return out
