"""Facts about operators that the passes, the schedules and the runtime share."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend


def is_view_copy(op) -> bool:
    """A ``*_copy`` op (any overload, out variants included): the copy of what a view returns."""
    return torch.Tag.view_copy in getattr(op, "tags", ())


def view_for_copy(op) -> torch._ops.OpOverload | None:
    """The aliasing ATen view whose result the ``*_copy`` op ``op`` copies (``view_copy.out`` ->
    ``view.default``, ``transpose_copy.int_out`` -> ``transpose.int``); None for other ops."""
    if not is_view_copy(op):
        return None
    base = op._schema.name.split("::")[1].removesuffix("_copy")
    overload = op._overloadname
    functional = "default" if overload == "out" else overload.removesuffix("_out")
    return getattr(getattr(torch.ops.aten, base, None), functional, None)


# SDPA's kernels that take grouped KV heads as they lie (its math reference repeats them itself)
FUSED_BACKENDS = frozenset(int(b) for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION))


def may_read_grouped(device_type: str, dtype: torch.dtype) -> bool:
    """Whether grouped KV heads can be read in place at all: on CUDA in 16 bits (``reads_grouped``
    then asks SDPA's choice)."""
    return device_type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def reads_grouped(device_type: str, dtype: torch.dtype, choice: int) -> bool:
    """Whether grouped KV heads are read in place: on CUDA in 16 bits, where SDPA's choice for
    the grouped call (``choice``, an ``SDPBackend`` value) is a fused kernel. Elsewhere the
    heads are repeated first, as transformers' ``repeat_kv`` does: bitwise what its graph
    computes, and, where SDPA would pick its math reference (a GPU or build whose fused
    kernels refuse grouped heads with a mask), no float32 score matrix beside the repeat."""
    return may_read_grouped(device_type, dtype) and choice in FUSED_BACKENDS


def grouped_in_place(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None) -> bool:
    """``reads_grouped`` for this call (on an H200, cuDNN's kernel, the one repeated heads get,
    and decode over a 4096-position cache 8x faster than over its heads repeated;
    passes/grouped_query_attention.py). The load counts the repeat where it is not
    (runtime/budget.grouped_attention_scratch_on)."""
    if not may_read_grouped(query.device.type, query.dtype):
        return False  # without asking SDPA
    choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=True)
    return reads_grouped(query.device.type, query.dtype, choice)
