"""Run rotary position embedding as one ``hostswap::rotary`` per tensor instead of five ATen ops.

transformers' ``apply_rotary_pos_emb`` computes ``x * cos + rotate_half(x) * sin`` for the
queries and for the keys, ``rotate_half`` being two slices of the last dimension, a negation
and a concatenation. Exported, that is five launches a tensor, ten a decoder layer, each a
microsecond or two in a graphed decode step. The pass finds that expression (every value in
it read by nothing else, all three tensors of one dtype) and calls the op instead: on CUDA one
Triton kernel (kernels/rotary.py) that rounds where the ATen ops round, elsewhere those ops;
both bit for bit. Like ``hostswap::sdpa``, a custom op survives lowering whole, and its
``.out`` overload is what ExecuTorch's out-variant pass needs.
"""

from __future__ import annotations

import torch
from torch.library import Library

from hostswap.kernels.rotary import DTYPES, rotary_into
from hostswap.passes.graph_facts import written_between
from hostswap.passes.graph_rewrites import call_in_place_of
from hostswap.passes.probe_op import NAMESPACE

ROTARY_SCHEMA = "rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor"
ROTARY_OUT_SCHEMA = "rotary.out(Tensor x, Tensor cos, Tensor sin, *, Tensor(a!) out) -> Tensor(a!)"

_lib = Library(NAMESPACE, "FRAGMENT")
_lib.define(ROTARY_SCHEMA)
_lib.define(ROTARY_OUT_SCHEMA)


def _check(x, cos, sin):
    try:
        fits = x.dim() >= 1 and torch.broadcast_shapes(x.shape, cos.shape, sin.shape) == x.shape and x.shape[-1] % 2 == 0
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"hostswap::rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must broadcast to x {tuple(x.shape)}, "
                         "whose last dimension must be even")


def _rotary(x, cos, sin):
    _check(x, cos, sin)
    return rotary_into(x, cos, sin, torch.empty(x.shape, dtype=x.dtype, device=x.device))


def _rotary_out(x, cos, sin, *, out):
    if out.dtype != x.dtype or out.shape != x.shape or out.device != x.device:
        raise ValueError(f"hostswap::rotary.out: out is {tuple(out.shape)} {out.dtype} on {out.device}, "
                         f"the result is {tuple(x.shape)} {x.dtype} on {x.device}")
    _check(x, cos, sin)
    # (out must not overlap x: a row's program reads each value's partner after others may have been stored)
    return rotary_into(x, cos, sin, out)


def _rotary_fake(x, cos, sin):
    return x.new_empty(x.shape)


def _rotary_out_fake(x, cos, sin, *, out):
    return out


_lib.impl("rotary", _rotary, "CompositeExplicitAutograd")
_lib.impl("rotary.out", _rotary_out, "CompositeExplicitAutograd")
_lib._register_fake("rotary", _rotary_fake)
_lib._register_fake("rotary.out", _rotary_out_fake)

rotary = torch.ops.hostswap.rotary.default

aten = torch.ops.aten
END = 2**63 - 1  # a slice to the end, as export writes it


def _val(node):
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _single(node) -> bool:
    return len(node.users) == 1


def _other(node: torch.fx.Node, one):
    """The operand of binary ``node`` that is not ``one`` (None if neither or both are)."""
    a, b = node.args[:2]
    return b if a is one and b is not one else a if b is one and a is not one else None


def _slice_of(node, x, dims: int):
    """(start, end) of ``node`` where it is ``x[..., start:end]`` over the last dimension, step 1,
    read once (an end to the end is ``END``); else None."""
    if not _is(node, aten.slice.Tensor) or node.args[0] is not x or not _single(node) or node.kwargs:
        return None
    dim, start, end, step = (list(node.args[1:]) + [None] * 4)[:4]
    if (0 if dim is None else dim) not in (-1, dims - 1) or (1 if step is None else step) != 1:
        return None
    return (start or 0, END if end is None else end)


def match(add: torch.fx.Node) -> dict | None:
    """The rotary expression summed by an ``aten.add`` node, as plain data, or None where it is
    not one: ``x``, ``cos``, ``sin``, ``last`` (the sum, which becomes the op's call) and
    ``dead`` (the other nodes it makes unused, users first)."""
    if not _is(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    for straight, turned in (add.args, add.args[::-1]):
        if not (_is(straight, aten.mul.Tensor) and _is(turned, aten.mul.Tensor) and _single(straight) and _single(turned)):
            continue
        for cat in turned.args[:2]:
            if not _is(cat, aten.cat.default) or not _single(cat):
                continue
            sin = _other(turned, cat)
            parts = cat.args[0]
            if sin is None or not isinstance(parts, (list, tuple)) or len(parts) != 2:
                continue
            negated, first = parts
            if not _is(negated, aten.neg.default) or not _single(negated):
                continue
            second = negated.args[0]
            x = second.args[0] if _is(second, aten.slice.Tensor) else None
            cos = _other(straight, x) if x is not None else None
            values = [_val(n) for n in (x, cos, sin, add)]
            if cos is None or any(v is None for v in values):
                continue
            xv, cv, sv, out = values
            d = xv.shape[-1]
            cat_dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
            half = d // 2
            if (d % 2 or cat_dim not in (-1, xv.dim() - 1) or first is second or _slice_of(first, x, xv.dim()) != (0, half)
                    or _slice_of(second, x, xv.dim()) not in ((half, END), (half, d))):
                continue
            if not (xv.dtype in DTYPES and cv.dtype == sv.dtype == out.dtype == xv.dtype and out.shape == xv.shape and 1 <= xv.dim() <= 4):
                continue
            try:
                if torch.broadcast_shapes(xv.shape, cv.shape, sv.shape) != xv.shape:
                    continue
            except RuntimeError:
                continue
            dead = [straight, turned, cat, negated, first, second]
            if written_between(dead + [add], add):
                continue
            return {"x": x, "cos": cos, "sin": sin, "last": add, "dead": dead}
    return None


class FuseRotaryPass:
    """Replace each rotary embedding written as ATen ops with ``hostswap::rotary``."""

    def call(self, graph_module: torch.fx.GraphModule) -> int:
        """Rewrites the graph in place; returns the number of tensors rotated by the op."""
        graph, replaced = graph_module.graph, 0
        # each match sees the rewrites before it
        for node in [n for n in graph.nodes if _is(n, aten.add.Tensor)]:
            if node._erased or (m := match(node)) is None:
                continue
            # the sum becomes the call (its layout a transposed query's before: now contiguous)
            call_in_place_of(m["last"], rotary, (m["x"], m["cos"], m["sin"]), m["dead"])
            replaced += 1
        if replaced:
            graph_module.recompile()
        return replaced
