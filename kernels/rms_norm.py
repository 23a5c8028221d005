"""RMS normalization over the last dimension in one Triton kernel: a program per row.

``hostswap::rms_norm`` (passes/fused_rms_norm.py) is what transformers' RMSNorm modules
compute: the input cast to float32, divided by the root mean square of its last dimension
(plus eps), cast to the norm's dtype, and, where the model multiplies it next by a vector of
the last dimension's size (its weight), that product. As ATen ops that is six to nine launches
(the casts, pow, mean, add, rsqrt, mul, the weight's mul), each a few microseconds in a
replayed decode graph for a row of a few thousand values; here it is one. The weight's
product is ATen's: both factors as float32, one rounding to the result's dtype. The sums run
in float32, as ATen's mean does, but in another order, so a value can differ from the ATen
ops' by a float32 rounding, which the cast to bfloat16 hides in nearly every row.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from hostswap.kernels.row_copy import triton_available

MAX_BLOCK = 4096  # values a program holds at once; longer rows loop
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

tl = None  # triton.language, bound by the first _kernel(): this module imports without Triton
_normed = None  # the kernel's helper, bound with it


@functools.lru_cache(maxsize=None)
def _kernel():
    # module globals, not locals: Triton's interpreter swaps the globals a kernel reads
    global tl, _normed
    import triton
    import triton.language as tl

    @triton.jit
    def _normed(x, scale, w_ptr, at, ok, NORM_DTYPE: tl.constexpr, WEIGHTED: tl.constexpr):
        y = (x * scale).to(NORM_DTYPE)
        if WEIGHTED:
            y = y.to(tl.float32) * tl.load(w_ptr + at, mask=ok, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def rms_norm_rows(x_ptr, w_ptr, out_ptr, x_row_stride, n, inv_n, eps, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
                      NORM_DTYPE: tl.constexpr, WEIGHTED: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_row_stride
        out_row = out_ptr + row * n
        cols = tl.arange(0, BLOCK)
        if ONE_BLOCK:
            ok = cols < n
            x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            scale = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
            y = _normed(x, scale, w_ptr, cols, ok, NORM_DTYPE, WEIGHTED)
            tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            squares = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n, BLOCK):
                ok = start + cols < n
                x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
                squares += x * x
            scale = tl.math.rsqrt(tl.sum(squares, axis=0) * inv_n + eps)
            for start in range(0, n, BLOCK):
                ok = start + cols < n
                x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
                y = _normed(x, scale, w_ptr, start + cols, ok, NORM_DTYPE, WEIGHTED)
                tl.store(out_row + start + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    return rms_norm_rows


def rms_norm_reference(input: torch.Tensor, eps: float, dtype: torch.dtype, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The ATen ops transformers' RMSNorm runs, one for one: bitwise what the pattern gave."""
    hidden = input.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    normed = (hidden * torch.rsqrt(variance + eps)).to(dtype)
    return normed if weight is None else weight * normed


def result_dtype(dtype: torch.dtype, weight: torch.Tensor | None) -> torch.dtype:
    return dtype if weight is None else torch.promote_types(weight.dtype, dtype)


def uses_kernel(input: torch.Tensor, dtype: torch.dtype, weight: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Whether ``rms_norm_into`` runs the Triton kernel for these tensors (else the ATen ops)."""
    return (input.is_cuda and triton_available() and input.dtype in DTYPES and dtype in DTYPES and out.dtype in DTYPES and out.is_contiguous()
            and out.device == input.device and out.shape == input.shape
            and (weight is None or (weight.dtype in DTYPES and tuple(weight.shape) == (input.shape[-1],) and weight.is_contiguous()
                                    and weight.device == input.device)))


def rms_norm_into(input: torch.Tensor, eps: float, dtype: torch.dtype, weight: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``rms_norm_reference(input, eps, dtype, weight)`` written into ``out`` (of its shape and dtype)."""
    if not uses_kernel(input, dtype, weight, out):
        return out.copy_(rms_norm_reference(input, eps, dtype, weight))
    return launch(input, eps, dtype, weight, out)


@functools.lru_cache(maxsize=None)
def _inverse(n: int) -> float:
    """1/n in float32, as ATen's mean scales its sum (computed once per row length)."""
    return (torch.ones((), dtype=torch.float32) / n).item()


def launch(input: torch.Tensor, eps: float, dtype: torch.dtype, weight: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The kernel over ``input``'s rows into contiguous ``out`` (any device Triton runs on:
    the GPU, or the CPU through its interpreter)."""
    import triton

    if input.numel() == 0:
        return out
    n = input.shape[-1]
    rows = input.numel() // n
    x = input.reshape(rows, n)  # a view where the rows allow it, else a copy
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = min(triton.next_power_of_2(n), MAX_BLOCK)
    kernel = _kernel()
    norm_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
    with torch.cuda.device(input.device) if input.is_cuda else contextlib.nullcontext():
        # no fused multiply-add: ATen rounds the mean and the sum with eps apart
        kernel[(rows,)](x, x if weight is None else weight, out, x.stride(0), n, _inverse(n), float(eps), BLOCK=block, ONE_BLOCK=block >= n,
                        NORM_DTYPE=norm_dtype, WEIGHTED=weight is not None, num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)
    return out
