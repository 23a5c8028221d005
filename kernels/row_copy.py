"""Copy chosen rows of a table into chosen rows of another, skipping the rows a mask clears:
one Triton kernel that reads only what it copies.

An MoE expert cache (runtime/expert_cache.py) brings a decode step's missed experts from the
stacked tables in mapped host memory into its device slots. Which experts missed is known
only on the device, and a CUDA graph replays fixed launches, so the copy is launched for
every pick and each program reads its pick's flag first: a hit reads no host byte. Rows move
as 16-byte words where the row's bytes allow (wider loads keep more of the bus busy), else
as the widest word that divides them.

Without Triton (a CPU, a build without it) the same copy is ``index_copy_`` of every pick,
which on the CPU reads a hit's row again and writes the bytes the slot already holds.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

# elements a program moves per loop step, and the words it moves them as (widest first)
BLOCK = 4096
WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def masked_row_copy(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, copy_ptr, row_words, chunk_words, BLOCK: tl.constexpr):
        pick = tl.program_id(0)
        if tl.load(copy_ptr + pick) != 0:
            src = tl.load(src_rows_ptr + pick).to(tl.int64) * row_words
            dst = tl.load(dst_rows_ptr + pick).to(tl.int64) * row_words
            start = tl.program_id(1).to(tl.int64) * chunk_words
            end = tl.minimum(start + chunk_words, row_words)
            for offset in range(start, end, BLOCK):
                at = offset + tl.arange(0, BLOCK)
                ok = at < end
                tl.store(dst_ptr + dst + at, tl.load(src_ptr + src + at, mask=ok), mask=ok)

    return masked_row_copy


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _words(table: torch.Tensor) -> torch.Tensor:
    """``table`` as [rows, words] of the widest integer word its row bytes divide into."""
    row_bytes = table[0].numel() * table.element_size()
    flat = table.reshape(table.shape[0], -1)
    for word in WORDS:
        if row_bytes % word.itemsize == 0 and flat.data_ptr() % word.itemsize == 0:
            return flat.view(torch.uint8).view(word) if flat.dtype != word else flat
    raise AssertionError("a byte divides every row")


def masked_row_copy(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor, copy: torch.Tensor) -> None:
    """``dst[dst_rows[j]] = src[src_rows[j]]`` for each pick ``j`` whose ``copy[j]`` is set.
    ``src`` and ``dst`` are contiguous tables of the same row shape and dtype; the row lists
    and ``copy`` are 1-D device tensors of one length (a row of -1 only where ``copy`` is 0,
    and then in every pick of the call). No host sync."""
    if src.is_cuda and triton_available():
        s, d = _words(src), _words(dst)
        if s.dtype != d.dtype:  # alignment can differ between the two; take the narrower word
            word = min(s.dtype, d.dtype, key=lambda w: w.itemsize)
            s, d = s.view(torch.uint8).view(word), d.view(torch.uint8).view(word)
        row_words = s.shape[1]
        # enough programs per row to keep the SMs busy on a few large rows
        chunks = max(1, min(256, row_words // (BLOCK * 4)))
        chunk_words = -(-row_words // chunks)
        chunk_words = -(-chunk_words // BLOCK) * BLOCK
        chunks = -(-row_words // chunk_words)
        with torch.cuda.device(dst.device):
            _kernel()[(src_rows.numel(), chunks)](s, d, src_rows, dst_rows, copy, row_words, chunk_words, BLOCK=BLOCK, num_warps=4)
        return
    # a row of -1 (a pick whose call changed nothing) is never copied; row 0 stands in for it
    src_rows, dst_rows = src_rows.clamp(min=0), dst_rows.clamp(min=0)
    rows = src.index_select(0, src_rows.to(src.device))
    keep = dst.index_select(0, dst_rows)
    mask = copy.to(torch.bool).reshape(-1, *([1] * (dst.dim() - 1)))
    dst.index_copy_(0, dst_rows, torch.where(mask, rows.to(dst.device), keep))
