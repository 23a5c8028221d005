"""Keep each torchao quantized linear whole through export as ``hostswap::quantized_linear``.

A torchao weight-only quantized weight is a tensor subclass over plain inner tensors: packed
data, scales, zero points. ``Int8WeightOnlyConfig()`` gives an ``Int8Tensor`` (int8 data,
scales; runs on the CPU and on CUDA); ``Int4WeightOnlyConfig(group_size=128,
int4_packing_format="tile_packed_to_4d")`` an ``Int4TilePackedTo4dTensor`` (int4 data packed
for PyTorch's own tinygemm kernel ``aten._weight_int4pack_mm``, int32 words, and scales and
zero points in one bf16 tensor; CUDA only, compute capability 8.0 and newer). Other int4
packings of torchao run on kernels of separate packages (mslk, fbgemm_gpu_genai). torch.export
would trace its dequantize-and-matmul into several kernels, each reading one inner tensor,
so one weight would be fetched piece by piece. ``prepare_quantized`` swaps each such linear
for a module whose inner tensors are plain parameters read by one custom op: one kernel
reads the whole unit, so it is one probe group, fetched together and counted together in
the floor and the budget. The op rebuilds the torchao tensor from its inner tensors
(``__tensor_unflatten__``) and calls ``F.linear`` on it: torchao's own kernels run, on the
CPU and on CUDA, and the result is bitwise the quantized model's. One exception: the decode
rows (at most four) of an int8 linear on CUDA run ``kernels/int8_weight_only.py``, which
reads the int8 bytes once where torchao's eager path writes and reads a full-precision copy
of the weight (four times slower than the kernel on an H100); its results agree with
torchao's to the last bit or two of the output dtype.

The op's ``layout`` argument is JSON: the torchao class, the inner tensor names, their
non-tensor attributes and the outer size. A program is untrusted input: only classes of
torchao's own modules are rebuilt. ``describe`` rebuilds each weight from its layout before
it is stored, so a torchao layout that does not come back the same (inner tensors that are
themselves tensor subclasses, attributes JSON cannot hold, a class its module does not
export) is refused at ``prepare_quantized``, naming the layer and the layouts that work.
"""

from __future__ import annotations

import functools
import importlib
import json

import torch
import torch.nn.functional as F
from torch.library import Library

from hostswap.kernels import int8_weight_only
from hostswap.passes.probe_op import NAMESPACE

_ARGS = "Tensor input, Tensor[] weight, Tensor? bias, str layout"
_lib = Library(NAMESPACE, "FRAGMENT")
_lib.define(f"quantized_linear({_ARGS}) -> Tensor")
_lib.define(f"quantized_linear.out({_ARGS}, *, Tensor(a!) out) -> Tensor(a!)")

TORCHAO_PACKAGE = "torchao."
SUPPORTED = ("torchao weight-only Int8WeightOnlyConfig() or Int4WeightOnlyConfig(group_size=128, "
             "int4_packing_format='tile_packed_to_4d'), as hostswap.llm.quantize(model, 'int8' or 'int4') applies them")


class QuantizedLayoutError(ValueError):
    """A quantized weight hostswap cannot describe, or a layout it refuses to rebuild."""


def is_torchao_tensor(tensor) -> bool:
    return any(cls.__module__.startswith(TORCHAO_PACKAGE) for cls in type(tensor).__mro__)


def _encode(value, where: str):
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_encode(v, where) for v in value]
    raise QuantizedLayoutError(f"{where} is of type {type(value).__name__}, which a program cannot store")


def _encode_attributes(attributes, what: str):
    if isinstance(attributes, dict):
        return {k: _encode(v, f"{what}: attribute {k!r}") for k, v in attributes.items()}
    return _encode(attributes, f"{what}: attribute")


def _decode(value):
    if isinstance(value, dict):
        return getattr(torch, value["dtype"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _same_tensor(a, b) -> bool:
    """``a`` is ``b``'s memory, seen the same way (compared without reading data)."""
    return (isinstance(a, torch.Tensor) and (a.dtype, a.shape, a.stride(), a.device) == (b.dtype, b.shape, b.stride(), b.device)
            and (a.device.type == "meta" or a.data_ptr() == b.data_ptr()))


def _fix(what: str) -> str:
    return f"{what}; quantize it with {SUPPORTED}, or leave the layer unquantized (quantize_'s filter_fn)"


def describe(weight: torch.Tensor, where: str) -> tuple[list[str], list[torch.Tensor], str]:
    """(inner tensor names, inner tensors, layout JSON) of a torchao quantized weight; refused
    unless the layout rebuilds the same weight."""
    cls = type(weight)
    what = f"linear '{where}' (torchao {cls.__name__})"
    try:
        names, attributes = weight.__tensor_flatten__()
    except Exception as e:
        raise QuantizedLayoutError(_fix(f"{what} does not flatten into inner tensors ({type(e).__name__}: {e})")) from e
    inner = [getattr(weight, n) for n in names]
    for name, tensor in zip(names, inner):
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise QuantizedLayoutError(_fix(f"{what}: inner tensor {name!r} is a {type(tensor).__name__}, not a plain tensor, which a program cannot store"))
    try:
        encoded = _encode_attributes(attributes, what)
    except QuantizedLayoutError as e:
        raise QuantizedLayoutError(_fix(str(e))) from None
    layout = {
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "names": list(names),
        "attributes": encoded,
        "size": list(weight.shape),
        "stride": list(weight.stride()),
    }
    layout = json.dumps(layout, sort_keys=True)
    try:
        rebuilt = rebuild(inner, layout)
        back_names, back_attributes = rebuilt.__tensor_flatten__()
        same = (type(rebuilt) is cls and rebuilt.shape == weight.shape and list(back_names) == list(names)
                and all(_same_tensor(getattr(rebuilt, n), t) for n, t in zip(names, inner))
                and json.dumps(_encode_attributes(back_attributes, what), sort_keys=True) == json.dumps(encoded, sort_keys=True))
    except Exception as e:
        raise QuantizedLayoutError(_fix(f"{what} cannot be rebuilt from the layout a program stores ({type(e).__name__}: {e})")) from e
    if not same:
        raise QuantizedLayoutError(_fix(f"{what} does not come back the same from the layout a program stores"))
    return list(names), inner, layout


@functools.lru_cache(maxsize=None)
def _layout_class(layout: str) -> tuple[type, dict]:
    """The torchao class of a layout and the layout parsed; once per distinct layout."""
    spec = json.loads(layout)
    module_name, _, qualname = spec["class"].partition(":")
    if not module_name.startswith(TORCHAO_PACKAGE):
        raise QuantizedLayoutError(f"quantized_linear: class {spec['class']} is not torchao's; refused")
    cls = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls, spec


def rebuild(inner: list[torch.Tensor], layout: str) -> torch.Tensor:
    """The torchao tensor a layout describes, over ``inner``."""
    cls, spec = _layout_class(layout)
    attributes = spec["attributes"]
    attributes = {k: _decode(v) for k, v in attributes.items()} if isinstance(attributes, dict) else _decode(attributes)
    return cls.__tensor_unflatten__(dict(zip(spec["names"], inner)), attributes, torch.Size(spec["size"]), tuple(spec["stride"]))


INT8_ROW_SCALED = "torchao.quantization:Int8Tensor"


@functools.lru_cache(maxsize=None)
def _is_int8_weight_only_per_row(layout: str) -> bool:
    """An ``Int8Tensor`` torchao runs as ``x @ qdata.t() * scale``: weight-only (no activation
    quantization or pre-scale) with one scale per output row."""
    spec = json.loads(layout)
    attributes = spec["attributes"] if isinstance(spec["attributes"], dict) else {}
    return (spec["class"] == INT8_ROW_SCALED and spec["names"][:2] == ["qdata", "scale"] and "act_pre_scale" not in spec["names"]
            and attributes.get("act_quant_kwargs") is None and attributes.get("block_size") == [1, spec["size"][-1]])


def _quantized_linear(input, weight, bias, layout, out=None):
    # decode rows of an int8 weight-only linear on CUDA: one kernel reading the int8 bytes once
    # (kernels/int8_weight_only.py) instead of torchao's eager path, which writes and reads a
    # full-precision copy of the weight; everything else runs torchao's own kernels
    if _is_int8_weight_only_per_row(layout) and int8_weight_only.applies(input, weight[0], weight[1], bias):
        return int8_weight_only.int8_weight_only_linear(input, weight[0], weight[1], bias, out=out)
    result = F.linear(input, rebuild(list(weight), layout), bias)
    if out is None:
        return result
    out.copy_(result)
    return out


def _quantized_linear_out(input, weight, bias, layout, *, out):
    return _quantized_linear(input, weight, bias, layout, out=out)


def _quantized_linear_fake(input, weight, bias, layout):
    out_features = json.loads(layout)["size"][0]
    return input.new_empty((*input.shape[:-1], out_features))


def _quantized_linear_out_fake(input, weight, bias, layout, *, out):
    return out


_lib.impl("quantized_linear", _quantized_linear, "CompositeExplicitAutograd")
_lib.impl("quantized_linear.out", _quantized_linear_out, "CompositeExplicitAutograd")
_lib._register_fake("quantized_linear", _quantized_linear_fake)
_lib._register_fake("quantized_linear.out", _quantized_linear_out_fake)

quantized_linear = torch.ops.hostswap.quantized_linear.default


class QuantizedLinear(torch.nn.Module):
    """A linear layer over a torchao quantized weight, its inner tensors plain parameters."""

    def __init__(self, linear: torch.nn.Linear, where: str):
        super().__init__()
        names, inner, self.layout = describe(linear.weight, where)
        self.inner_names = [f"weight_{n}" for n in names]
        for name, tensor in zip(self.inner_names, inner):
            self.register_parameter(name, torch.nn.Parameter(tensor.detach(), requires_grad=False))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, input):
        return quantized_linear(input, [getattr(self, n) for n in self.inner_names], self.bias, self.layout)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {json.loads(self.layout)['class']}"


def prepare_quantized(model: torch.nn.Module) -> int:
    """Swap every ``nn.Linear`` whose weight is a torchao quantized tensor for a
    ``QuantizedLinear``, in place; returns how many. Other torchao weights are refused."""
    swapped = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            where = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and is_torchao_tensor(child.weight):
                setattr(module, child_name, QuantizedLinear(child, where))
                swapped += 1
    left = [n for n, p in model.named_parameters() if is_torchao_tensor(p)]
    if left:
        raise QuantizedLayoutError(f"torchao quantized weights outside nn.Linear layers are not supported: {left[:3]}")
    return swapped
