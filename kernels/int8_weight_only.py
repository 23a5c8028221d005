"""int8 weight-only linear for a few rows of activations (decode), in one Triton kernel.

torchao's ``Int8Tensor`` linear without torch.compile runs ``x @ qdata.t().to(x.dtype)`` and
then multiplies by the row scales: it writes a full-precision copy of the weight and reads it
back, five bytes moved per weight against the two of a bf16 linear, so an int8 decode step is
slower than the bf16 one it should halve. This kernel reads each int8 weight once, converts it
in registers and accumulates in fp32, for inputs of at most ``MAX_ROWS`` rows; larger inputs
(prefill) keep torchao's path, where the matmul dominates.

Rounding follows torchao's: the dot product is rounded to the output dtype, multiplied by
the scale rounded to the output dtype (one rounding: the product of two bf16 or fp16 numbers
is exact in fp32) and the bias is added in the output dtype. Only the order of the fp32
accumulation differs from cuBLAS, so results agree to the output dtype's last bit or two.
Deterministic: each output is one program's sum, in a fixed order.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

MAX_ROWS = 4
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def int8_weight_only_gemv(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                              HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        row = tl.program_id(1)
        out_dtype = y_ptr.dtype.element_ty
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            x = tl.load(x_ptr + row * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            acc += w.to(tl.float32) * x[None, :]
        dot = tl.sum(acc, axis=1).to(out_dtype).to(tl.float32)
        scale = tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(out_dtype).to(tl.float32)
        y = (dot * scale).to(out_dtype)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(out_dtype)
            y = (y.to(tl.float32) + bias.to(tl.float32)).to(out_dtype)
        tl.store(y_ptr + row * stride_ym + rn, y, mask=n_ok)

    return int8_weight_only_gemv


def block_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an N x K weight. Measured on an H100 over BLOCK_N 4-32,
    BLOCK_K 256-1024 and 4 or 8 warps, on a Llama's projections (N, K of 512-5632) and its
    32000-row head: few rows and a long K stride per program fill the SMs for the narrow
    projections; the head has programs enough with 8 rows."""
    block_k = min(1024, max(128, 1 << (k - 1).bit_length()))
    if n <= 2048:
        return 4, block_k, 8
    if n <= 8192:
        return 4, block_k, 4
    return 8, min(block_k, 512), 4


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Triton comes with PyTorch's CUDA builds on Linux; without it torchao's path runs."""
    return importlib.util.find_spec("triton") is not None


def applies(input: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel computes this linear: CUDA with Triton, a float input of at most
    MAX_ROWS rows, a row-major int8 weight with one scale per output row."""
    if not (input.is_cuda and input.dtype in DTYPES and qdata.dtype == torch.int8 and qdata.dim() == 2 and qdata.stride(1) == 1):
        return False
    n, k = qdata.shape
    rows = input.numel() // k if k else 0
    return (0 < rows <= MAX_ROWS and input.shape[-1] == k and scale.numel() == n and scale.is_cuda and qdata.is_cuda
            and (bias is None or (bias.is_cuda and bias.numel() == n)) and triton_available())


def int8_weight_only_linear(input: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """``input @ (qdata * scale).t() + bias`` in ``input``'s dtype; ``applies`` must hold."""
    n, k = qdata.shape
    x = input.reshape(-1, k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    shape = (*input.shape[:-1], n)
    y = out if out is not None and out.is_contiguous() and out.dtype == input.dtype else torch.empty(shape, dtype=input.dtype, device=input.device)
    scale = scale.reshape(-1)
    bias = bias.reshape(-1) if bias is not None else None
    block_n, block_k, warps = block_config(n, k)
    grid = ((n + block_n - 1) // block_n, rows)
    with torch.cuda.device(input.device):
        _kernel()[grid](x, qdata, scale, bias if bias is not None else scale, y, n, k, x.stride(0), qdata.stride(0), n,
                        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y
