"""Run an RMSNorm (normalization and weight) as one ``hostswap::rms_norm`` instead of seven to nine ATen ops.

transformers writes RMSNorm out as tensor ops (Llama's: ``h = x.to(float32)``, ``h *
rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)``, ``.to(x.dtype)``, times the weight).
Exported, that is one launch per op, and a decoder layer has two to four such norms (Qwen3
normalizes its queries and keys too): on an H200 a graphed decode step spent about 12 us a
norm in them, where one kernel takes about 1. The pass finds the normalization, the casts
around it where nothing else reads them, and a product by a vector of one value per column
after it (the weight, or Gemma's ``1 + weight``), and calls the op instead.

On the CPU the op runs those same ATen ops, bit for bit. On CUDA it is one Triton kernel
(kernels/rms_norm.py) whose float32 sums run in another order than ATen's mean: a value can
differ by a float32 rounding, which the cast to bfloat16 hides in nearly every row. Like
``hostswap::sdpa``, a custom op survives lowering whole, and its ``.out`` overload is what
ExecuTorch's out-variant pass needs.
"""

from __future__ import annotations

import torch
from torch.library import Library

from hostswap.kernels.rms_norm import result_dtype, rms_norm_into
from hostswap.passes.graph_facts import written_between
from hostswap.passes.graph_rewrites import call_in_place_of
from hostswap.passes.probe_op import NAMESPACE

_ARGS = "Tensor input, float eps, ScalarType dtype, Tensor? weight=None"
RMS_NORM_SCHEMA = f"rms_norm({_ARGS}) -> Tensor"
RMS_NORM_OUT_SCHEMA = f"rms_norm.out({_ARGS}, *, Tensor(a!) out) -> Tensor(a!)"

_lib = Library(NAMESPACE, "FRAGMENT")
_lib.define(RMS_NORM_SCHEMA)
_lib.define(RMS_NORM_OUT_SCHEMA)


def _check_weight(input, weight) -> None:
    if weight is not None and tuple(weight.shape) != (input.shape[-1],):
        raise ValueError(f"hostswap::rms_norm: weight of shape {tuple(weight.shape)} for rows of {input.shape[-1]}; it takes one value per column")


def _rms_norm(input, eps, dtype, weight=None):
    _check_weight(input, weight)
    return rms_norm_into(input, eps, dtype, weight, torch.empty(input.shape, dtype=result_dtype(dtype, weight), device=input.device))


def _rms_norm_out(input, eps, dtype, weight=None, *, out):
    want = result_dtype(dtype, weight)
    if out.dtype != want or out.shape != input.shape:
        raise ValueError(f"hostswap::rms_norm.out: out is {tuple(out.shape)} {out.dtype}, the result is {tuple(input.shape)} {want}")
    _check_weight(input, weight)
    return rms_norm_into(input, eps, dtype, weight, out)


def _rms_norm_fake(input, eps, dtype, weight=None):
    return input.new_empty(input.shape, dtype=result_dtype(dtype, weight))


def _rms_norm_out_fake(input, eps, dtype, weight=None, *, out):
    return out


_lib.impl("rms_norm", _rms_norm, "CompositeExplicitAutograd")
_lib.impl("rms_norm.out", _rms_norm_out, "CompositeExplicitAutograd")
_lib._register_fake("rms_norm", _rms_norm_fake)
_lib._register_fake("rms_norm.out", _rms_norm_out_fake)

rms_norm = torch.ops.hostswap.rms_norm.default

aten = torch.ops.aten
CASTS = frozenset({aten.to.dtype, aten._to_copy.default})
# export's check of a cast's input (dtype, device): it reads a value and makes none
METADATA_CHECKS = frozenset({aten._assert_tensor_metadata.default})
FLOAT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def _dtype(node) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def _cast_to(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype a value-preserving cast node converts to, else None."""
    if node.op != "call_function" or node.target not in CASTS:
        return None
    if node.target is aten.to.dtype:
        extra = {k: v for k, v in node.kwargs.items() if v not in (False, None)}
        dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        return dtype if not extra and len(node.args) <= 2 and dtype in FLOAT_DTYPES else None
    if node.args[1:] or set(node.kwargs) - {"dtype"}:
        return None
    dtype = node.kwargs.get("dtype")
    return dtype if dtype in FLOAT_DTYPES else None


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that use ``node``'s value, metadata checks aside."""
    return [user for user in node.users if not (user.op == "call_function" and user.target in METADATA_CHECKS)]


def _only_user(node: torch.fx.Node):
    readers = _readers(node)
    return readers[0] if len(readers) == 1 else None


def _is(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _last_dim(dims, ndim: int) -> bool:
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, ndim - 1)


def match(rsqrt: torch.fx.Node) -> dict | None:
    """The RMSNorm around an ``aten.rsqrt`` node, as plain data, or None where it is not one:
    ``input`` (the value normalized), ``eps``, ``dtype`` (of the normalized value), ``weight``
    (the vector it is then multiplied by, or None), ``last`` (the node that becomes the op's call)
    and ``dead`` (the other nodes it makes unused, users first)."""
    add = rsqrt.args[0]
    if not (_is(add, aten.add.Tensor) or _is(add, aten.add.Scalar)) or _only_user(add) is not rsqrt or len(add.args) != 2 or add.kwargs:
        return None  # an alpha, given by name or position, scales eps
    mean, eps = add.args[0], add.args[1]
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not _is(mean, aten.mean.dim) or _only_user(mean) is not add:
        return None
    if len(mean.args) < 3 or mean.args[2] is not True or mean.kwargs.get("dtype") is not None:
        return None
    power = mean.args[0]
    if not _is(power, aten.pow.Tensor_Scalar) or _only_user(power) is not mean or power.args[1] != 2:
        return None
    hidden = power.args[0]
    value = hidden.meta.get("val") if isinstance(hidden, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or not _last_dim(mean.args[1], value.dim()):
        return None
    product = _only_user(rsqrt)
    if not _is(product, aten.mul.Tensor) or sorted(map(id, product.args)) != sorted((id(hidden), id(rsqrt))):
        return None
    dead = [product, rsqrt, add, mean, power]
    input = hidden
    # the cast to float32 before it, where nothing else reads the cast
    if _cast_to(hidden) is torch.float32 and set(_readers(hidden)) == {power, product} and _dtype(hidden.args[0]) in FLOAT_DTYPES:
        input = hidden.args[0]
        dead.append(hidden)
    last, dtype = product, torch.float32
    cast = _only_user(product)
    if cast is not None and _cast_to(cast) is not None:
        last, dtype = cast, _cast_to(cast)
        dead.insert(0, cast)
    # the product with a vector of one value per column (the norm's weight) after it
    weight, scaled = None, _only_user(last)
    if _is(scaled, aten.mul.Tensor) and len(scaled.args) == 2 and last in scaled.args and not scaled.kwargs:
        other = scaled.args[1] if scaled.args[0] is last else scaled.args[0]
        vector, result = (other.meta.get("val") if isinstance(other, torch.fx.Node) else None), scaled.meta.get("val")
        if (isinstance(vector, torch.Tensor) and other is not last and vector.dim() == 1 and vector.shape[0] == value.shape[-1]
                and vector.dtype in FLOAT_DTYPES and isinstance(result, torch.Tensor) and result.shape == value.shape
                and result.dtype == torch.promote_types(vector.dtype, dtype)):
            weight, last = other, scaled
            dead.insert(0, scaled)
    if written_between(dead, last):
        return None
    # a metadata check of a value that goes away goes with it
    gone = [node for node in dead if node is not last]
    checks = [user for node in gone for user in node.users if user.op == "call_function" and user.target in METADATA_CHECKS]
    return {"input": input, "eps": float(eps), "dtype": dtype, "weight": weight, "last": last, "dead": checks + gone}


class FuseRmsNormPass:
    """Replace each RMSNorm written as ATen ops with ``hostswap::rms_norm``."""

    def call(self, graph_module: torch.fx.GraphModule) -> int:
        """Rewrites the graph in place; returns the number of norms replaced."""
        graph, replaced = graph_module.graph, 0
        # each match sees the rewrites before it: a norm of a norm reads the first one's call
        for node in [n for n in graph.nodes if _is(n, aten.rsqrt.default)]:
            if node._erased or (m := match(node)) is None:
                continue
            call_in_place_of(m["last"], rms_norm, (m["input"], m["eps"], m["dtype"], m["weight"]), m["dead"])
            replaced += 1
        if replaced:
            graph_module.recompile()
        return replaced
