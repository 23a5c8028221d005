"""``OffloadAdamW``: AdamW whose moments (and, with ``offload_master``, fp32 master weights) live
in host memory, updated on the device chunk by chunk.

For a model whose optimizer state does not fit beside it on the GPU. Each ``step()`` walks
the parameters in chunks of at most ``chunk_bytes`` of state (a larger parameter in slices:
AdamW is elementwise). Three device buffers of one chunk each rotate: chunk i+1's state comes
in on a host-to-device stream while chunk i is updated on the compute stream and chunk i-1's
new state goes back on a device-to-host stream, the link's two directions at once. The
streams order themselves with events, so the host never waits inside the step, and the
device memory a step holds is three chunks and the update's temporaries whatever the model's
size. The update is PyTorch's own AdamW arithmetic (``torch.optim.adamw.adamw``,
single-tensor), and each bf16/fp16 working weight is refreshed from its fp32 master. Nothing
stays on the device between steps. Parameters sharded by FSDP2 (``fully_shard``: DTensors)
are updated shard by shard: each rank keeps only its shard's moments and masters. Host state
is pinned on CUDA, so the copies are asynchronous DMA.

``offload_grads=True`` moves each gradient to pinned host memory as soon as it is made (after
FSDP2's reduce-scatter, for a sharded parameter: its rank's shard) and drops the device copy,
so gradients do not pile up on the GPU through the backward; the step brings each chunk's
gradients in with its state. The copy runs on a stream of its own, after the stream that made
the gradient (FSDP2's reduce-scatter stream); the gradient's memory is reused only after the
copy has read it, and the step's copies wait on its event, never the host.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.adamw import adamw


class OffloadAdamW(Optimizer):
    """AdamW with its state in host memory; see the module docstring.

    ``offload_master=True``: parameters that are not fp32 get an fp32 master copy in host
    memory, updated in fp32 and written back to the working weight after each step (the
    usual mixed-precision recipe); without it they are updated in their own dtype, like
    ``torch.optim.AdamW``. ``chunk_bytes``: host state per chunk (default 64 MiB).
    ``offload_grads``: keep gradients in host memory from the moment they are made (see the
    module docstring); a second backward before ``step()`` adds to them on the host.
    ``stats``: steps, bytes copied each way, seconds in ``step()``, and ``host_bytes`` (the
    state and gradients held in host memory, pinned on CUDA).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, offload_master: bool = False, offload_grads: bool = False, chunk_bytes: int = 64 * 2**20):
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.offload_master = bool(offload_master)
        self.chunk_bytes = chunk_bytes
        self.stats = {"steps": 0, "bytes_h2d": 0, "bytes_d2h": 0, "seconds": 0.0, "host_bytes": 0}
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"OffloadAdamW updates parameters of one device; these are on {sorted(map(str, devices))}")
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self._pin = self.device.type == "cuda"
        # one stream per direction: the next chunk's state comes in while the previous chunk's
        # goes out, on the link's two directions at once
        self._h2d_stream = torch.cuda.Stream(self.device) if self._pin else None
        self._d2h_stream = torch.cuda.Stream(self.device) if self._pin else None
        self.offload_grads = bool(offload_grads)
        self._host_grads: dict[torch.Tensor, torch.Tensor] = {}  # param -> its gradient (local shard) in host memory
        self._grad_stream = torch.cuda.Stream(self.device) if self._pin and self.offload_grads else None
        self._grads_held: dict[torch.Tensor, torch.cuda.Event | None] = {}  # params whose host gradient is this step's -> copy's event
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_to_host)
                       for g in self.param_groups for p in g["params"] if p.requires_grad] if self.offload_grads else []

    @property
    def host_bytes(self) -> int:
        state = sum(t.numel() * t.element_size() for state in self.state.values() for name, t in state.items()
                    if name != "step" and isinstance(t, torch.Tensor))
        return state + sum(t.numel() * t.element_size() for t in self._host_grads.values())

    # --- gradients to the host (offload_grads) -------------------------------------------------
    @torch.no_grad()
    def _gradient_to_host(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``p``'s gradient (its local shard) to host memory, the
        device copy dropped."""
        grad = _local(p.grad)
        host = self._host_grads.get(p)
        if host is None:
            host = self._host_grads[p] = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self._pin)
        if p in self._grads_held:  # another backward before the step: the sum, on the host
            event = self._grads_held[p]
            if event is not None:
                event.synchronize()
            host.add_(grad.to("cpu"))
        elif self._grad_stream is not None:
            made = torch.cuda.current_stream(self.device)  # FSDP2 runs the hook on its reduce-scatter stream
            self._grad_stream.wait_stream(made)
            with torch.cuda.stream(self._grad_stream):
                host.copy_(grad, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._grad_stream)
            grad.record_stream(self._grad_stream)  # its memory is not reused before the copy has read it
            self._grads_held[p] = event
            self.stats["bytes_d2h"] += grad.numel() * grad.element_size()
        else:
            host.copy_(grad)
            self._grads_held[p] = None
        p.grad = None

    def remove_hooks(self) -> None:
        """Stop moving gradients to the host (``offload_grads``): they stay on ``.grad`` again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # --- state ---------------------------------------------------------------------------------
    def _has_master(self, p: torch.Tensor) -> bool:
        return self.offload_master and p.dtype != torch.float32

    def _host_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            dtype = torch.float32 if self._has_master(p) else p.dtype
            shape = _local(p).shape  # a sharded parameter's state is its rank's shard's
            host = lambda: torch.zeros(shape, dtype=dtype, pin_memory=self._pin)
            state["step"] = torch.tensor(0.0)
            state["exp_avg"], state["exp_avg_sq"] = host(), host()
            if self._has_master(p):
                state["master"] = torch.empty(shape, dtype=torch.float32, pin_memory=self._pin)
                state["master"].copy_(_local(p).detach())
        return state

    def _moved(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The host tensors of ``p`` that a step brings to the device: its state, and its
        gradient where it was offloaded."""
        moved = {name: t for name, t in self.state[p].items() if name in _MOVED}
        if p in self._grads_held:
            moved[GRAD] = self._host_grads[p]
        return moved

    def _pieces(self, p: torch.Tensor):
        """(start, stop) element ranges of ``p``, each of at most ``chunk_bytes`` of state.
        AdamW is elementwise, so a slice updates exactly as the whole; a parameter that is not
        contiguous (its slices would not be views) stays whole."""
        moved = list(self._moved(p).values())
        p = _local(p)
        n = p.numel()
        if not p.is_contiguous():
            yield 0, n
            return
        per_tensor = self.chunk_bytes // len(moved)
        step = max(1, (per_tensor // _ALIGN * _ALIGN or per_tensor) // max(t.element_size() for t in moved))
        for a in range(0, n, step):
            yield a, min(n, a + step)

    def _chunks(self) -> list[tuple[dict, list[tuple]]]:
        """(group, [(param, start, stop)]) runs of at most ``chunk_bytes`` of host state (or one
        piece, where a non-contiguous parameter is larger), in parameter order."""
        chunks = []
        for group in self.param_groups:
            chunk, size = [], 0
            for p in group["params"]:
                if p.grad is None and p not in self._grads_held:
                    continue
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("OffloadAdamW does not support sparse gradients")
                self._host_state(p)
                moved = self._moved(p)
                for a, b in self._pieces(p):
                    nbytes = _layout_bytes(moved, b - a)
                    if chunk and size + nbytes > self.chunk_bytes:
                        chunks.append((group, chunk))
                        chunk, size = [], 0
                    chunk.append((p, a, b))
                    size += nbytes
            if chunk:
                chunks.append((group, chunk))
        return chunks

    def load_state_dict(self, state_dict: dict) -> None:
        # torch.optim casts loaded state to each parameter's device and dtype; here it stays in
        # host memory in its own dtype (fp32 moments and masters of bf16 weights).
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for name, value in saved.get(i, {}).items():
                if name != "step" and isinstance(value, torch.Tensor):
                    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=self._pin)
                    self.state[p][name] = host.copy_(value)

    # --- the step ------------------------------------------------------------------------------
    def _views(self, buffer: torch.Tensor, chunk: list[tuple]) -> list[dict]:
        """Per piece of ``chunk``, its state names -> views of ``buffer`` (aligned, packed)."""
        views, offset = [], 0
        for p, a, b in chunk:
            state, piece = self._moved(p), {}
            for name in _MOVED_IN:
                if name in state:
                    t = state[name]
                    nbytes = (b - a) * t.element_size()
                    piece[name] = buffer[offset:offset + nbytes].view(t.dtype)
                    if not _local(p).is_contiguous():
                        piece[name] = piece[name].view(t.shape)
                    offset += _aligned(nbytes)
            views.append(piece)
        return views

    def _update(self, group: dict, chunk: list[tuple], views: list[dict], step_of: dict) -> None:
        beta1, beta2 = group["betas"]
        targets, grads, avgs, avg_sqs, steps = [], [], [], [], []
        for (p, a, b), device in zip(chunk, views):
            master, local = device.get("master"), _local(p)
            grad = device[GRAD] if GRAD in device else _piece(_local(p.grad), local, a, b)
            targets.append(master if master is not None else _piece(local.detach(), local, a, b))
            grads.append(grad.float() if master is not None else grad)
            avgs.append(device["exp_avg"])
            avg_sqs.append(device["exp_avg_sq"])
            steps.append(step_of[p].clone())  # adamw advances it; every piece sees the same step
        adamw(targets, grads, avgs, avg_sqs, [], steps, foreach=False, fused=False, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for (p, a, b), device in zip(chunk, views):
            master = device.get("master")
            if master is not None:  # the working weight from the fp32 master
                local = _local(p)
                _piece(local.detach(), local, a, b).copy_(master)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = time.perf_counter()
        chunks = self._chunks()
        step_of = {p: self.state[p]["step"].clone() for _, chunk in chunks for p, _, _ in chunk}
        cuda = self._h2d_stream is not None
        compute = torch.cuda.current_stream(self.device) if cuda else None
        capacity = max((sum(_layout_bytes(self._moved(p), b - a) for p, a, b in chunk) for _, chunk in chunks), default=0)
        # Three fixed buffers: chunk i+1 comes in while chunk i is updated and chunk i-1 goes
        # out; chunk i reuses the buffer of chunk i-3 once that one's copy out is done. The
        # streams wait on events, so the host never blocks, and the device memory is bounded.
        buffers = [torch.empty(capacity, dtype=torch.uint8, device=self.device) for _ in range(min(3, len(chunks)))]
        gone: list = [None] * len(buffers)  # per buffer: the event of its last copy out
        stream = lambda s: torch.cuda.stream(s) if cuda else contextlib.nullcontext()  # noqa: E731
        if cuda:
            self._h2d_stream.wait_stream(compute)  # the buffers were allocated on the compute stream
        for i, (group, chunk) in enumerate(chunks):
            slot = i % len(buffers)
            views = self._views(buffers[slot], chunk)
            with stream(self._h2d_stream):
                if gone[slot] is not None:
                    self._h2d_stream.wait_event(gone[slot])
                for (p, a, b), piece in zip(chunk, views):
                    local, moved = _local(p), self._moved(p)
                    if self._grads_held.get(p) is not None:
                        self._h2d_stream.wait_event(self._grads_held[p])  # its gradient has reached the host
                    for name, view in piece.items():
                        view.copy_(_piece(moved[name], local, a, b), non_blocking=True)
                        self.stats["bytes_h2d"] += view.numel() * view.element_size()
                arrived = torch.cuda.Event() if cuda else None
                if cuda:
                    arrived.record(self._h2d_stream)
            if cuda:
                compute.wait_event(arrived)
            self._update(group, chunk, views, step_of)
            with stream(self._d2h_stream):
                if cuda:
                    self._d2h_stream.wait_stream(compute)  # after the update
                for (p, a, b), piece in zip(chunk, views):
                    local = _local(p)
                    for name, view in piece.items():
                        if name == GRAD:
                            continue  # read, not changed
                        _piece(self.state[p][name], local, a, b).copy_(view, non_blocking=True)
                        self.stats["bytes_d2h"] += view.numel() * view.element_size()
                if cuda:
                    gone[slot] = torch.cuda.Event()
                    gone[slot].record(self._d2h_stream)
        for p, step in step_of.items():
            self.state[p]["step"] = step + 1
        self._grads_held.clear()  # the next backward's gradients overwrite the host copies
        if cuda:
            self._d2h_stream.synchronize()  # host state is the truth once step() returns; the buffers are free
        del buffers
        self.stats["steps"] += 1
        self.stats["host_bytes"] = self.host_bytes
        self.stats["seconds"] += time.perf_counter() - t
        return loss


_MOVED = ("exp_avg", "exp_avg_sq", "master")  # the state that goes to the device and back
GRAD = "grad"  # an offloaded gradient: to the device only
_MOVED_IN = (*_MOVED, GRAD)
_ALIGN = 512  # bytes between the views of one buffer


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's (or gradient's) own elements: its rank's shard where it is a DTensor
    (FSDP2's ``fully_shard``), whose in-place updates are the parameter's."""
    return t.to_local() if isinstance(t, DTensor) else t


def _piece(t: torch.Tensor, p: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Elements a..b of ``t`` (``p``, its gradient, or its state) flattened, or ``t`` whole where
    ``p`` is not contiguous (it is then one piece). A non-contiguous gradient of a contiguous
    parameter is read through a contiguous copy."""
    return t if not p.is_contiguous() else t.reshape(-1)[a:b]


def _layout_bytes(moved: dict, elements: int) -> int:
    return sum(_aligned(elements * moved[name].element_size()) for name in _MOVED_IN if name in moved)
