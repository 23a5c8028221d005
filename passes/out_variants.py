"""Give custom ops without an out variant one, so that ExecuTorch can lower programs using them.

ExecuTorch runs every kernel in its out form. A custom op (a model library's MoE experts,
a user's op) often has only its functional overload, and lowering then fails with "Missing
out variants". For a functional op that returns tensors, an ``out`` overload is defined in
the op's own namespace: it calls the functional op and copies the result into ``out``. The
runtime runs such an instruction the same way whether or not the overload is registered in
its process (``runtime/executor.py``).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.library import Library

from hostswap.passes.graph_facts import underlying_op
from hostswap.schedules.custom_ops import OUT_OVERLOAD, out_names, out_variant_schema, run_into_outs

# Namespaces whose ops ExecuTorch lowers itself (they have out variants or are handled).
BUILTIN_NAMESPACES = frozenset({"aten", "prim", "prims", "hostswap", "dim_order_ops", "executorch_prim", "quantized_decomposed", "torchao"})
_libraries: dict[str, Library] = {}


class OutVariantError(ValueError):
    """A custom op of the program that neither has nor can be given an out variant."""


def _has_out_variant(op: torch._ops.OpOverload) -> bool:
    for schema in torch._C._jit_get_schemas_for_operator(op._schema.name):
        if any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return True
    return False


def _why_not_out_able(op: torch._ops.OpOverload) -> str | None:
    """Why an out overload cannot stand in for ``op``; None if it can."""
    schema = op._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "it writes its inputs in place"
    if not schema.returns:
        return "it returns nothing"
    for r in schema.returns:
        if str(r.type) != "Tensor":
            return f"it returns a {r.type}, and out variants return tensors only"
        if r.alias_info is not None:
            return "it returns a view of an input"
    taken = set(out_names(schema)) & {a.name for a in schema.arguments}
    if taken:
        return f"it has an argument named {sorted(taken)[0]!r}, the name its out variant's result would take"
    if op._overloadname != "default":
        return f"its overload '{op._overloadname}' is not the default one"
    return None


def _define_out_variant(op: torch._ops.OpOverload) -> None:
    namespace, name = op._schema.name.split("::")
    library = _libraries.get(namespace)
    if library is None:
        library = _libraries[namespace] = Library(namespace, "FRAGMENT")
    library.define(out_variant_schema(op._schema))
    names = out_names(op._schema)

    def run(*args, **kwargs):
        return run_into_outs(op, args, kwargs)

    def fake(*args, **kwargs):
        outs = [kwargs[n] for n in names]
        return outs[0] if len(outs) == 1 else tuple(outs)

    library.impl(f"{name}.{OUT_OVERLOAD}", run, "CompositeExplicitAutograd")
    library._register_fake(f"{name}.{OUT_OVERLOAD}", fake)


def _module_of(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path = list(stack.values())[-1][0]
    return path or "<top level>"


class CustomOpOutVariantPass:
    """Define an ``out`` overload for every functional custom op of the graph that lacks one."""

    def call(self, graph_module: torch.fx.GraphModule) -> list[str]:
        """Returns the ops given an out variant; raises OutVariantError naming the op and
        the module that uses it where none can be given."""
        defined = []
        for node in graph_module.graph.nodes:
            if node.op != "call_function":
                continue
            op = underlying_op(node.target)
            if op is None or op.namespace in BUILTIN_NAMESPACES or _has_out_variant(op):
                continue
            why = _why_not_out_able(op)
            if why is not None:
                raise OutVariantError(
                    f"custom op {op._schema.name}.{op._overloadname}, used by module '{_module_of(node)}', has no out "
                    f"variant and hostswap cannot make one: {why}. Register an out variant for it "
                    "(an overload with a keyword-only 'Tensor(a!) out') or export the module without it"
                )
            _define_out_variant(op)
            defined.append(op._schema.name)
        return defined
