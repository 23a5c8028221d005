"""Persistent quantized weight copies for FSDP2's all-gathers, kept in host memory
(``offload_quants``).

FSDP2 (``fully_shard``) gathers each sharded weight before a layer's forward and again before
its backward. With ``offload_quants`` a Linear weight's shard keeps a quantized copy (int8 or
float8 e4m3, one scale per row) beside its master; the gather sends that copy instead of the
master: over the host-to-device link where the master lives in host memory (FSDP2's
``CPUOffloadPolicy``), and between ranks in the all-gather. After the gather each rank
dequantizes the full weight to the compute dtype (``MixedPrecisionPolicy.param_dtype``, else the
master's); gradients flow to the master as if the dequantized weight were the weight (the
straight-through rule), and FSDP2 reduce-scatters them as usual.

The copy is persistent and version-tracked: it is made from the master once, and made again
only after the master was written in place (an optimizer step; a write through any view of it
counts), never per gather. With ``host=True`` (the default) it lives in host memory, pinned where CUDA is
there, so the GPU holds no weight between gathers but the gather's own transient buffers.

The mechanism is FSDP2's all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the shard's local tensor, as torchao's float8 training uses it):
``offload_quants(model)`` swaps each Linear weight for a ``QuantizedShard`` before
``fully_shard``; the tensor behaves as its master for every other operation. A weight whose
rows do not split evenly over the ranks is gathered as its master (FSDP2 pads such shards,
and per-row scales cannot be padded with them); ``stats.plain`` names it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._pytree import tree_map

SCHEMES = {"int8": torch.int8, "float8": torch.float8_e4m3fn}
INT8_MAX = 127.0
FLOAT8_MAX = torch.finfo(torch.float8_e4m3fn).max

# Same elements, same shape: the result shares the copy with the source.
_ALIAS_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
# Operators that make new elements of the shard's kind (FSDP2 pads and pins through these): a new shard.
_NEW_OPS = {
    torch.ops.aten.clone.default, torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.zeros_like.default, torch.ops.aten._pin_memory.default,
}
_SCALE_BYTES = 4  # a row's fp32 scale, in front of its codes in the gathered bytes
_DEQUANTIZE_CHUNK_BYTES = 64 * 2**20  # fp32 temporaries of dequantize_rows


class QuantsError(ValueError):
    """``offload_quants`` cannot apply to this model as asked; the message says why."""


def quantize_rows(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales [rows, 1] fp32) of a 2-D weight, one scale per row: int8 rounds
    ``w / scale`` with ``scale = max|row| / 127``; float8 casts it to e4m3 with
    ``scale = max|row| / 448``."""
    w = weight.detach().float()
    top = INT8_MAX if scheme == "int8" else FLOAT8_MAX
    scale = (w.abs().amax(dim=1, keepdim=True) / top).clamp(min=torch.finfo(torch.float32).tiny)
    scaled = w / scale
    if scheme == "int8":
        return scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return scaled.to(torch.float8_e4m3fn), scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (the compute dtype) = codes * scale, each product in fp32 and rounded once, a
    block of rows at a time (the fp32 temporaries stay small)."""
    rows, width = codes.shape
    step = max(1, _DEQUANTIZE_CHUNK_BYTES // max(1, 4 * width))
    for a in range(0, rows, step):
        out[a : a + step].copy_(codes[a : a + step].float().mul_(scale[a : a + step]))
    return out


def pack_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One byte tensor [rows, 4 + columns]: each row's fp32 scale, then its codes. One tensor is
    what FSDP2 sends where a shard group has one rank (it copies only the first all-gather
    input there), and one copy brings a shard over the link."""
    return torch.cat([scale.contiguous().view(torch.uint8), codes.view(torch.uint8)], dim=1)


def unpack_rows(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [rows, columns] of ``dtype``, scales [rows, 1] fp32) of ``pack_rows``'s bytes."""
    return packed[:, _SCALE_BYTES:].view(dtype), packed[:, :_SCALE_BYTES].contiguous().view(torch.float32)


@dataclasses.dataclass
class QuantStats:
    """What the quantized gathers of one model did, summed over its weights on this rank."""

    quantizations: int = 0  # copies made from a master: once, then after each in-place change
    gathers: int = 0  # all-gathers that sent a quantized copy
    bytes_gathered: int = 0  # this rank's all-gather inputs (codes and scales)
    bytes_h2d: int = 0  # of those, brought from host memory to the device
    host_bytes: int = 0  # the copies held in host memory
    plain: list[str] = dataclasses.field(default_factory=list)  # weights gathered as their master (uneven rows)


class _Changes:
    """How many times the elements of one master's storage were written in place: shared by
    every shard that views that storage. (Version counters cannot serve: a wrapper subclass's
    operators run below autograd, where in-place writes to its master bump no version.)"""

    count = 0


class _Copy:
    """The persistent quantized copy of one shard (``pack_rows``'s bytes), and the count of
    changes it was made at."""

    def __init__(self, scheme: str, host: bool, stats: QuantStats, name: str):
        self.scheme, self.host, self.stats, self.name = scheme, host, stats, name
        self.packed: torch.Tensor | None = None
        self.made_at = -1
        self.read: torch.cuda.Event | None = None  # the last copy out of pinned host memory

    def like(self) -> "_Copy":
        """An empty copy of the same kind, for another shard."""
        return _Copy(self.scheme, self.host, self.stats, self.name)

    def fresh(self, master: torch.Tensor, changes: _Changes) -> torch.Tensor:
        """The copy of ``master`` as it is now, made again when the master changed since; where
        the master is on a device, the bytes just made there (the host keeps its own copy)."""
        if self.packed is not None and changes.count == self.made_at:
            return self.packed
        packed = pack_rows(*quantize_rows(master, self.scheme))
        self.made_at = changes.count
        self.stats.quantizations += 1
        if not self.host:
            self.packed = packed
            return packed
        if self.packed is None:
            self.packed = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=torch.cuda.is_available())
            self.stats.host_bytes += _nbytes(self.packed)
        elif self.read is not None:  # a gather may still be reading the pinned copy
            self.read.synchronize()
        self.packed.copy_(packed)
        return packed if packed.device.type != "cpu" else self.packed

    def staged(self, master: torch.Tensor, changes: _Changes, device: torch.device) -> torch.Tensor:
        """The copy on ``device``, for one all-gather."""
        packed = self.fresh(master, changes)
        if packed.device != device:
            packed = packed.to(device, non_blocking=True)
            self.stats.bytes_h2d += _nbytes(packed)
            if device.type == "cuda":
                self.read = torch.cuda.Event()
                self.read.record()
        return packed


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _written(func, args, kwargs) -> list:
    """The arguments ``func`` writes in place (its schema's mutable ones)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
            written += value if isinstance(value, (list, tuple)) else [value]
    return written


def _is_view(func) -> bool:
    """Whether ``func``'s outputs alias its input (a view: writes through it write the master)."""
    return func.is_view or any(r.alias_info is not None for r in func._schema.returns)


class QuantizedShard(torch.Tensor):
    """A weight (a shard of it, once ``fully_shard`` split it) whose FSDP2 all-gathers send a
    persistent quantized copy. It behaves as its master for every operation. FSDP2's
    asynchronous copy of a host shard to the GPU before its all-gather (``CPUOffloadPolicy``)
    gives a shard whose master follows only if an operation reads it, so the quantized copy
    alone crosses the link."""

    _master: torch.Tensor
    _copy: _Copy
    _changes: _Changes
    _moved: torch.Tensor | None  # the master on this shard's device, once an operation needed it
    _made_at: int  # a shard of another device than its master's: the master's changes when it was made

    @staticmethod
    def __new__(cls, master: torch.Tensor, copy: _Copy, changes: _Changes, device: torch.device | None = None):
        return torch.Tensor._make_wrapper_subclass(cls, master.shape, strides=master.stride(), storage_offset=master.storage_offset(), dtype=master.dtype,
                                                   device=device or master.device, requires_grad=False)

    def __init__(self, master: torch.Tensor, copy: _Copy, changes: _Changes, device: torch.device | None = None):
        self._master, self._copy, self._changes = master, copy, changes
        self._moved = None if device is not None and device != master.device else master
        self._made_at = changes.count

    def __repr__(self) -> str:
        return f"QuantizedShard({self._copy.scheme}, {tuple(self.shape)}, {self.dtype}, {self.device})"

    def __tensor_flatten__(self):
        return ["_master"], (self._copy, self._changes, self.device)

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return QuantizedShard(inner["_master"], *context)

    def __reduce_ex__(self, protocol):
        # saved (torch.save, distributed checkpoints) as the plain tensor it stands for
        return self.master().detach().clone().__reduce_ex__(protocol)

    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        master = value.master() if isinstance(value, QuantizedShard) else value
        if tuple(master.shape) != tuple(self.shape) or master.dtype != self.dtype or master.device != self.device:
            raise QuantsError(f"{self._copy.name}: .data of a quantized weight ({tuple(self.shape)} {self.dtype} on {self.device}) cannot become "
                              f"a {tuple(master.shape)} {master.dtype} tensor on {master.device}; copy_ into it, or change the model before offload_quants")
        self._master = self._moved = master.detach()
        self._changes.count += 1

    def master(self) -> torch.Tensor:
        """The master's elements on this shard's device (moved there on first use)."""
        if self._moved is None:
            if self._changes.count != self._made_at:
                raise QuantsError(f"{self._copy.name}: this copy on {self.device} was made before its master on {self._master.device} changed; "
                                  "it was meant for one all-gather only")
            self._moved = self._master.to(self.device)
            self._copy, self._changes = self._copy.like(), _Changes()  # a copy of its own from here on
        return self._moved

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func is torch.ops.aten._to_copy.default and isinstance(first, QuantizedShard) and len(args) == 1:
            device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else first.device
            same_kind = all(v is None or k in ("device", "non_blocking", "layout", "memory_format") or (k == "dtype" and v == first.dtype)
                            for k, v in kwargs.items())
            # FSDP2's copy of a host shard to the accelerator before its all-gather (CPUOffloadPolicy)
            if same_kind and kwargs.get("non_blocking") and first.device.type == "cpu" and device.type != "cpu" and first._moved is first._master:
                return QuantizedShard(first._master, first._copy, first._changes, device)
        written = [t for t in _written(func, args, kwargs) if isinstance(t, QuantizedShard)] if func._schema.is_mutable else []
        unwrapped = tree_map(lambda t: t.master() if isinstance(t, QuantizedShard) else t, (args, kwargs))
        result = func(*unwrapped[0], **unwrapped[1])
        if written:
            for shard in written:
                shard._changes.count += 1
            if func.overloadpacket.__name__.endswith("_"):  # in place: the shard itself (a list's: None)
                return first if isinstance(first, QuantizedShard) else result
            return kwargs["out"] if kwargs.get("out") is not None else result
        if isinstance(first, QuantizedShard):
            if func in _ALIAS_OPS:  # the same elements: the same copy
                return QuantizedShard(result, first._copy, first._changes)
            if _is_view(func):  # other elements of the same storage: writes through them count
                return tree_map(lambda r: QuantizedShard(r, first._copy.like(), first._changes) if isinstance(r, torch.Tensor) else r, result)
            if func in _NEW_OPS or func is torch.ops.aten._to_copy.default:  # new elements (another dtype too): a shard of their own
                return tree_map(lambda r: QuantizedShard(r, first._copy.like(), _Changes()) if isinstance(r, torch.Tensor) and r.dtype.is_floating_point else r,
                                result)
        return result

    # --- FSDP2's all-gather extension -----------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        world = mesh.size()
        if len(outer_size) != 2 or tuple(self.shape[1:]) != tuple(outer_size[1:]):
            raise QuantsError(f"{self._copy.name}: offload_quants gathers shards of whole rows (FSDP2's Shard(0)); this weight "
                              f"{tuple(outer_size)} is sharded as {tuple(self.shape)}")
        if outer_size[0] % world:  # uneven rows: the master, padded to the rows of the first shard as FSDP2 pads
            if self._copy.name not in self._copy.stats.plain:
                self._copy.stats.plain.append(self._copy.name)
            master = self.master()
            padded = master.new_zeros((-(-outer_size[0] // world), *master.shape[1:]), dtype=mp_policy.param_dtype or self.dtype)
            padded[: master.shape[0]].copy_(master)
            return (padded,), None
        packed = self._copy.staged(self._master, self._changes, self.device)
        self._copy.stats.gathers += 1
        self._copy.stats.bytes_gathered += _nbytes(packed)
        return (packed,), SCHEMES[self._copy.scheme]

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,) = all_gather_outputs
        if metadata is None:  # gathered as the master
            if out is not None:
                return None
            return gathered, (gathered,)
        codes, scale = unpack_rows(gathered, metadata)
        if out is not None:  # the weight autograd saved in the forward: refilled as FSDP2 refills its own
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                dequantize_rows(codes, scale, out)
            return None
        full = dequantize_rows(codes, scale, torch.empty(codes.shape, dtype=param_dtype, device=codes.device))
        return full, (full,)


def offload_quants(model: torch.nn.Module, scheme: str = "int8", *, host: bool = True) -> QuantStats:
    """Give every ``nn.Linear`` weight of ``model`` a persistent quantized copy for FSDP2's
    all-gathers (see the module docstring); call it before ``fully_shard``. ``scheme``:
    ``"int8"`` or ``"float8"`` (e4m3), one scale per row. ``host=False`` keeps the copies where
    the masters are (``persistent_quants`` without the offload). Returns the stats the gathers
    of this model add to."""
    if scheme not in SCHEMES:
        raise QuantsError(f"offload_quants scheme {scheme!r} is not one of {sorted(SCHEMES)}")
    stats = QuantStats()
    weights = {}  # id -> (name, the Linear weight)
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            weights.setdefault(id(module.weight), (f"{module_name}.weight" if module_name else "weight", module.weight))
    if not weights:
        raise QuantsError(f"{type(model).__name__} has no nn.Linear weights to quantize")
    for name, weight in weights.values():
        if type(weight).__name__ == "DTensor":
            raise QuantsError(f"{name} is already sharded: call offload_quants before fully_shard")
        if isinstance(weight, QuantizedShard):
            raise QuantsError(f"{name} already has a quantized copy: offload_quants ran on this model before")
        if not weight.dtype.is_floating_point or weight.dim() != 2:
            raise QuantsError(f"{name} is a {weight.dim()}-D {weight.dtype} tensor; offload_quants quantizes 2-D floating-point weights")
    swapped = {key: torch.nn.Parameter(QuantizedShard(weight.detach(), _Copy(scheme, host, stats, name), _Changes()), requires_grad=weight.requires_grad)
               for key, (name, weight) in weights.items()}
    holders = []
    for module in model.modules():  # every holder of a swapped weight: a tied embedding too
        for attr, param in list(module._parameters.items()):
            if param is not None and id(param) in swapped:
                module._parameters[attr] = swapped[id(param)]
                holders.append((module, attr, weights[id(param)][0]))

    def still_quantized(_module, _incompatible) -> None:
        # load_state_dict(assign=True) puts the loaded tensors in place of the shards: their
        # gathers would silently send the full weights
        for module, attr, name in holders:
            param = module._parameters[attr]
            local = getattr(param, "_local_tensor", param)
            if not isinstance(local, QuantizedShard):
                raise QuantsError(f"load_state_dict replaced {name}, a weight with a quantized copy, by a plain tensor (assign=True?); "
                                  "load without assign=True: the values are copied into it and its copy is made again")

    model.register_load_state_dict_post_hook(still_quantized)
    return stats
