"""Facts about FX nodes that the weight pass and the schedule builder share."""

from __future__ import annotations

import torch
import torch.fx

from hostswap.schedules.custom_ops import PROBE_OPERATOR, ROUTED_EXPERTS_OPERATOR, ROUTED_EXPERTS_TABLES
from hostswap.schedules.op_facts import is_view_copy


def underlying_op(target) -> torch._ops.OpOverload | None:
    """The ATen/custom OpOverload behind an FX target (edge ops wrap one in ``_op``)."""
    if isinstance(target, torch._ops.OpOverload):
        return target
    op = getattr(target, "_op", None)  # EdgeOpOverload
    return op if isinstance(op, torch._ops.OpOverload) else None


def is_probe(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    op = underlying_op(node.target)
    return op is not None and op._schema.name == PROBE_OPERATOR


# Ops that read a tensor's metadata (sizes, strides, dtype), never its data.
METADATA_OPS = frozenset({"aten::sym_size", "aten::sym_numel", "aten::sym_stride", "aten::sym_storage_offset"})


def reads_no_data(node: torch.fx.Node) -> bool:
    """Ops that need no weight bytes: checks (they return nothing and write nothing, such as
    ``_assert_tensor_metadata`` and ``_assert_scalar``; lowering deletes them) and metadata
    queries. They get no probe: a probe in front of one would be deleted with it."""
    if node.op != "call_function":
        return False
    op = underlying_op(node.target)
    if op is None:
        return False
    schema = op._schema
    if schema.name in METADATA_OPS:
        return True
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return not schema.returns and not writes


def returns_alias(op: torch._ops.OpOverload) -> bool:
    """The op's (first) result aliases an input without writing it: a view."""
    returns = op._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def is_aliasing_view(node: torch.fx.Node) -> bool:
    """An op whose result aliases its input (not ``is_view_like``, which also counts ``*_copy``
    ops: for saved activations a copy is a tensor of its own)."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and returns_alias(node.target)


def is_view_like(node: torch.fx.Node) -> bool:
    """Ops that only reinterpret their first input's data: aliasing views and ``*_copy`` views.

    A weight read through such a chain is still the same weight; the probe goes in front of
    the chain and the chain moves behind it.
    """
    if node.op != "call_function":
        return False
    op = underlying_op(node.target)
    if op is None:
        return False
    returns = op._schema.returns
    if len(returns) != 1 or str(returns[0].type) != "Tensor":
        return False
    if is_view_copy(op) or returns_alias(op):
        return True
    return op._schema.name == "aten::_unsafe_view"


def first_tensor_input(node: torch.fx.Node) -> torch.fx.Node | None:
    arg = node.args[0] if node.args else None
    return arg if isinstance(arg, torch.fx.Node) else None


def view_chain_root(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node a chain of view-like ops starts from (``node`` itself if it is no view);
    None if the chain loses its tensor input."""
    while node is not None and is_view_like(node):
        node = first_tensor_input(node)
    return node


def views_and_readers(node: torch.fx.Node) -> tuple[list[torch.fx.Node], set[torch.fx.Node]]:
    """The view-like nodes that chains of views from ``node`` pass through, and the other
    nodes that read ``node`` at the end of those chains (directly or through views)."""
    views, readers = [], set()
    frontier = list(node.users)
    while frontier:
        user = frontier.pop()
        if is_view_like(user):
            views.append(user)
            frontier.extend(user.users)
        else:
            readers.add(user)
    return views, readers



# Row gathers: ops that read only the rows of a table that their indices name, by the
# schema names of their table arguments. A kernel on the device can read those few rows
# straight out of host memory, so such a table need not be copied to the device at all.
# An MoE block's experts are rows of its stacked tables (passes/routed_experts.py).
ROW_GATHER_TABLE_ARGUMENTS = {"aten::embedding": ("weight",), ROUTED_EXPERTS_OPERATOR: ROUTED_EXPERTS_TABLES}


def reads_rows_of(node: torch.fx.Node, table: torch.fx.Node) -> bool:
    """``node`` is a row gather whose table argument is ``table`` itself (no view between),
    and ``table`` is no other argument of it."""
    if node.op != "call_function":
        return False
    op = underlying_op(node.target)
    names = ROW_GATHER_TABLE_ARGUMENTS.get(op._schema.name, ()) if op is not None else ()
    bound = dict(zip((a.name for a in op._schema.arguments), node.args)) | dict(node.kwargs) if names else {}
    return any(bound.get(name) is table for name in names) and sum(v is table for v in bound.values()) == 1


def gathered_only(placeholder: torch.fx.Node) -> bool:
    """``placeholder`` has readers, and each gathers rows of it."""
    users = list(placeholder.users)
    return bool(users) and all(reads_rows_of(u, placeholder) for u in users)


def writes_in_place(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls an op that writes a tensor argument in place."""
    op = underlying_op(node.target) if node.op == "call_function" else None
    return op is not None and op._schema.is_mutable


def written_between(matched: list[torch.fx.Node], last: torch.fx.Node) -> bool:
    """Whether an in-place write runs among the ``matched`` nodes before ``last``: a fused op
    that replaces them reads its inputs once, at ``last``, where they read them along the way."""
    pending, node = set(matched) - {last}, last.prev
    while pending and node.op != "root":
        if node in pending:
            pending.discard(node)
        elif writes_in_place(node):
            return True
        node = node.prev
    return False
