"""``OffloadAdamW``: AdamW whose moments (and, with ``offload_master``, fp32 master weights) live
in host memory, updated on the device chunk by chunk.

For a model whose optimizer state does not fit beside it on the GPU. Each ``step()`` walks
the parameters in chunks of about ``chunk_bytes`` of state: chunk i+1's state is copied to
the device on a host-to-device stream while chunk i is updated on the compute stream and
chunk i-1's new state goes back on a device-to-host stream (the link's two directions at
once). The update runs PyTorch's own AdamW arithmetic (``torch.optim.adamw.adamw``,
single-tensor), and each bf16/fp16 working weight is refreshed from its fp32 master. Device
memory held between steps: none; during a step: at most three chunks of state (coming in,
being updated, going out). Host state is pinned on CUDA, so the copies are asynchronous DMA.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.optim import Optimizer
from torch.optim.adamw import adamw

_STATE = ("exp_avg", "exp_avg_sq")


class OffloadAdamW(Optimizer):
    """AdamW with its state in host memory; see the module docstring.

    ``offload_master=True``: parameters that are not fp32 get an fp32 master copy in host
    memory, updated in fp32 and written back to the working weight after each step (the
    usual mixed-precision recipe); without it they are updated in their own dtype, like
    ``torch.optim.AdamW``. ``chunk_bytes``: host state per chunk (default 64 MiB).
    ``stats``: steps, bytes copied each way, seconds in ``step()``, and ``host_bytes`` (the
    state held in host memory, pinned on CUDA).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, offload_master: bool = False, chunk_bytes: int = 64 * 2**20):
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

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for state in self.state.values() for name, t in state.items()
                   if name != "step" and isinstance(t, torch.Tensor))

    # --- state ---------------------------------------------------------------------------------
    def _has_master(self, p: torch.Tensor) -> bool:
        return self.offload_master and p.dtype != torch.float32

    def _host_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            dtype = torch.float32 if self._has_master(p) else p.dtype
            host = lambda: torch.zeros(p.shape, dtype=dtype, pin_memory=self._pin)
            state["step"] = torch.tensor(0.0)
            state["exp_avg"], state["exp_avg_sq"] = host(), host()
            if self._has_master(p):
                state["master"] = torch.empty(p.shape, dtype=torch.float32, pin_memory=self._pin)
                state["master"].copy_(p.detach())
        return state

    def _chunks(self):
        """(group, [params]) runs of about ``chunk_bytes`` of host state, in parameter order."""
        for group in self.param_groups:
            chunk, size = [], 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("OffloadAdamW does not support sparse gradients")
                chunk.append(p)
                size += p.numel() * (12 if self._has_master(p) else 2 * p.element_size())
                if size >= self.chunk_bytes:
                    yield group, chunk
                    chunk, size = [], 0
            if chunk:
                yield group, chunk

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
    def _to_device(self, params: list[torch.Tensor]) -> tuple[dict, object]:
        """Device copies of the chunk's state (issued on the host-to-device stream), and their event."""
        names = lambda p: _STATE + (("master",) if self._has_master(p) else ())
        stream = self._h2d_stream
        compute = torch.cuda.current_stream(self.device) if stream is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                stream.wait_stream(compute)  # the gradients, and the buffers' previous readers
            copies = {}
            for p in params:
                state = self._host_state(p)
                copies[p] = {n: state[n].to(self.device, non_blocking=True) for n in names(p)}
                if stream is not None:
                    for t in copies[p].values():
                        # made on the host-to-device stream, read and written on the compute stream: its
                        # memory goes to no later allocation before the update is done
                        t.record_stream(compute)
                self.stats["bytes_h2d"] += sum(t.numel() * t.element_size() for t in copies[p].values())
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
        return copies, event

    def _update(self, group: dict, params: list[torch.Tensor], copies: dict) -> None:
        beta1, beta2 = group["betas"]
        targets, grads, avgs, avg_sqs, steps = [], [], [], [], []
        for p in params:
            state, device = self.state[p], copies[p]  # adamw advances state["step"]
            master = device.get("master")
            targets.append(master if master is not None else p.detach())
            grads.append(p.grad.float() if master is not None else p.grad)
            avgs.append(device["exp_avg"])
            avg_sqs.append(device["exp_avg_sq"])
            steps.append(state["step"])
        adamw(targets, grads, avgs, avg_sqs, [], steps, foreach=False, fused=False, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for p in params:
            master = copies[p].get("master")
            if master is not None:
                p.detach().copy_(master)  # the working weight from the fp32 master

    def _to_host(self, params: list[torch.Tensor], copies: dict) -> None:
        stream = self._d2h_stream
        compute = torch.cuda.current_stream(self.device) if stream is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                stream.wait_stream(compute)  # after the update
            for p in params:
                state = self.state[p]
                for name, device_tensor in copies[p].items():
                    state[name].copy_(device_tensor, non_blocking=True)
                    if stream is not None:
                        device_tensor.record_stream(stream)  # freed for reuse only after the copy
                    self.stats["bytes_d2h"] += device_tensor.numel() * device_tensor.element_size()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = time.perf_counter()
        chunks = list(self._chunks())
        ahead = self._to_device(chunks[0][1]) if chunks else None
        for i, (group, params) in enumerate(chunks):
            copies, ready = ahead
            # the next chunk's state comes in while this one is updated: two chunks on the device
            ahead = self._to_device(chunks[i + 1][1]) if i + 1 < len(chunks) else None
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            self._update(group, params, copies)
            self._to_host(params, copies)
        if self._d2h_stream is not None:
            self._d2h_stream.synchronize()  # host state is the truth once step() returns
        self.stats["steps"] += 1
        self.stats["host_bytes"] = self.host_bytes
        self.stats["seconds"] += time.perf_counter() - t
        return loss
