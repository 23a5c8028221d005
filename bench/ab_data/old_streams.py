class _Streams:
    """Copy stream, per-kernel release events and the waits between them; no-ops on CPU."""

    def __init__(self, device: torch.device, num_kernels: int, measure_stalls: bool = True):
        self.cuda = device.type == "cuda"
        self.device = device
        self.measure_stalls = measure_stalls and self.cuda
        self._stall_pairs: list[tuple] = []
        self.copy_stream = None  # CPU: copies are synchronous
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.kernel_events = [torch.cuda.Event() for _ in range(num_kernels)]
            # timed: the pool reads the last forward's copy span and compute tail from them
            self.forward_start = torch.cuda.Event(enable_timing=True)
            self.copies_done = torch.cuda.Event(enable_timing=True)
            self.forward_end = torch.cuda.Event(enable_timing=True)
            self._timed = False  # a whole forward has recorded all three

    @property
    def compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def begin_forward(self) -> None:
        if self.cuda:
            # Copies of this forward may overwrite what the previous one's kernels still read.
            self.forward_start.record(self.compute_stream)
            self.copy_stream.wait_event(self.forward_start)
            self._timed = False  # until this forward ends: a failed one leaves no timing behind

    def end_forward(self) -> None:
        if self.cuda:
            self.copies_done.record(self.copy_stream)
            self.compute_stream.wait_event(self.copies_done)
            self.forward_end.record(self.compute_stream)
            self._timed = not torch.cuda.is_current_stream_capturing()

    def last_forward_times(self) -> tuple[float, float] | None:
        """(seconds from the start of the last forward to its last copy, seconds its kernels ran
        after that copy), or None while that forward is still running (or none was timed).
        Read before the next begin_forward records its start."""
        if not (self.cuda and self._timed and self.forward_end.query()):
            return None
        return self.forward_start.elapsed_time(self.copies_done) / 1e3, self.copies_done.elapsed_time(self.forward_end) / 1e3

    def kernel_launched(self, kernel: int) -> None:
        if self.cuda:
            self.kernel_events[kernel].record(self.compute_stream)

    def copy_waits_for_kernel(self, kernel: int) -> None:
        if self.cuda and kernel >= 0:
            self.copy_stream.wait_event(self.kernel_events[kernel])

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        """Host-to-device copy on the copy stream; returns its completion event (None on CPU)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return event

    def compute_waits(self, event) -> None:
        if event is None:
            return
        if self.measure_stalls and not torch.cuda.is_current_stream_capturing() and not event.query():
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(self.compute_stream)
            self.compute_stream.wait_event(event)
            after.record(self.compute_stream)
            self._stall_pairs.append((before, after))
        else:
            self.compute_stream.wait_event(event)

    def collect_stalls(self) -> float:
        if not self._stall_pairs:
            return 0.0
        torch.cuda.synchronize(self.device)
        seconds = sum(b.elapsed_time(a) for b, a in self._stall_pairs) / 1e3
        self._stall_pairs.clear()
        return seconds


