"""An eager call of several tokens (a prefill chunk) multiplies each expert its tokens picked
once, over all the tokens that picked it: one Triton program per (expert, block of outputs),
its tokens found from the picks sorted by expert on the device.

A chunk of a hundred tokens of top-8 of 128 picks nearly every expert, and an expert's tokens
are a handful. Learning the union on the host and multiplying expert by expert costs a host
sync and a few small launches per expert; reading the tables in place, each small product
alone cannot keep the bus busy. Here one launch per projection reads every picked expert's
rows at once, where they lie (mapped host memory, or the device), and none of the others:

- ``segments`` sorts the call's picks by expert (device ops, no host sync): each expert's
  picks are one stretch of ``order``, ``counts[e]`` long from ``starts[e]``;
- the programs of expert ``e`` multiply its block by ``ROWS`` of its picks' vectors at a time,
  so an expert with more picks than ``ROWS`` reads its block once per ``ROWS`` picks (and is
  counted so); ``ROWS`` covers a whole chunk of up to ``MAX_ROWS`` tokens;
- where the block has an expert cache, an expert it holds is read from its slot on the device
  (``slot_of``), not over the bus, and counted as a hit besides.

The products are those of kernels/routed_union.py (a matrix product of the picking vectors by
the block, float32 accumulation, rounded once to the table's dtype): a pick's sums do not
depend on the other tokens. Picks of -1 (rows nobody reads) pick nothing; their outputs are 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from hostswap.kernels.routed_union import BLOCK_N, MIN_ROWS, NUM_WARPS, _tiles, operand_layout

# the most picks of one expert a program multiplies at once: a chunk of this many tokens or
# fewer reads each expert it picks once, whatever its routing (its float32 sums, this many by
# BLOCK_N, take a program's registers)
MAX_ROWS = 256

tl = None  # triton.language, bound by the first _kernel(): this module imports without Triton


@dataclasses.dataclass(frozen=True)
class Segments:
    """A call's picks sorted by expert: ``order`` (flat pick indices ``t * k + j``, expert by
    expert, picks of -1 last), and each expert's ``starts`` and ``counts`` in it; all on the
    device."""

    order: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    top_k: int


def segments(ids: torch.Tensor, num_experts: int) -> Segments:
    """``ids`` ([tokens, k], -1 for no pick) sorted by expert, with device ops only."""
    if ids.dim() != 2:
        raise ValueError(f"routed_grouped: ids {tuple(ids.shape)} are not [tokens, k]")
    flat = ids.reshape(-1)
    key = torch.where(flat < 0, num_experts, flat)  # no pick: past the last expert
    order = torch.sort(key, stable=True).indices
    # a scatter, not bincount: bincount learns its size on the host
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))[:num_experts]
    return Segments(order, torch.cumsum(counts, 0) - counts, counts, ids.shape[1])


@functools.lru_cache(maxsize=None)
def _kernel():
    # a module global, not a local: Triton's interpreter swaps the globals a kernel reads
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def routed_grouped(x_ptr, w_ptr, cached_ptr, slot_ptr, order_ptr, starts_ptr, counts_ptr, out_ptr, count_ptr, hits_ptr, top_k, n_out,
                       stride_xt, stride_xj, stride_we, stride_ce, stride_wn, stride_wk, K_IN: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, COUNT: tl.constexpr, CACHED: tl.constexpr):
        expert = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        picks = tl.load(counts_ptr + expert)
        if picks > 0:  # no token picked it: nothing is read
            start = tl.load(starts_ptr + expert)
            w_block = w_ptr + expert.to(tl.int64) * stride_we
            held = False
            if CACHED:
                slot = tl.load(slot_ptr + expert)
                held = slot >= 0
                if held:  # held by the block's cache: read from its slot, on the device
                    w_block = cached_ptr + slot.to(tl.int64) * stride_ce
            if COUNT:
                if tl.program_id(1) == 0:  # one program of each expert counts its reads: one per ROWS picks
                    reads = (picks + ROWS - 1) // ROWS
                    tl.atomic_add(count_ptr, reads)
                    if held:
                        tl.atomic_add(hits_ptr, reads)
            w_cols = w_block + n[None, :].to(tl.int64) * stride_wn
            r = tl.arange(0, ROWS)
            for first in range(0, picks, ROWS):
                valid = first + r < picks
                pick = tl.load(order_ptr + start + first + r, mask=valid, other=0)
                x_rows = x_ptr + (pick // top_k) * stride_xt + (pick % top_k) * stride_xj
                acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
                for at in range(0, K_IN, BLOCK_K):
                    k = at + tl.arange(0, BLOCK_K)
                    x = tl.load(x_rows[:, None] + k[None, :], mask=valid[:, None] & (k[None, :] < K_IN), other=0.0)
                    w = tl.load(w_cols + k[:, None].to(tl.int64) * stride_wk, mask=(k[:, None] < K_IN) & (n[None, :] < n_out), other=0.0)
                    acc = tl.dot(x, w, acc, input_precision=PRECISION)
                at_out = out_ptr + pick[:, None] * n_out + n[None, :]
                tl.store(at_out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (n[None, :] < n_out))

    return routed_grouped


def rows_for(tokens: int) -> int:
    """The picks a program multiplies at once for a call of ``tokens`` tokens: enough for every
    token (a token picks an expert once), at least ``MIN_ROWS``, at most ``MAX_ROWS``."""
    import triton

    return max(MIN_ROWS, min(MAX_ROWS, triton.next_power_of_2(tokens)))


def routed_grouped(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, segs: Segments, transposed: bool, per_pick: bool,
                   count_into: torch.Tensor | None = None, cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``out[t * k + j] = table[ids[t, j]] @ x[t]`` ([experts, N, K] table), or
    ``x[t] @ table[ids[t, j]]`` where ``transposed`` ([experts, K, N]); with ``per_pick``, the
    vector of pick (t, j) is ``x[t * k + j]``. ``segs`` is ``segments(ids, experts)``; a pick of
    -1 gives 0. Each expert any pick names is read once per ``rows_for(tokens)`` of its picks
    (a token that names an expert twice is two of its picks, each given the product); the
    others are not read. ``count_into`` (a 0-d int64 device tensor) has those reads added
    to it. ``cached`` = (slot_of, slots, hits): an expert cache's slot per expert (-1: not
    held), its slots' table (laid out as ``table``'s rows) and a 0-d counter; a held expert is
    read from its slot, and its reads are added to ``hits`` as well (where ``count_into`` is given). Returns [tokens * k, N]
    in the table's dtype. No host sync, no copy of the table."""
    tokens, top_k = ids.shape
    x, n_out, k_in, (stride_wn, stride_wk), (stride_xt, stride_xj) = operand_layout("routed_grouped", x, table, ids, transposed, per_pick)
    if segs.top_k != top_k or segs.counts.numel() != table.shape[0] or segs.order.numel() != ids.numel():
        raise ValueError(f"routed_grouped: the segments are of {segs.order.numel()} picks of {segs.counts.numel()} experts, top-{segs.top_k}; "
                         f"the call has {ids.numel()} picks of a {tuple(table.shape)} table, top-{top_k}")
    slot_of, slots, hits = cached if cached is not None else (segs.counts, table, None)  # (not read without a cache)
    if slots.shape[1:] != table.shape[1:] or slots.stride()[1:] != table.stride()[1:] or slots.dtype != table.dtype:
        raise ValueError(f"routed_grouped: the cache's slots {tuple(slots.shape)} ({slots.dtype}) are not laid out as the table's rows {tuple(table.shape)} ({table.dtype})")
    rows = rows_for(tokens)
    block_k, stages = _tiles(rows, table.element_size(), x.device)
    out = torch.zeros(tokens * top_k, n_out, dtype=table.dtype, device=x.device)
    grid = (table.shape[0], -(-n_out // BLOCK_N))
    count = out if count_into is None else count_into
    if count_into is None or hits is None:
        hits = count  # nothing is counted there: the two counters only need one type
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _kernel()[grid](x, table, slots, slot_of, segs.order, segs.starts, segs.counts, out, count, hits, top_k, n_out, stride_xt, stride_xj,
                        table.stride(0), slots.stride(0), stride_wn, stride_wk, K_IN=k_in, ROWS=rows, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                        PRECISION="ieee" if table.dtype == torch.float32 else "tf32", COUNT=count_into is not None, CACHED=cached is not None,
                        num_warps=NUM_WARPS if rows <= 64 else 2 * NUM_WARPS, num_stages=stages)
    return out
