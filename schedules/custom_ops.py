"""Operators that the passes put into a program and the runtime recognises in it: the probe,
the routed experts,
and the out overload that stands in for a functional custom op (what the pass defines so that
ExecuTorch can lower the op, and what the runtime runs when its process lacks the overload)."""

from __future__ import annotations

import torch

PROBE_OPERATOR = "hostswap::probe"  # every weight use is read through it
# an MoE block's experts, reading the rows of its stacked tables that the router picks
ROUTED_EXPERTS_OPERATOR = "hostswap::routed_experts"
ROUTED_EXPERTS_TABLES = ("gate_up", "down", "gate_up_bias", "down_bias")
SDPA_OPERATOR = "hostswap::sdpa"  # scaled dot-product attention kept whole (passes/fused_attention.py)
OUT_OVERLOAD = "out"


def out_names(schema: torch.FunctionSchema) -> list[str]:
    return ["out"] if len(schema.returns) == 1 else [f"out{i}" for i in range(len(schema.returns))]


def out_variant_schema(schema: torch.FunctionSchema) -> str:
    """``name.out(<the functional arguments>, *, Tensor(a!) out, ...) -> Tensor(a!), ...``
    (without the namespace) for a functional op returning tensors."""
    names = out_names(schema)
    aliases = [chr(ord("a") + i) for i in range(len(names))]
    text = str(schema)  # "ns::name(<arguments>) -> <returns>"
    declared = text[text.index("(") + 1 : text.rindex(") -> ")]
    arguments = [declared] if declared else []
    if not any(a.kwarg_only for a in schema.arguments):
        arguments.append("*")
    arguments += [f"Tensor({alias}!) {name}" for alias, name in zip(aliases, names)]
    returns = ", ".join(f"Tensor({alias}!)" for alias in aliases)
    if len(names) > 1:
        returns = f"({returns})"
    return f"{schema.name.split('::')[1]}.{OUT_OVERLOAD}({', '.join(arguments)}) -> {returns}"


def run_into_outs(functional: torch._ops.OpOverload, args, kwargs):
    """Run ``functional`` and copy its results into the ``out`` tensors of ``kwargs``."""
    names = out_names(functional._schema)
    outs = [kwargs.pop(n) for n in names]
    results = functional(*args, **kwargs)
    results = [results] if len(names) == 1 else list(results)
    for out, result in zip(outs, results):
        if out.shape != result.shape:
            out.resize_(result.shape)
        out.copy_(result)
    return outs[0] if len(names) == 1 else tuple(outs)
