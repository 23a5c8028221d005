"""The pool's _Streams before its host calls were cut (bench/ab_host_calls.py): every call
goes through torch (current_stream per call, a torch.cuda.stream switch and copy_ per copy,
a new completion event per copy, new stall timing events per stall).

Executed in runtime/pool.py's namespace (torch, _Streams); only what differs is here.
"""


class TorchCallStreams(_Streams):  # noqa: F821
    @property
    def compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def begin_forward(self) -> None:
        if self.cuda:
            self._compute = self.compute_stream
            self._capturing = torch.cuda.is_current_stream_capturing()
            self.forward_start.record(self.compute_stream)
            self.copy_stream.wait_event(self.forward_start)
            self._timed = False

    def kernel_launched(self, kernel: int) -> None:
        if self.cuda:
            self.kernel_events[kernel].record(self.compute_stream)

    def copy(self, dst, src, event=None):
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
