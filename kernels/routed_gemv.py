"""A decode step's expert linears read straight from the picked rows of a stacked table: one
Triton program per (pick, block of outputs), no gathered copy.

A decode step multiplies each of its top-k picks' vector by that expert's matrix: row
``rows[p]`` of a table [experts, N, K] (or [experts, K, N] where the table is stored
transposed, as gpt-oss' is). As torch ops that is ``table[rows]`` (a copy of every picked
expert's bytes) and a batched matmul that reads the copy again: three passes over the
experts' bytes where one does, and the experts are most of what a decode step reads. Here
each program reads its block of the picked matrix where it lies (the device table, a cache's
slots, or the mapped host pages of a table kept in host memory) and multiplies as it reads,
accumulating in float32 like the matmul it replaces, rounding once to the table's dtype.

Without Triton (a CPU, a build without it) ``_pairs`` keeps the gathered batched matmul,
which is transformers' ``batched_mm`` arithmetic op for op.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from hostswap.kernels.row_copy import triton_available
from hostswap.schedules.experts import READ_IN_PLACE_DTYPES

# outputs per program, and the stretch of the reduction it loads at a time: a program reads
# BLOCK_N x K elements, enough in flight to keep the bus or the HBM busy on a few picks
BLOCK_N = 16
BLOCK_K = 128
NUM_WARPS = 8
DTYPES = tuple(getattr(torch, name) for name in READ_IN_PLACE_DTYPES)

tl = None  # triton.language, bound by the first _kernel(): this module imports without Triton


@functools.lru_cache(maxsize=None)
def _kernel():
    # a module global, not a local: Triton's interpreter swaps the globals a kernel reads
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def routed_gemv(x_ptr, w_ptr, rows_ptr, out_ptr, src_ptr, src_rows_ptr, copy_ptr, n_out, stride_xp, stride_we, stride_se, stride_wn, stride_wk,
                    K_IN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FILL: tl.constexpr):
        # K_IN is a constant of the compiled kernel: a model has two (hidden, expert width)
        pick = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = tl.load(rows_ptr + pick).to(tl.int64)
        picked = row >= 0  # a row of -1 is no pick (a batch row nobody reads): nothing is read, its product is 0
        row = tl.maximum(row, 0)
        w_row = w_ptr + row * stride_we + n[:, None].to(tl.int64) * stride_wn
        read_row = w_row
        if FILL:  # a missed pick reads its source row and leaves it in its slot row as it goes
            fill = (tl.load(copy_ptr + pick) != 0) & picked
            source = tl.load(src_rows_ptr + pick).to(tl.int64)
            read_row = tl.where(fill, src_ptr + source * stride_se, w_ptr + row * stride_we) + n[:, None].to(tl.int64) * stride_wn
        x_row = x_ptr + pick.to(tl.int64) * stride_xp
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in range(0, K_IN, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + k, mask=k < K_IN, other=0.0).to(tl.float32)
            ok = (n[:, None] < n_out) & (k[None, :] < K_IN) & picked
            at = k[None, :].to(tl.int64) * stride_wk
            w = tl.load(read_row + at, mask=ok, other=0.0)
            if FILL:
                tl.store(w_row + at, w, mask=ok & fill)
            acc += w.to(tl.float32) * x[None, :]
        out = tl.sum(acc, axis=1)
        tl.store(out_ptr + pick.to(tl.int64) * n_out + n, out.to(out_ptr.dtype.element_ty), mask=n < n_out)

    return routed_gemv


def reads_in_place_on(device: torch.device, dtype: str) -> bool:
    """Whether a decode step on ``device`` reads experts of tables of ``dtype`` (a name:
    "bfloat16") where they lie, with no gathered copy: on CUDA with Triton, one floating dtype
    (and activations of that dtype, as a model's are)."""
    return device.type == "cuda" and dtype in READ_IN_PLACE_DTYPES and triton_available()


def supports(x: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether ``routed_gemv`` runs this product: on CUDA with Triton, one floating dtype."""
    return x.is_cuda and table.is_cuda and x.dtype == table.dtype and table.dtype in DTYPES and table.dim() == 3 and triton_available()


def routed_gemv(x: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, transposed: bool,
                fill_from: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``out[p] = table[rows[p]] @ x[p]`` ([experts, N, K] table), or ``x[p] @ table[rows[p]]``
    where ``transposed`` ([experts, K, N]). ``x`` is [picks, K], or [1, K] for one vector shared
    by every pick; ``rows`` a 1-D device tensor of the picks' rows, -1 for a pick to skip (its
    output is 0 and it reads no byte of the table). Returns [picks, N] in the table's dtype. No
    host sync, no copy of the table's rows.

    ``fill_from`` = (source, source_rows, copy): ``table`` is an expert cache's slots, and a pick
    whose ``copy`` is set missed. It reads row ``source_rows[p]`` of ``source`` (the block's
    table, in mapped host memory) instead, and writes what it reads into its slot row: the miss
    is filled by the pass that uses it, while the hits' reads run beside it."""
    picks = rows.numel()
    n_out, k_in = (table.shape[2], table.shape[1]) if transposed else (table.shape[1], table.shape[2])
    stride_wn, stride_wk = (table.stride(2), table.stride(1)) if transposed else (table.stride(1), table.stride(2))
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[-1] != k_in or x.shape[0] not in (1, picks):
        raise ValueError(f"routed_gemv: x {tuple(x.shape)} does not fit {picks} picks of a {tuple(table.shape)} table")
    source, source_rows, copy = fill_from if fill_from is not None else (table, rows, rows)
    if source.shape[1:] != table.shape[1:] or source.stride()[1:] != table.stride()[1:] or source.dtype != table.dtype:
        raise ValueError(f"routed_gemv: rows of the source {tuple(source.shape)} ({source.dtype}) are not laid out as the slots' "
                         f"{tuple(table.shape)} ({table.dtype})")
    out = torch.empty(picks, n_out, dtype=table.dtype, device=x.device)
    stride_xp = 0 if x.shape[0] == 1 else x.stride(0)
    grid = (picks, -(-n_out // BLOCK_N))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _kernel()[grid](x, table, rows, out, source, source_rows, copy, n_out, stride_xp, table.stride(0), source.stride(0), stride_wn, stride_wk,
                        K_IN=k_in, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, FILL=fill_from is not None, num_warps=NUM_WARPS)
    return out
