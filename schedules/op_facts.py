"""Facts about operators that the passes, the schedules and the runtime share."""

from __future__ import annotations

import torch


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
