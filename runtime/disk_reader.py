"""The disk tier's reader: weights read from the ``.ptd`` ahead of their copies, into a ring of
pinned staging memory.

The plan (schedules/tiers.py) fixes the disk reads of a forward, in fill order; forwards repeat
it, so the reader reads that sequence cyclically and runs ahead of the pool by as much as the
staging ring holds. Each read goes to a thread pool in chunks, so several requests are in flight
at the disk at once. The file is opened a second time, through the mapping's own descriptor
(the same file even if the path was replaced since), with ``O_DIRECT`` where the filesystem
takes it: the reads bypass the page cache, which would otherwise fill RAM with the very bytes
the budget keeps out of it. Where it does not, reads are buffered and the pages are
dropped after each read.

Ring space is handed out in read order and given back in the same order, each region once the
host-to-device copy out of it has completed (its event): a region is never refilled while a
copy still reads it. The pool takes each read in the sequence's order; a take out of order (a
forward abandoned part-way) drops what was read ahead and starts again from the fill asked for.
"""

from __future__ import annotations

import collections
import concurrent.futures
import mmap
import os
import time

import torch

from hostswap.runtime.ptd import PtdFile, file_identity, register_host_memory, unregister_host_memory
from hostswap.schedules.artifacts import ArtifactError
from hostswap.schedules.tiers import DIRECT_ALIGNMENT

# One request to the disk: large enough to stream, small enough that a read is split across threads.
CHUNK_BYTES = 8 << 20
READER_THREADS = 4


class StagingRing:
    """Regions of one buffer handed out and given back in FIFO order."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.head = 0  # where the next region starts, if it fits there
        self.regions: collections.deque = collections.deque()  # [start, end, released, event], oldest first

    def allocate(self, nbytes: int) -> int | None:
        """The start of a free region of ``nbytes`` (aligned), or None while the ring is full."""
        self.reclaim()
        if not self.regions:
            self.head = 0
            return self._take(0, nbytes) if nbytes <= self.capacity else None
        tail = self.regions[0][0]
        if self.head > tail:  # live bytes are [tail, head): room after head, or wrap to [0, tail)
            if self.head + nbytes <= self.capacity:
                return self._take(self.head, nbytes)
            return self._take(0, nbytes) if nbytes <= tail else None
        return self._take(self.head, nbytes) if self.head + nbytes <= tail else None  # wrapped

    def _take(self, start: int, nbytes: int) -> int:
        self.regions.append([start, start + nbytes, False, None])
        self.head = start + nbytes
        return start

    def release(self, start: int, event) -> None:
        """The region at ``start`` is free once ``event`` (None: now) has completed."""
        for region in self.regions:
            if region[0] == start and not region[2]:
                region[2], region[3] = True, event
                return
        raise KeyError(start)

    def reclaim(self) -> None:
        while self.regions and self.regions[0][2] and (self.regions[0][3] is None or self.regions[0][3].query()):
            self.regions.popleft()

    def wait_oldest(self) -> bool:
        """Block until the oldest released region's copy is done; False if none is released."""
        if not self.regions or not self.regions[0][2]:
            return False
        if self.regions[0][3] is not None:
            self.regions[0][3].synchronize()
        self.reclaim()
        return True

    def clear(self) -> None:
        self.regions.clear()
        self.head = 0


class _Read:
    """One weight's read in flight: its place in the ring and the chunks' futures."""

    __slots__ = ("index", "start", "skip", "nbytes", "futures")

    def __init__(self, index: int, start: int, skip: int, nbytes: int, futures: list):
        self.index, self.start, self.skip, self.nbytes, self.futures = index, start, skip, nbytes, futures


class DiskReader:
    """Reads a fixed cycle of weights (``(fqn, offset, nbytes)``) from ``ptd``'s file into staging."""

    def __init__(self, ptd: PtdFile, sequence: list[tuple[str, int, int]], staging_bytes: int, pinned: bool, threads: int = READER_THREADS,
                 direct: bool = True, device=None):
        # ``direct=False``: buffered reads even where O_DIRECT is taken. ``pinned``: staging
        # registered with CUDA for copies to ``device``.
        self._device = device
        self.sequence = sequence
        self.path = ptd.path
        self._identity = ptd.identity
        self.mode, self._fd = open_for_reads(ptd.fileno(), direct)
        self._pinned = False
        try:
            if os.fstat(self._fd).st_ino != os.fstat(ptd.fileno()).st_ino:
                raise ArtifactError(self.path, "file", "was replaced between mapping it and opening it for disk reads; load it again")
            # anonymous pages: page-aligned (O_DIRECT's buffer alignment) and of the exact size
            self._buffer = mmap.mmap(-1, max(staging_bytes, DIRECT_ALIGNMENT))
            self.staging = torch.frombuffer(self._buffer, dtype=torch.uint8)
            if pinned:
                register_host_memory(self.staging.data_ptr(), len(self._buffer), what=f"the {len(self._buffer)}-byte staging ring of {self.path}")
                self._pinned = True
        except BaseException:
            os.close(self._fd)
            raise
        self.ring = StagingRing(len(self._buffer))
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="hostswap-disk")
        self._pending: collections.deque[_Read] = collections.deque()
        self._next = 0  # sequence index of the next read to submit
        self._taken: set[int] = set()  # ring starts of reads taken and not yet released
        self.bytes_read = 0
        self.wait_seconds = 0.0  # time the pool waited for a read
        self.restarts = 0

    @property
    def staging_bytes(self) -> int:
        return len(self._buffer)

    # --- the pool's side ----------------------------------------------------------------------
    def ready(self, index: int) -> bool:
        """Whether read ``index`` is the next one and has been read: ``take`` would not wait.
        Submits what the ring has room for, so the pool's polls keep the reads going."""
        self._submit()
        return bool(self._pending) and self._pending[0].index == index and all(f.done() for f in self._pending[0].futures)

    def take(self, index: int) -> tuple[torch.Tensor, int]:
        """The bytes of read ``index`` of the sequence, once read, and the ring region to
        ``release`` when the copy out of it has been issued."""
        t = time.perf_counter()
        if self._pending and self._pending[0].index != index:
            self._restart(index)
        elif not self._pending:
            self._next = index
        self._submit()
        while not self._pending:  # the ring is full of copies not yet done
            if not self.ring.wait_oldest():
                raise RuntimeError(f"disk reader of {self.path}: the staging ring ({self.staging_bytes} bytes) cannot hold read {index}")
            self._submit()
        read = self._pending.popleft()
        try:
            for f in read.futures:
                f.result()
        except BaseException:
            _stop([read])  # every chunk of this read stops before its region is handed out again
            self._restart(None)
            raise
        self.wait_seconds += time.perf_counter() - t
        self.bytes_read += read.nbytes
        self._taken.add(read.start)
        self._submit()
        return self.staging[read.start + read.skip : read.start + read.skip + read.nbytes], read.start

    def release(self, region: int, event) -> None:
        """The copy out of ``region`` was issued; it may be refilled after ``event`` (None: now)."""
        self._taken.discard(region)
        self.ring.release(region, event)
        self._submit()

    # --- reading ahead ------------------------------------------------------------------------
    def _submit(self) -> None:
        while len(self._pending) < len(self.sequence):  # at most one whole cycle in flight
            fqn, offset, nbytes = self.sequence[self._next]
            first = offset // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
            span = -(-(offset + nbytes) // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT - first
            start = self.ring.allocate(span)
            if start is None:
                return
            futures = [self._executor.submit(self._read_chunk, fqn, start + done, first + done, min(CHUNK_BYTES, span - done), offset + nbytes - first - done)
                       for done in range(0, span, CHUNK_BYTES)]
            self._pending.append(_Read(self._next, start, offset - first, nbytes, futures))
            self._next = (self._next + 1) % len(self.sequence)

    def _read_chunk(self, fqn: str, at: int, offset: int, length: int, needed: int) -> None:
        with memoryview(self._buffer) as view, view[at : at + length] as target:
            got = pread_into(self._fd, target, offset, min(length, needed))
        if got < min(length, needed):
            raise ArtifactError(self.path, f"weight '{fqn}'", f"read {got} of {min(length, needed)} bytes at offset {offset}: the file is shorter than at load. Load it again")
        if self.mode == "buffered":
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)
        if file_identity(os.fstat(self._fd)) != self._identity:
            raise ArtifactError(self.path, "file", f"changed on disk while the disk tier read weight '{fqn}' from it; the weights it serves are no longer the ones checked at load. Load it again")

    def _restart(self, index: int | None) -> None:
        """Drop the reads ahead (waiting for those in flight) and start again at ``index``."""
        _stop(self._pending)
        self._pending.clear()
        # regions taken and not released (an abandoned copy) are free once every copy is done
        if self._taken:
            if self._pinned:
                torch.cuda.synchronize(self._device)
            self._taken.clear()
        while self.ring.regions and self.ring.wait_oldest():
            pass
        self.ring.clear()
        self.restarts += 1
        if index is not None:
            self._next = index

    def close(self) -> None:
        _stop(self._pending)
        self._executor.shutdown(wait=True)
        self._pending.clear()
        if self._pinned:
            unregister_host_memory(self.staging.data_ptr())
            self._pinned = False
        self.staging = None
        try:
            self._buffer.close()
        except BufferError:
            pass  # a view handed out still holds it; it goes with that view
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _stop(reads) -> None:
    """Cancel the chunks of ``reads`` not yet started and wait for those running."""
    for read in reads:
        for f in read.futures:
            f.cancel()
        concurrent.futures.wait(read.futures)


def pread_into(fd: int, target: memoryview, offset: int, needed: int | None = None) -> int:
    """Read the file at ``fd`` from ``offset`` into ``target`` until ``needed`` bytes (default:
    all of ``target``) are in or the file ends; returns the bytes read. A read may return fewer
    bytes than asked (a signal, a network filesystem), so it is repeated."""
    needed = len(target) if needed is None else needed
    got = 0
    while got < needed:
        with target[got:] as rest:
            n = os.preadv(fd, [rest], offset + got)
        if n == 0:
            break
        got += n
    return got


def open_for_reads(fd: int, direct: bool) -> tuple[str, int]:
    """("O_DIRECT" | "buffered", a new read-only descriptor of the file open at ``fd``)."""
    path = f"/proc/self/fd/{fd}"
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = -1  # some filesystems (older tmpfs, some network ones) refuse O_DIRECT
        if fd >= 0:
            probe = mmap.mmap(-1, DIRECT_ALIGNMENT)
            try:
                os.preadv(fd, [probe], 0)  # some take the open and refuse the reads
                return "O_DIRECT", fd
            except OSError:
                os.close(fd)
            finally:
                probe.close()
    return "buffered", os.open(path, os.O_RDONLY)
