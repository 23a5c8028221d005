"""Runtime of the activation pass: the offload synchronizer and the custom ops the pass inserts.

The pass (passes/activation_offload.py) puts three ops into AOTAutograd's graphs; each calls
the synchronizer it was compiled for:

* ``hostswap::act_offload(x, sync, tensor)`` right after a saved activation is produced: an
  event on the main stream, then a copy into a pinned host buffer on the offload stream.
  Returns an empty placeholder that the forward saves instead of ``x``.
* ``hostswap::act_boundary(x, sync, point, keep)`` where a layer begins its forward or
  backward pass: releases the layers whose offload finishes there (the main stream waits for
  their copies, then drops its references) and starts the reloads that start there. Returns
  a copy of ``x`` that the rest of the layer reads, so compilers keep it in place. ``keep``
  lists the tensors released there: a compiler sees them alive until this point, so it cannot
  hand their memory to another kernel while the offload stream still reads them.
* ``hostswap::act_reload(placeholder, sync, tensor, size, stride, dtype)`` before the first
  backward use: waits for that tensor's own reload event (starting the layer's reload first
  if the schedule has not yet) and returns it.

On a machine without CUDA the copies are host to host and synchronous, so CI runs the same
graphs. One class per job, as in Transformer Engine's cpu_offload v2: ``_Transfers`` owns
the stream and events, ``OffloadSynchronizer`` the per-layer state machine.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch
from torch.library import Library

from hostswap.schedules.sync_dict import point_name

_LIB = Library("hostswap", "FRAGMENT")
_LIB.define("act_offload(Tensor x, int sync, int tensor) -> Tensor")
_LIB.define("act_boundary(Tensor x, int sync, int point, Tensor[] keep) -> Tensor")
_LIB.define("act_reload(Tensor placeholder, int sync, int tensor, SymInt[] size, SymInt[] stride, ScalarType dtype) -> Tensor")
_LIB.define("not_offload(Tensor x) -> Tensor")

def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (a permutation of a contiguous layout): copies as one block."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


_SYNCHRONIZERS: dict[int, "OffloadSynchronizer"] = {}
_IDS = itertools.count(1)


def _sync(sync_id: int) -> "OffloadSynchronizer":
    return _SYNCHRONIZERS[sync_id]


def _offload(x, sync, tensor):
    return _sync(sync).push(tensor, x)


def _boundary(x, sync, point, keep):
    _sync(sync).at_point(point)
    return x.clone()


def _reload(placeholder, sync, tensor, size, stride, dtype):
    return _sync(sync).pop(tensor, tuple(size), tuple(stride))


def _not_offload(x):
    return x.clone()


_LIB.impl("act_offload", _offload, "CompositeExplicitAutograd")
_LIB.impl("act_boundary", _boundary, "CompositeExplicitAutograd")
_LIB.impl("act_reload", _reload, "CompositeExplicitAutograd")
_LIB.impl("not_offload", _not_offload, "CompositeExplicitAutograd")
_LIB._register_fake("act_offload", lambda x, sync, tensor: x.new_empty((0,)))
_LIB._register_fake("act_boundary", lambda x, sync, point, keep: torch.empty_like(x))
_LIB._register_fake("act_reload", lambda placeholder, sync, tensor, size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device=placeholder.device))
_LIB._register_fake("not_offload", lambda x: torch.empty_like(x))
torch.library.register_autograd("hostswap::not_offload", lambda ctx, grad: grad)


def mark_not_offload(tensor: torch.Tensor) -> torch.Tensor:
    """Use the returned tensor in place of ``tensor``: the pass will keep it on the GPU."""
    return torch.ops.hostswap.not_offload(tensor)


@dataclasses.dataclass
class _TensorState:
    layer: int
    tensor: int
    gpu: torch.Tensor | None = None  # held from push until release (the copy reads it)
    host: torch.Tensor | None = None  # pinned, reused across steps
    offloaded: object = None  # event: copy to host done
    reloaded: object = None  # event: copy to device done
    restore: tuple | None = None  # (size, stride) when offloaded as a contiguous copy
    reload_started: bool = False
    copied: bool = False  # a copy to host was queued this step


class _Transfers:
    """The offload stream and the events between it and the main stream; synchronous on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # ([(tag, share)], seconds on CPU | (start, done) events on CUDA, "offload" | "reload"), this step
        self.timed: list[tuple[list, object, str]] = []

    def main(self):
        return torch.cuda.current_stream(self.device)

    def copy_group(self, copies: list[tuple[torch.Tensor, torch.Tensor, int]], one_event: bool = False, kind: str = "offload"):
        """Copy each (src, dst, tag) on the offload stream after the work the main stream has
        queued so far (the sources were produced there, or the destinations allocated there):
        a layer's offload or reload. One wait for the main stream and one timed span for the
        group, so the host work per tensor is a copy call (and an event, unless ``one_event``),
        which matters where the host is what bounds the step (the GPU waits while Python
        queues). Returns each copy's event (None on CPU, where copies are synchronous; with
        ``one_event`` the group's last for all). The group's duration is kept under ``kind``
        ("offload" or "reload") and shared among the tags by bytes."""
        if not self.cuda:
            for src, dst, tag in copies:
                t = time.perf_counter()
                dst.copy_(src)
                self.timed.append(([(tag, 1.0)], time.perf_counter() - t, kind))
            return [None] * len(copies)
        queued = torch.cuda.Event()
        queued.record(self.main())
        self.stream.wait_event(queued)
        arrived = []
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            for k, (src, dst, _) in enumerate(copies):
                dst.copy_(src, non_blocking=True)
                if not one_event and k < len(copies) - 1:  # the backward may start on the first tensor that landed
                    arrived.append(torch.cuda.Event())
                    arrived[-1].record(self.stream)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        arrived = arrived + [done] if not one_event else [done] * len(copies)
        sizes = [src.numel() * src.element_size() for src, _, _ in copies]
        total = sum(sizes) or 1
        self.timed.append(([(tag, size / total) for (_, _, tag), size in zip(copies, sizes)], (start, done), kind))
        return arrived

    def seconds_by_tag(self, kind: str | None = None) -> dict[int, float]:
        """Seconds of this step's copies (of one ``kind``, or all) per tag; waits for those still
        running on CUDA."""
        out: dict[int, float] = {}
        for shares, timing, copied in self.timed:
            if kind is not None and copied != kind:
                continue
            if isinstance(timing, tuple):
                timing[1].synchronize()
                timing = timing[0].elapsed_time(timing[1]) / 1e3
            for tag, share in shares:
                out[tag] = out.get(tag, 0.0) + timing * share
        return out

    def main_waits(self, event, times: "StepTimes | None" = None) -> None:
        """The main stream waits for a copy; ``times`` keeps how long it stood still."""
        if event is None:
            return
        before = times.stamp() if times is not None else None
        self.main().wait_event(event)
        if times is not None:
            times.waits.append((before, times.stamp()))


class StepTimes:
    """When one step reached each point, and how long the main stream stood waiting for copies
    in between: CUDA events on the main stream (the GPU's clock), or the host clock on a
    machine without CUDA, where every copy is synchronous and nothing waits."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.points: list[tuple[int, object]] = []
        self.waits: list[tuple[object, object]] = []
        self.allocated: dict[int, int] = {}  # point -> the allocator's bytes there (CUDA: a host-side count, no sync)

    def at(self, p: int) -> None:
        self.points.append((p, self.stamp()))
        if self.cuda:
            self.allocated.setdefault(p, torch.cuda.memory_allocated(self.device))

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self) -> tuple[dict[int, float], list[tuple[float, float]]]:
        """(point -> seconds since the step's first point, [(wait began, ended)]); on CUDA, waits
        until the GPU has passed the step's stamps."""
        if not self.points:
            return {}, []
        first = self.points[0][1]
        if self.cuda:
            for _, stamp in self.points:
                stamp.synchronize()
            for _, stamp in self.waits:
                stamp.synchronize()
            since = lambda stamp: first.elapsed_time(stamp) / 1e3  # noqa: E731
        else:
            since = lambda stamp: stamp - first  # noqa: E731
        at: dict[int, float] = {}
        for p, stamp in self.points:
            at.setdefault(p, since(stamp))
        return at, [(since(a), since(b)) for a, b in self.waits]

    def backward_seconds(self, model_layers: int) -> dict[int, float]:
        """Layer j -> seconds from its backward's start to the next layer's, less the main
        stream's waits for copies in between: the backward's own time, which a reload started
        earlier could hide behind. Only layers whose both ends were reached."""
        n = model_layers
        at, waits = self.seconds()
        out = {}
        for j in range(1, n):
            begin, end = at.get(2 * n - 1 - j), at.get(2 * n - j)
            if begin is None or end is None:
                continue
            waited = sum(b - a for a, b in waits if a >= begin and b <= end)
            out[j] = max(end - begin - waited, 0.0)
        return out


class OffloadSynchronizer:
    """Per-layer state machine of one compiled program's offloaded activations."""

    def __init__(self, schedule, device: torch.device | str | None = None):
        self.schedule = schedule
        self.id = next(_IDS)
        self._device = torch.device(device) if device is not None else None
        self._transfers: _Transfers | None = None
        self.tensors: dict[int, _TensorState] = {}
        self.layer_tensors: dict[int, list[int]] = {}
        self.on_gpu: set[int] = set()  # offloaded layers whose activations are on the GPU now
        self.max_offloaded_layers_on_gpu = 0
        self.bytes_offloaded = 0  # last step
        self.pinned_allocations = 0  # over the synchronizer's life: constant after the first step
        self.log: list[tuple[str, int]] = []  # (action, layer) of the last step
        # tensor id -> state, pushed since the last flush: their copies to host are queued
        # together (flush_offloads) when the layer's forward ends
        self._pending: dict[int, _TensorState] = {}
        self.reloads: list[int] = []  # tensors in the order their reload copies were queued, last step
        self._read: list[int] = []  # tensors in the order the backward read them, this step
        # Set to a list to record, at every point of a step on CUDA, (point, bytes allocated
        # there, peak since the previous point): where in the step the peak falls. Resets
        # the allocator's peak counter at each point, so leave it off when measuring a peak.
        self.memory_trace: list[tuple[str, int, int]] | None = None
        self._phase: str | None = None
        # Set to a StepTimes to stamp every point of a step and every wait of the main stream
        # for a copy (what fitting the reload points measures); None costs nothing.
        self.times: StepTimes | None = None
        _SYNCHRONIZERS[self.id] = self

    def register(self, tensor: int, layer: int) -> None:
        self.tensors[tensor] = _TensorState(layer, tensor)
        self.layer_tensors.setdefault(layer, []).append(tensor)

    def set_reload_order(self, tensors: list[int]) -> None:
        """The order in which the backward first reads these tensors. A layer's reload copies
        them in that order, so its backward can start when the first one has landed instead of
        the last (the forward saves them in roughly the reverse order). The pass gives the
        backward graph's order; a compiler may schedule otherwise, so every step the order in
        which the backward actually read them replaces it for the next."""
        rank = {t: i for i, t in enumerate(tensors)}
        for layer, ids in self.layer_tensors.items():
            # only this backward's tensors move; those of other compiled graphs keep their places
            slots = [k for k, t in enumerate(ids) if t in rank]
            for k, t in zip(slots, sorted((ids[k] for k in slots), key=rank.get)):
                ids[k] = t

    @property
    def device(self) -> torch.device | None:
        """The device of the activations offloaded so far (None before the first)."""
        return self._transfers.device if self._transfers is not None else None

    @property
    def host_bytes(self) -> int:
        """Bytes of the host buffers held (pinned on CUDA), reused from step to step."""
        return sum(s.host.numel() * s.host.element_size() for s in self.tensors.values() if s.host is not None)

    def transfers(self, device: torch.device) -> _Transfers:
        if self._transfers is None or self._transfers.device != device:
            self._transfers = _Transfers(device)
        return self._transfers

    # --- called by the graph -----------------------------------------------------------------
    def push(self, tensor: int, x: torch.Tensor) -> torch.Tensor:
        state = self.tensors[tensor]
        if self._phase != "fwd":  # the first offload of a step
            self._new_step()
            self._phase = "fwd"
        if state.layer not in self.on_gpu:
            self.on_gpu.add(state.layer)
            self._count()
        t = self.transfers(x.device)
        if not is_dense(x):
            # a strided copy on the offload stream would launch kernels there; copy on the main stream
            state.restore = (tuple(x.shape), tuple(x.stride()))
            x = x.contiguous()
        else:
            state.restore = None
        if state.host is None or state.host.shape != x.shape or state.host.stride() != x.stride() or state.host.dtype != x.dtype:
            state.host = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu", pin_memory=t.cuda)
            self.pinned_allocations += 1
        state.gpu = x
        state.reload_started = False
        state.offloaded, state.copied = None, False
        if not self.schedule.manual:
            self._pending[tensor] = state
        self.log.append(("offload", state.layer))
        return x.new_empty((0,))

    def flush_offloads(self) -> None:
        """Queue the copies to host of the tensors pushed since the last flush as one group: one
        wait on the main stream and one event for the lot, rather than per tensor. Called when
        a layer's forward ends, and at every point before anything waits on those copies."""
        if self._pending:
            states, self._pending = list(self._pending.values()), {}
            self._copy_to_host(states)

    def at_point(self, p: int) -> None:
        self.flush_offloads()
        if self.times is not None:
            self.times.at(p)
        if self.memory_trace is not None and torch.cuda.is_available():
            device = self._transfers.device if self._transfers is not None else torch.device("cuda", torch.cuda.current_device())
            self.memory_trace.append((point_name(p, self.schedule.model_layers), torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)))
            torch.cuda.reset_peak_memory_stats(device)
        release, reload = self.schedule.actions_at(p)
        for layer in release:
            self.release_activation_forward_gpu_memory(layer)
        for layer in reload:
            self.start_reload_layer(layer)

    def pop(self, tensor: int, size: tuple | None = None, stride: tuple | None = None) -> torch.Tensor:
        self.flush_offloads()
        state = self.tensors[tensor]
        self._phase = "bwd"
        self._read.append(tensor)
        if not state.reload_started:
            self.start_reload_layer(state.layer)  # the schedule did not get there first: reload now
        t = self._transfers
        if state.gpu is None:
            raise RuntimeError(f"hostswap: activation {tensor} of layer {state.layer} was read twice in one backward")
        t.main_waits(state.reloaded, self.times)
        out = state.gpu
        if state.restore is not None:
            size, stride = state.restore
            out = torch.empty_strided(size, stride, dtype=out.dtype, device=out.device).copy_(out)
        if size is not None and (tuple(out.shape) != size or (out.numel() > 1 and tuple(out.stride()) != stride)):
            # the compiled backward was specialised for the layout the graph declared; a
            # compiler may have laid the buffer out otherwise in the forward
            out = torch.empty_strided(size, stride, dtype=out.dtype, device=out.device).copy_(out.view(size) if tuple(out.shape) != size else out)
        state.gpu = None  # the graph owns it now: freed after its last backward use
        if all(self.tensors[i].gpu is None for i in self.layer_tensors[state.layer]):
            self.on_gpu.discard(state.layer)
            self.log.append(("reloaded", state.layer))
        return out

    # --- the manual API (also what the automatic schedule calls) -----------------------------
    def start_offload_layer(self, layer: int) -> None:
        """Queue the copies to host of a layer whose tensors were saved (manual mode)."""
        states = [self.tensors[i] for i in self.layer_tensors.get(layer, [])]
        self._copy_to_host([s for s in states if s.gpu is not None and not s.copied])

    def _copy_to_host(self, states: list[_TensorState]) -> None:
        if not states:
            return
        events = self._transfers.copy_group([(s.gpu, s.host, s.tensor) for s in states], one_event=True)
        for state, event in zip(states, events):
            state.offloaded, state.copied = event, True
            self.bytes_offloaded += state.gpu.numel() * state.gpu.element_size()
        self.log.append(("offload copies", states[0].layer))

    def release_activation_forward_gpu_memory(self, layer: int) -> None:
        """Wait for the layer's copies to host, then drop the GPU references."""
        self.flush_offloads()
        t = self._transfers
        released = False
        waited = None
        for i in self.layer_tensors.get(layer, []):
            state = self.tensors[i]
            if state.gpu is None or not state.copied or state.reload_started:
                continue  # not offloaded (manual mode without start_offload_layer): stays
            if state.offloaded is not waited:  # a group's copies share one event
                t.main_waits(state.offloaded, self.times)
                waited = state.offloaded
            state.gpu = None
            released = True
        if released:
            self.on_gpu.discard(layer)
            self.log.append(("release", layer))

    def start_reload_layer(self, layer: int) -> None:
        """Allocate on the main stream and queue the copies to device on the offload stream,
        the layer's tensors as one group (one wait, one timed span)."""
        t = self._transfers
        group: list[_TensorState] = []
        for i in self.layer_tensors.get(layer, []):
            state = self.tensors[i]
            if state.reload_started:
                continue
            state.reload_started = True
            if state.gpu is not None:
                # never released: the GPU copy is still valid (manual mode, or no release point yet)
                state.reloaded = None
                continue
            if state.host is None or not state.copied:
                continue  # not saved this step (a layer that did not run): nothing to reload
            state.gpu = torch.empty_strided(state.host.shape, state.host.stride(), dtype=state.host.dtype, device=t.device)
            group.append(state)
        if group:
            events = t.copy_group([(state.host, state.gpu, state.tensor) for state in group], kind="reload")
            for state, event in zip(group, events):
                state.reloaded = event
                self.reloads.append(state.tensor)
            self.on_gpu.add(layer)
            self._count()
            self.log.append(("reload", layer))

    # --- bookkeeping ---------------------------------------------------------------------------
    def _new_step(self) -> None:
        if self._read:
            self.set_reload_order(self._read)
            self._read = []
        self.bytes_offloaded = 0
        self._pending = {}
        if self._transfers is not None:
            self._transfers.timed = []
        self.log = []
        self.reloads = []
        self.on_gpu = set()

    def transfer_seconds(self) -> dict[int, float]:
        """Tensor id -> seconds its copies to host and back took in the last step."""
        return self._transfers.seconds_by_tag() if self._transfers is not None else {}

    def layer_bytes(self) -> dict[int, int]:
        """Layer -> bytes of its activations offloaded in the last step (what its reload brings back)."""
        out: dict[int, int] = {}
        for state in self.tensors.values():
            if state.copied and state.host is not None:
                out[state.layer] = out.get(state.layer, 0) + state.host.numel() * state.host.element_size()
        return out

    def reload_seconds(self) -> dict[int, float]:
        """Layer -> seconds its copies back to the device took in the last step."""
        out: dict[int, float] = {}
        if self._transfers is not None:
            for tensor, seconds in self._transfers.seconds_by_tag("reload").items():
                layer = self.tensors[tensor].layer
                out[layer] = out.get(layer, 0.0) + seconds
        return out

    def _count(self) -> None:
        self.max_offloaded_layers_on_gpu = max(self.max_offloaded_layers_on_gpu, len(self.on_gpu))

    def close(self) -> None:
        _SYNCHRONIZERS.pop(self.id, None)
