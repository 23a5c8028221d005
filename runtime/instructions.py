"""What a loaded method is made of: its instructions, its operators and its value references.

ExecuTorch's PyPI wheel has no CUDA backend, so hostswap runs a program's instruction list
itself with PyTorch's ATen kernels. Each instruction of the program becomes one typed tuple
here, and each operator name is resolved once to the callable that runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from hostswap.schedules.custom_ops import OUT_OVERLOAD, out_variant_schema, run_into_outs


def copy_into(self: torch.Tensor, *, out: torch.Tensor, non_blocking: bool = False, memory_format=None) -> torch.Tensor:
    """``_to_copy.out`` / ``clone.out`` as one kernel: ATen's out variants allocate a temporary,
    convert into it and copy that into ``out`` (three launches); ``copy_`` converts straight
    into ``out``'s planned layout with the same conversion kernel."""
    return out.copy_(self, non_blocking)


copy_into.accepted = frozenset({"out", "non_blocking", "memory_format"})

# ExecuTorch's dim-order ops (emitted for casts and clones) and the kernels that run them.
DIM_ORDER_OUT_OPS = {
    "dim_order_ops::_to_dim_order_copy": copy_into,
    "dim_order_ops::_clone_dim_order": copy_into,
    "dim_order_ops::_empty_dim_order": torch.ops.aten.empty.out,
}


class ElementwiseOut:
    """An ATen out variant run without copying the whole storage of ``self``.

    ATen's functional ``copy`` and ``*_scatter`` start from ``clone_preserve_strides(self)``,
    which copies every byte of ``self``'s storage, not only its elements. The executor views
    each planned tensor into one arena per memory id, so that storage is the whole arena: each
    layer's ``copy.out`` of a 0-d cache counter in a static-cache decode copied the whole
    KV-cache arena (a 46-layer Llama's decode step copied 60 MB 46 times, 2.5 ms a token on
    an H100). These write ``out`` from ``self``'s elements alone; the result is the same.
    ``_schema`` is the ATen op's, so arguments bind as for it.
    """

    def __init__(self, aten_op: torch._ops.OpOverload, write_into_out: Callable):
        self._schema = aten_op._schema
        self._write_into_out = write_into_out

    def __call__(self, *args, out: torch.Tensor, **kwargs) -> torch.Tensor:
        self._write_into_out(out, *args, **kwargs)
        return out


def _copy_into_out(out, self, src, non_blocking=False):
    out.copy_(src, non_blocking)  # src broadcast over self's shape, in self's dtype: all of self is overwritten


def _scatter_into_out(view):
    def write(out, self, src, *view_args):
        if not (out.data_ptr() == self.data_ptr() and out.stride() == self.stride()):
            out.copy_(self)
        view(out, *view_args).copy_(src)

    return write


# Keyed by (operator name, overload) as the program names them.
ELEMENTWISE_OUT_OPS = {
    ("aten::copy", "out"): ElementwiseOut(torch.ops.aten.copy.out, _copy_into_out),
    ("aten::slice_scatter", "out"): ElementwiseOut(torch.ops.aten.slice_scatter.out, _scatter_into_out(torch.ops.aten.slice.Tensor)),
    ("aten::select_scatter", "out"): ElementwiseOut(torch.ops.aten.select_scatter.out, _scatter_into_out(torch.ops.aten.select.int)),
    ("aten::diagonal_scatter", "out"): ElementwiseOut(torch.ops.aten.diagonal_scatter.out, _scatter_into_out(torch.ops.aten.diagonal.default)),
}


class ProgramError(ValueError):
    """A program the executor cannot run; the message names the instruction or value."""


def register_executorch_ops() -> None:
    # dim_order_ops::_clone_dim_order / _to_dim_order_copy are emitted for clones and casts.
    import executorch.exir.passes.dim_order_ops_registry  # noqa: F401


# ExecuTorch's emitter turns a view of a tensor it does not plan (here: a weight bound to the
# pool) into ``executorch_prim::et_view(self, size, out)``; it has no PyTorch op. It runs as
# a reshape, a view wherever the source's strides allow one.
ET_VIEW_OPERATOR = "executorch_prim::et_view"


class FunctionalAsOut:
    """The ``out`` overload hostswap gave a functional custom op at lowering, run in a process
    where it is not registered: the functional op, its results copied into ``out``."""

    def __init__(self, functional: torch._ops.OpOverload):
        self.functional = functional
        self._schema = torch._C.parse_schema(functional._schema.name.split("::")[0] + "::" + out_variant_schema(functional._schema))

    def __call__(self, *args, **kwargs):
        return run_into_outs(self.functional, args, kwargs)


def resolve_operator(name: str, overload: str):
    if name == ET_VIEW_OPERATOR:
        return torch.ops.aten.reshape.default
    if (name, overload) in ELEMENTWISE_OUT_OPS:
        return ELEMENTWISE_OUT_OPS[(name, overload)]
    namespace, _, op_name = name.partition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError) as e:
        raise ProgramError(
            f"operator {name} has no PyTorch kernel in this process ({e}); import the library that defines it before loading"
        ) from None
    try:
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError) as e:
        functional = getattr(packet, "default", None) if overload == OUT_OVERLOAD else None
        if functional is not None and namespace != "aten":
            return FunctionalAsOut(functional)
        raise ProgramError(f"operator {name}.{overload or 'default'} has no PyTorch kernel: {e}") from None


class Kernel(NamedTuple):
    """An operator call. ``view_op`` set: the call binds its result to a view of its first
    argument instead of writing an out tensor."""

    tag: str  # "kernel"
    op: Callable
    positional: list[int]  # value ids
    keyword: dict[str, int]  # argument name -> value id
    ret_ids: list[int]
    view_op: Callable | None
    index: int  # instruction index in the program
    scratch: dict[str, torch.dtype]  # zero-element out arguments given a fresh tensor per call
    constant_keyword: dict[str, object]  # arguments fixed at load


class Probe(NamedTuple):
    """Bind ``ret_id`` to the pool's device tensor of weight ``fqn``."""

    tag: str  # "probe"
    probe_id: int
    fqn: str
    ret_id: int


class Move(NamedTuple):
    tag: str  # "move"
    source: int
    target: int


class JumpFalse(NamedTuple):
    tag: str  # "jump_false"
    condition: int
    destination: int


class Free(NamedTuple):
    tag: str  # "free"
    value: int


Instruction = Kernel | Probe | Move | JumpFalse | Free


@dataclasses.dataclass
class ListRef:
    """A list value: the ids of the values it holds (-1: None, when ``optional``)."""

    indices: list[int]
    optional: bool = False




def value_of(values: list, value_id: int):
    """Value ``value_id`` of a values table, a list value resolved to its items."""
    v = values[value_id]
    if isinstance(v, ListRef):
        return [values[j] for j in v.indices] if not v.optional else [None if j < 0 else values[j] for j in v.indices]
    return v
