"""Activation offload without a compiler: ``OffloadContext``, Transformer Engine's
``get_cpu_offload_context`` shape.

    offload = hostswap.activations.OffloadContext(model_layers=n, num_layers=k)
    for i, layer in enumerate(model.model.layers):
        with offload.layer(i):
            h = layer(h, ...)

It runs on the synchronization dictionary, synchronizer and pinned host buffers of the
``torch.compile`` backend (schedules/sync_dict.py, runtime/activation_offload.py): one
implementation, two front ends. The backend finds a layer's boundaries in its graphs; here
the forward boundary of layer i is entering ``offload.layer(i)``, and the backward boundary
is the first read of one of its saved tensors in the backward. Saved tensors of an offloaded
layer go through ``torch.autograd.graph.saved_tensors_hooks``: parameters, non-floating
tensors and tensors under ``min_offload_bytes`` stay on the device.

``modules=("self_attn", "mlp.up_proj")`` narrows the offload to what submodules of a layer
save (Megatron's fine-grained choice): fnmatch patterns over names relative to the layer,
given as ``offload.layer(i, module=layer)``. ``stats["bytes_by_module"]`` gives the bytes
each pattern offloaded in the last step.

``reload_ahead="auto"`` fits the reload points to the machine: the second and third steps are
timed on the leanest schedule (``reload_ahead=1``), then each reload starts as late as still
lands it before its layer's backward, within the memory the step holds anyway
(``schedules.sync_dict.fitted_sync_dict``); ``offload.synchronization_dict`` shows the result.

``offload.attach(model.model.layers)`` does the ``with offload.layer(i, module=layer)`` around
every call of the i-th layer, so a transformers model's own forward offloads without a loop
of one's own; ``offload.detach()`` undoes it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import weakref

import torch

from hostswap.runtime.activation_offload import OffloadSynchronizer, StepTimes
from hostswap.schedules.sync_dict import ActivationSchedule, SyncDictError, default_sync_dict, fitted_sync_dict, point, validate_sync_dict


class OffloadContext:
    """Offloads the saved activations of the layers a synchronization dictionary names."""

    def __init__(self, model_layers: int, num_layers: int | None = None, *, synchronization_dict: dict | None = None,
                 reload_ahead: int | str | None = None, min_offload_bytes: int = 2**20, modules: tuple[str, ...] | None = None, device=None,
                 calibration_steps: int = 2):
        if (num_layers is None) == (synchronization_dict is None):
            raise SyncDictError("give num_layers (offload the first k layers) or synchronization_dict, not both")
        self._fit_steps_left = 0
        if isinstance(reload_ahead, str) and reload_ahead != "auto":
            raise SyncDictError(f"reload_ahead must be an int >= 1 (layers) or 'auto', got {reload_ahead!r}")
        if reload_ahead == "auto":
            if synchronization_dict is not None:
                raise SyncDictError("reload_ahead='auto' fits the reload points of the num_layers schedule; a synchronization_dict sets its own")
            if isinstance(calibration_steps, bool) or not isinstance(calibration_steps, int) or calibration_steps < 1:
                raise ValueError(f"calibration_steps must be an int >= 1, got {calibration_steps!r}")
            # measured with the leanest schedule (each layer reloaded one layer ahead), then fitted
            sync = default_sync_dict(model_layers, num_layers, 1)
            self._fit_steps_left = calibration_steps if sync else 0
        elif synchronization_dict is None:
            sync = default_sync_dict(model_layers, num_layers, reload_ahead)
        else:
            sync = validate_sync_dict(synchronization_dict, model_layers)
        self._backward_s: dict[int, float] = {}  # calibration: the fastest of each layer's backward
        self._reload_s: dict[int, float] = {}  # and of each offloaded layer's copy back
        self._reload_bytes: dict[int, int] = {}  # and its bytes
        self._headroom: dict[int, int] | None = None  # layer -> bytes free at its backward start (CUDA only)
        self.schedule = ActivationSchedule(model_layers, sync)
        self.synchronizer = OffloadSynchronizer(self.schedule, device)
        self.min_offload_bytes = min_offload_bytes
        if modules is not None and (isinstance(modules, str) or not all(isinstance(m, str) and m for m in modules)):
            raise ValueError(f"modules must be a tuple of submodule name patterns such as ('self_attn', 'mlp.up_proj'), got {modules!r}")
        self.modules = tuple(modules) if modules is not None else None
        self._names: dict[int, str] = {}  # id of a submodule of the current layer -> its name there
        self._running: list[str] = []  # names of the current layer's submodules now in forward
        self.bytes_by_module: dict[str, int] = {}
        self._pattern_of: dict[int, str] = {}  # tensor id -> the module pattern that chose it, this step
        self._ids: dict[tuple[int, int], int] = {}  # (layer, k-th saved tensor of the step) -> tensor id
        self._saved_in_layer: dict[int, int] = {}
        self._backward_began: set[int] = set()
        self._reads_left: dict[int, int] = {}  # tensor id -> unpacks left this backward (a tensor saved twice)
        self._reloaded: dict[int, torch.Tensor] = {}
        self._packed: dict[tuple, int] = {}  # (storage, offset, shape, stride) -> tensor id, this layer
        self._attached: list[torch.nn.Module] = []  # the layers attach() changed
        # Saved-tensor hooks run Python for every tensor a layer saves, which a step bound by
        # the host launching kernels (a transformers model at batch 1) pays in full. Offloaded
        # layers take the full hooks; a layer whose backward start the schedule acts on (a
        # reload, or a release) takes hooks that only mark that start; any other layer none.
        self._marks: dict[int, object] = {}
        self._place_marks()

    def _place_marks(self) -> None:
        n = self.schedule.model_layers
        measuring = self._fit_steps_left > 0  # every layer's backward start is timed
        self._marks = {layer: self._backward_mark(layer) for layer in range(n)
                       if layer not in self.schedule.sync and (measuring or any(self.schedule.actions_at(point(False, layer, n))))}

    def _measure_headroom(self, allocated: dict[int, int]) -> None:
        """Bytes that each layer's backward start could hold beyond what the step held there,
        without exceeding what it held where the backward began (the forward's end, about the
        step's peak): the smallest over the measured steps. The leanest schedule, measured
        here, holds offloaded layer j's reload at j's own backward start; that is taken off."""
        n = self.schedule.model_layers
        top = allocated.get(point(False, n - 1, n))
        if top is None:  # no allocator to count (a machine without CUDA): no memory bound
            return
        rooms = {j: top - (allocated[p] - (self._reload_bytes.get(j, 0) if j in self.schedule.sync else 0))
                 for j in range(n - 1) if (p := point(False, j, n)) in allocated}
        earlier = self._headroom if self._headroom is not None else rooms
        self._headroom = {j: min(room, earlier.get(j, room)) for j, room in rooms.items()}

    @property
    def synchronization_dict(self) -> dict:
        """The dictionary the offload runs on now (with ``reload_ahead='auto'``, the fitted one
        once calibration is over)."""
        return dict(self.schedule.sync)

    def _measure_step(self) -> None:
        """With ``reload_ahead='auto'``, at the start of each step: take what the last one
        measured, and after ``calibration_steps`` measured steps fit the reload points. The first
        step is not measured: it allocates the pinned buffers and the allocator's blocks."""
        s = self.synchronizer
        if s.times is not None:
            n = self.schedule.model_layers
            backward, reload = s.times.backward_seconds(n), s.reload_seconds()
            first = min(self.schedule.sync)
            if all(j in backward for j in range(first + 1, n)) and all(i in reload for i in self.schedule.sync):
                for table, measured in ((self._backward_s, backward), (self._reload_s, reload)):
                    for key, seconds in measured.items():
                        table[key] = min(table.get(key, seconds), seconds)
                self._reload_bytes = s.layer_bytes()
                self._measure_headroom(s.times.allocated)
                self._fit_steps_left -= 1
            s.times = None
            if self._fit_steps_left == 0:
                self.schedule.sync = fitted_sync_dict(self.schedule.sync, n, self._backward_s, self._reload_s,
                                                      reload_bytes=self._reload_bytes, headroom=self._headroom)
                self._place_marks()
                return
        if s.device is not None:  # known once a step has run
            s.times = StepTimes(s.device)

    @property
    def stats(self) -> dict:
        """The last step: bytes offloaded, seconds of copies to host and back (in total and, with
        ``modules``, per pattern), the most offloaded layers on the device at once; and the
        bytes of host buffers held (``host_bytes``, pinned on CUDA)."""
        s = self.synchronizer
        seconds = s.transfer_seconds()
        by_module: dict[str, float] = {}
        for tensor, pattern in self._pattern_of.items():
            by_module[pattern] = by_module.get(pattern, 0.0) + seconds.get(tensor, 0.0)
        return {"bytes_offloaded": s.bytes_offloaded, "transfer_seconds": sum(seconds.values()), "max_offloaded_layers_on_gpu": s.max_offloaded_layers_on_gpu,
                "pinned_allocations": s.pinned_allocations, "host_bytes": s.host_bytes, "bytes_by_module": dict(self.bytes_by_module),
                "transfer_seconds_by_module": by_module, "log": list(s.log)}

    @contextlib.contextmanager
    def layer(self, i: int, module: torch.nn.Module | None = None):
        n = self.schedule.model_layers
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise SyncDictError(f"layer index must be an int in 0..{n - 1}, got {i!r}")
        if self.modules is not None and not isinstance(module, torch.nn.Module):
            raise ValueError("OffloadContext(modules=...) matches submodule names: give the layer, offload.layer(i, module=layer)")
        if i == 0:  # a new step's forward
            if self._fit_steps_left:
                self._measure_step()
            self._saved_in_layer = {}
            self._backward_began = set()
            self.bytes_by_module = {}
            self._pattern_of = {}
        self.synchronizer.at_point(point(True, i, n))
        self._packed = {}
        with contextlib.ExitStack() as stack:
            if i in self.schedule.sync:
                if self.modules is not None:
                    self._names = {id(m): name for name, m in module.named_modules() if name}
                    stack.enter_context(_module_stack(self._names, self._running))
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda x: self._pack(i, x), self._unpack))
            elif i in self._marks:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_saved_as_is, self._marks[i]))
            yield self
        self.synchronizer.flush_offloads()  # the layer's copies to host start beside the next layer's forward

    def attach(self, layers) -> None:
        """Run every call of ``layers[i]`` (for example a transformers model's ``model.model.layers``)
        inside ``self.layer(i, module=layers[i])``. The layers keep their parameters, names and
        ``isinstance``; transformers' gradient checkpointing stays inside the offload, so the
        checkpointed input (the residual stream) is what goes to the host."""
        layers = list(layers) if isinstance(layers, (torch.nn.ModuleList, list, tuple)) else None
        n = self.schedule.model_layers
        if layers is None or not all(isinstance(m, torch.nn.Module) for m in layers):
            raise TypeError("attach takes the decoder layers as an nn.ModuleList or a list of modules, e.g. model.model.layers")
        if len(layers) != n:
            raise SyncDictError(f"attach got {len(layers)} layers, but this OffloadContext was made for model_layers={n}")
        attached = [m for m in layers if "_hostswap_offload" in m.__dict__]
        if attached:
            raise ValueError(f"{type(attached[0]).__name__} is already attached to an OffloadContext; detach() that one first")
        self.detach()
        for i, module in enumerate(layers):
            module.__dict__["_hostswap_offload"] = (weakref.ref(self), i)
            module.__class__ = _offloaded_class(type(module))
        self._attached = layers

    def detach(self) -> None:
        """Undo ``attach``: the layers are called as before."""
        for module in self._attached:
            module.__dict__.pop("_hostswap_offload", None)
            module.__class__ = module.__class__.__bases__[0]
        self._attached = []

    def _backward_mark(self, layer: int):
        """The unpack hook of a layer that offloads nothing: its first read is the point where
        the layer's backward begins."""
        n = self.schedule.model_layers

        def unpack(x):
            if layer not in self._backward_began:
                self._backward_began.add(layer)
                self.synchronizer.at_point(point(False, layer, n))
            return x

        return unpack

    def _stays(self, x: torch.Tensor) -> bool:
        base = x._base if x._base is not None else x
        return (isinstance(base, torch.nn.Parameter) or not x.is_floating_point()
                or x.numel() * x.element_size() < self.min_offload_bytes or x.device.type == "meta")

    def _chosen(self) -> str | None:
        """The pattern the innermost running submodule that matches one matches; "" if none does."""
        for name in reversed(self._running):
            for pattern in self.modules:
                if fnmatch.fnmatchcase(name, pattern):
                    return pattern
        return ""

    def _pack(self, layer: int, x: torch.Tensor):
        if layer not in self.schedule.sync or self._stays(x):
            return ("kept", layer, x)
        chosen = self._chosen() if self.modules is not None else None
        if chosen == "":
            return ("kept", layer, x)
        key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()))
        tensor = self._packed.get(key)
        if tensor is not None:  # the same tensor saved again by this layer: one copy, read twice
            self._reads_left[tensor] += 1
            return ("offloaded", layer, tensor)
        k = self._saved_in_layer.get(layer, 0)
        self._saved_in_layer[layer] = k + 1
        tensor = self._ids.get((layer, k))
        if tensor is None:  # the same tensors each step: their pinned buffers are reused
            tensor = self._ids[(layer, k)] = len(self._ids)
            self.synchronizer.register(tensor, layer)
        self.synchronizer.push(tensor, x)
        if chosen is not None:
            self.bytes_by_module[chosen] = self.bytes_by_module.get(chosen, 0) + x.numel() * x.element_size()
            self._pattern_of[tensor] = chosen
        self._packed[key] = tensor
        self._reads_left[tensor] = 1
        return ("offloaded", layer, tensor)

    def _unpack(self, packed):
        kind, layer, value = packed
        if layer not in self._backward_began:  # the first read of this layer's tensors: its backward begins
            self._backward_began.add(layer)
            self.synchronizer.at_point(point(False, layer, self.schedule.model_layers))
        if kind == "kept":
            return value
        if value not in self._reloaded:
            self._reloaded[value] = self.synchronizer.pop(value)
        self._reads_left[value] -= 1
        out = self._reloaded[value]
        if self._reads_left[value] == 0:
            del self._reloaded[value]
        return out


def _saved_as_is(x: torch.Tensor) -> torch.Tensor:
    return x


@contextlib.contextmanager
def _module_stack(names: dict[int, str], running: list[str]):
    """Keep ``running`` as the names of the layer's submodules whose forward is under way."""

    def enter(module, _args):
        name = names.get(id(module))
        if name is not None:
            running.append(name)

    def leave(module, _args, _output):
        if names.get(id(module)) is not None and running:
            running.pop()

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
        running.clear()


_OFFLOADED_CLASSES: dict[type, type] = {}


def _offloaded_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` enters its OffloadContext's ``layer(i)`` first.

    ``__call__`` and not a forward hook: transformers' ``GradientCheckpointingLayer.__call__``
    wraps the module's hooks in the checkpoint, and the offload must be outside it. The
    recomputation of a checkpointed layer happens in the backward, where no new forward
    boundary is entered."""
    if cls not in _OFFLOADED_CLASSES:
        def __call__(self, *args, **kwargs):
            ref, i = self.__dict__.get("_hostswap_offload", (None, None))
            context = ref() if ref is not None else None
            if context is None or torch._C._current_graph_task_id() != -1:  # detached, or a recomputation in the backward
                return super(offloaded, self).__call__(*args, **kwargs)
            with context.layer(i, module=self):
                return super(offloaded, self).__call__(*args, **kwargs)

        offloaded = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _OFFLOADED_CLASSES[cls] = offloaded
    return _OFFLOADED_CLASSES[cls]
