"""The one owner of the weight pools' streams and events.

A pool copies weights on its own copy stream and the program's kernels run on the compute
stream. Memory may be reused only behind an event recorded after the last kernel that read
it, and a kernel may read a weight only behind the event of its copy. Every stream, every
event and every wait between them is made here; the pools only say which kernel or copy.
"""

from __future__ import annotations

import torch

from hostswap.runtime.ptd import _cudart


class CopyStreams:
    """Copy stream, per-kernel release events and the waits between them; no-ops on CPU.

    The calls here run once per probe or kernel on the host, and in a forward that copies
    bound the host leads the GPU only by what it saves: a copy issued late is a copy engine
    idle (prefetch depth 0 issues each copy at its own probe). So: the compute stream is looked
    up once per forward, a copy is one cudaMemcpyAsync on the copy stream (no stream switch,
    no dispatch), callers may pass a reusable completion event, and the timing events that
    measure stalls are reused once read.
    """

    def __init__(self, device: torch.device, num_kernels: int):
        self.cuda = device.type == "cuda"
        self.device = device
        self._stall_pairs: list[tuple] = []  # (before, after) timing events, recorded, unread
        self._stall_free: list[tuple] = []  # read ones, for reuse
        self._stall_seconds = 0.0  # read from completed pairs, not yet collected
        self.copy_stream = None  # CPU: copies are synchronous
        self._compute = None
        self._capturing = False
        if self.cuda:
            self._cudart = _cudart()
            self._h2d = self._cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
            self.copy_stream = torch.cuda.Stream(device)
            self._copy_handle = self.copy_stream.cuda_stream
            self.kernel_events = [torch.cuda.Event() for _ in range(num_kernels)]
            # timed: the pool reads the last forward's copy span and compute tail from them
            self.forward_start = torch.cuda.Event(enable_timing=True)
            self.copies_done = torch.cuda.Event(enable_timing=True)
            self.forward_end = torch.cuda.Event(enable_timing=True)
            self._timed = False  # a whole forward has recorded all three

    @property
    def compute_stream(self):
        """The stream the current forward runs on (looked up at begin_forward)."""
        return self._compute if self._compute is not None else torch.cuda.current_stream(self.device)

    def begin_forward(self) -> None:
        if self.cuda:
            self._compute = torch.cuda.current_stream(self.device)
            self._capturing = torch.cuda.is_current_stream_capturing()
            if not self._capturing:  # an event query would invalidate a capture
                self._read_stalls(wait=False)
            # Copies of this forward may overwrite what the previous one's kernels still read.
            self.forward_start.record(self._compute)
            self.copy_stream.wait_event(self.forward_start)
            self._timed = False  # until this forward ends: a failed one leaves no timing behind

    def end_forward(self) -> None:
        if self.cuda:
            self.copies_done.record(self.copy_stream)
            self._compute.wait_event(self.copies_done)
            self.forward_end.record(self._compute)
            self._timed = not self._capturing

    def last_forward_times(self) -> tuple[float, float] | None:
        """(seconds from the start of the last forward to its last copy, seconds its kernels ran
        after that copy), or None while that forward is still running (or none was timed).
        Read before the next begin_forward records its start."""
        if not (self.cuda and self._timed and self.forward_end.query()):
            return None
        return self.forward_start.elapsed_time(self.copies_done) / 1e3, self.copies_done.elapsed_time(self.forward_end) / 1e3

    def kernel_launched(self, kernel: int) -> None:
        if self.cuda:
            self.kernel_events[kernel].record(self._compute)

    def copy_waits_for_kernel(self, kernel: int) -> None:
        if self.cuda and kernel >= 0:
            self.copy_stream.wait_event(self.kernel_events[kernel])

    def copy(self, dst: torch.Tensor, src: torch.Tensor, event=None):
        """Host-to-device copy on the copy stream; returns its completion event (None on CPU),
        ``event`` if one is given (re-recorded: the caller no longer waits on its last record)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        if dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.numel() == src.numel():
            (err,) = self._cudart.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), self._h2d, self._copy_handle)
            if err != self._cudart.cudaError_t.cudaSuccess:
                self._cudart.cudaGetLastError()
                _, name = self._cudart.cudaGetErrorName(err)
                raise RuntimeError(f"cudaMemcpyAsync of {src.numel() * src.element_size()} bytes to {self.device} failed: {name.decode()}")
        else:
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(src, non_blocking=True)
        if event is None:
            event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event

    def completion_events(self, keys) -> dict:
        """One reusable copy-completion event per key (none on CPU, where copies are synchronous)."""
        return {k: torch.cuda.Event() for k in keys} if self.cuda else {}

    def compute_waits(self, event) -> None:
        if event is None:
            return
        compute = self._compute
        if not self._capturing and not event.query():
            before, after = self._stall_free.pop() if self._stall_free else (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            before.record(compute)
            compute.wait_event(event)
            after.record(compute)
            self._stall_pairs.append((before, after))
        else:
            compute.wait_event(event)

    def _read_stalls(self, wait: bool) -> None:
        """Add the stall time of recorded pairs that have completed (all, after a synchronise
        when ``wait``) and free them for reuse."""
        if not self._stall_pairs:
            return
        if wait:
            torch.cuda.synchronize(self.device)
        pending = []
        for before, after in self._stall_pairs:
            if wait or after.query():
                self._stall_seconds += before.elapsed_time(after) / 1e3
                self._stall_free.append((before, after))
            else:
                pending.append((before, after))
        self._stall_pairs = pending

    def collect_stalls(self) -> float:
        self._read_stalls(wait=True)
        seconds, self._stall_seconds = self._stall_seconds, 0.0
        return seconds
