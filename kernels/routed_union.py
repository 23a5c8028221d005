"""A captured step of several tokens multiplies each expert any of its tokens picked once, over
those tokens: one Triton program per (expert, block of outputs), which reads the expert's
block where it lies only where a token picked it.

A batched decode step (or a verify step of several draft tokens) cannot learn its picks on the
host: it is replayed from a CUDA graph. Per (token, pick) products (kernels/routed_gemv.py)
read an expert once for each token that picked it; a pass over every expert reads those no
token picked. Here every expert has its programs, and each first reads the step's picks: where
no token picked its expert it returns having read no byte of the table, and otherwise it reads
its block of the expert's matrix once and multiplies it by the vectors of the tokens that
picked it. The step reads the union of its picks, each expert once (once per ``MAX_ROWS``
tokens: a program multiplies that many at most), with no host sync, and counts the experts
it read on the device. Picks of -1 (rows of a batch nobody reads) pick nothing; a token that
picks an expert twice gets its product at both picks, as per-pick products give it.

Each program's products are one matrix multiply of the picking tokens' vectors (padded to 16
rows, the least a tensor-core product of 16-bit floats takes; float32 tables multiply in
float32, not TF32) by the block, accumulated in float32 and rounded once to the table's
dtype, as the per-pick products are. The sums run in another order, so the two agree within
rounding, not bit for bit; a token's sums do not depend on the other tokens.
"""

from __future__ import annotations

import contextlib
import functools

import torch

# outputs per program, the stretch of the reduction it loads at a time, and its loads in
# flight: the fastest of a sweep on an H200 (tables on the device, 2 to 16 tokens of top-8 of
# 128 and of top-2 of 8), where this kernel then reads faster than per-pick products
BLOCK_N = 32
BLOCK_K = 256
NUM_WARPS = 4
NUM_STAGES = 4
# the least rows a tensor-core product takes: the picking tokens' vectors are padded to it;
# and the most a program multiplies (more tokens are taken that many at a time, each group
# reading the experts it picks)
MIN_ROWS = 16
MAX_ROWS = 64

tl = None  # triton.language, bound by the first _kernel(): this module imports without Triton


@functools.lru_cache(maxsize=None)
def _kernel():
    # a module global, not a local: Triton's interpreter swaps the globals a kernel reads
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def routed_union(x_ptr, w_ptr, ids_ptr, out_ptr, count_ptr, tokens, top_k, n_out, stride_xt, stride_xj, stride_we, stride_wn, stride_wk,
                     K_IN: tl.constexpr, ROWS: tl.constexpr, PICKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, COUNT: tl.constexpr):
        expert = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.arange(0, ROWS)
        j = tl.arange(0, PICKS)
        ids = tl.load(ids_ptr + t[:, None] * top_k + j[None, :], mask=(t[:, None] < tokens) & (j[None, :] < top_k), other=-1)
        picked = ids == expert  # [ROWS, PICKS]
        chose = tl.max(picked.to(tl.int32), axis=1) > 0  # [ROWS]: the tokens that picked this expert
        if tl.max(chose.to(tl.int32), axis=0) > 0:  # no token picked it: nothing is read
            if COUNT:
                if tl.program_id(1) == 0:  # one program of each expert read counts it
                    tl.atomic_add(count_ptr, 1)
            # a token's vector is that of its first pick of the expert: a token that picks it
            # twice has the same vector for both (the same expert of the same token's vector)
            slot = tl.min(tl.where(picked, j[None, :], PICKS), axis=1)
            slot = tl.where(chose, slot, 0)
            x_rows = x_ptr + t.to(tl.int64) * stride_xt + slot.to(tl.int64) * stride_xj
            w_block = w_ptr + expert.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn
            acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            for start in range(0, K_IN, BLOCK_K):
                k = start + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows[:, None] + k[None, :], mask=chose[:, None] & (k[None, :] < K_IN), other=0.0)
                w = tl.load(w_block + k[:, None].to(tl.int64) * stride_wk, mask=(k[:, None] < K_IN) & (n[None, :] < n_out), other=0.0)
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            # the product goes to each of the token's picks of the expert
            pair = t[:, None].to(tl.int64) * top_k + j[None, :]  # [ROWS, PICKS]
            at = out_ptr + pair[:, :, None] * n_out + n[None, None, :]
            tl.store(at, acc.to(out_ptr.dtype.element_ty)[:, None, :], mask=picked[:, :, None] & (n[None, None, :] < n_out))

    return routed_union


def routed_union(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, transposed: bool, per_pick: bool,
                 count_into: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t * k + j] = table[ids[t, j]] @ x[t]`` ([experts, N, K] table), or
    ``x[t] @ table[ids[t, j]]`` where ``transposed`` ([experts, K, N]); with ``per_pick``, the
    vector of pick (t, j) is ``x[t * k + j]``. ``ids`` is [tokens, k] on the device, -1 for no
    pick (its output row is 0). Each expert any pick names is read once for each ``MAX_ROWS``
    tokens; the others are not read. ``count_into`` (a 0-d int64 device tensor) has the experts
    read added to it. Returns [tokens * k, N] in the table's dtype. No host sync, no copy of the
    table. Runs where ``routed_gemv`` does (``routed_gemv.supports``)."""
    if ids.dim() != 2:
        raise ValueError(f"routed_union: ids {tuple(ids.shape)} are not [tokens, k]")
    tokens, top_k = ids.shape
    x, n_out, k_in, (stride_wn, stride_wk), (stride_xt, stride_xj) = operand_layout("routed_union", x, table, ids, transposed, per_pick)
    ids = ids.contiguous()
    import triton

    out = torch.zeros(tokens * top_k, n_out, dtype=table.dtype, device=x.device)
    grid = (table.shape[0], -(-n_out // BLOCK_N))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        for start in range(0, tokens, MAX_ROWS):
            group = min(MAX_ROWS, tokens - start)
            rows = max(MIN_ROWS, triton.next_power_of_2(group))
            block_k, stages = _tiles(rows, table.element_size(), x.device)
            # a group's vectors and outputs start at its first token's
            first = start * (top_k if per_pick else 1)
            _kernel()[grid](x[first:], table, ids[start:], out[start * top_k :], out if count_into is None else count_into, group, top_k, n_out, stride_xt, stride_xj, table.stride(0),
                            stride_wn, stride_wk, K_IN=k_in, ROWS=rows, PICKS=max(2, triton.next_power_of_2(top_k)), BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                            PRECISION="ieee" if table.dtype == torch.float32 else "tf32", COUNT=count_into is not None, num_warps=NUM_WARPS,
                            num_stages=stages)
    return out


def operand_layout(kernel: str, x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, transposed: bool, per_pick: bool):
    """What a kernel multiplying picks' vectors by their experts' rows reads: (``x``, unit
    stride along a vector; the table's outputs N and reduction K; its strides along them; the
    strides of the vector of pick (t, j) along t and j: one vector a token, or a pick where
    ``per_pick``). A ValueError naming ``kernel`` where ``x`` does not fit ``ids`` and ``table``."""
    tokens, top_k = ids.shape
    n_out, k_in = (table.shape[2], table.shape[1]) if transposed else (table.shape[1], table.shape[2])
    table_strides = (table.stride(2), table.stride(1)) if transposed else (table.stride(1), table.stride(2))
    vectors = tokens * top_k if per_pick else tokens
    if x.dim() != 2 or x.shape != (vectors, k_in):
        raise ValueError(f"{kernel}: x {tuple(x.shape)} does not fit {tokens} tokens of {top_k} picks of a {tuple(table.shape)} table "
                         f"({'one vector a pick' if per_pick else 'one vector a token'})")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, n_out, k_in, table_strides, ((top_k * x.stride(0), x.stride(0)) if per_pick else (x.stride(0), 0))


def _tiles(rows: int, element_size: int, device: torch.device) -> tuple[int, int]:
    """The stretch of the reduction a program loads at a time and its loads in flight, for
    ``rows`` vectors of ``element_size`` bytes: ``BLOCK_K`` and ``NUM_STAGES`` where the
    device's shared memory holds them (each stage holds a stretch of the vectors and of the
    block), else shorter stretches, then fewer in flight."""
    shared = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0) if device.type == "cuda" else 0
    room = (shared or 96 * 1024) * 3 // 4  # some left for the compiler's own use
    block_k = BLOCK_K
    while block_k > 32 and 2 * (rows + BLOCK_N) * block_k * element_size > room:
        block_k //= 2
    return block_k, max(1, min(NUM_STAGES, room // ((rows + BLOCK_N) * block_k * element_size)))
