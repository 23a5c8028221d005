"""The pool's _Streams as tried in 750bc14/6b6ddcf and reverted (bench/ab_host_calls.py).

Executed in runtime/pool.py's namespace (torch, _Streams); only what differs from the
committed _Streams is here: the copy is one cudaMemcpyAsync, the compute stream is looked up
once per forward, callers may pass a reusable completion event, and stall timing events are
reused once read.
"""


class HostCallStreams(_Streams):  # noqa: F821
    def __init__(self, device, num_kernels: int, measure_stalls: bool = True):
        super().__init__(device, num_kernels, measure_stalls)
        self._stall_free: list[tuple] = []  # read ones, for reuse
        self._stall_seconds = 0.0  # read from completed pairs, not yet collected
        self._compute = None
        self._capturing = False
        if self.cuda:
            from hostswap.runtime.ptd import _cudart

            self._cudart = _cudart()
            self._h2d = self._cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
            self._copy_handle = self.copy_stream.cuda_stream

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

    def compute_waits(self, event) -> None:
        if event is None:
            return
        compute = self._compute
        if self.measure_stalls and not self._capturing and not event.query():
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
