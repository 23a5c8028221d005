"""The ``.ptd`` weight file: memory-mapped read-only, indexed from its validated header and
flatbuffer (schedules/ptd_index.py), served as zero-copy views.

Weights are CPU views into the mapping; pages fault in from the page cache on first touch.
On CUDA the byte ranges of the weights that are streamed (not those copied once to stay
resident) are registered with the driver, read-only, so that their host-to-device copies
are asynchronous DMA. The file is checked for changes (size, modification time) before each
call: a mapped file edited in place would change the weights served, and one truncated
would end the process with SIGBUS on the next read of a lost page.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
import warnings

import torch

from hostswap.schedules.artifacts import ArtifactError
from hostswap.schedules.checksums import checksum, weights_digest
from hostswap.schedules.ptd_index import PtdEntry, read_ptd_index
from hostswap.schedules.serialization import saved_weights_digest

CUDA_HOST_REGISTER_READ_ONLY = 8
# Also mapped into the device's address space: a kernel may read the pages in place (a row
# gather out of an embedding table); copies are as fast as without it.
CUDA_HOST_REGISTER_MAPPED = 2
CUDA_HOST_REGISTER_FLAGS = CUDA_HOST_REGISTER_READ_ONLY | CUDA_HOST_REGISTER_MAPPED

__all__ = ["ArtifactError", "HostRegistrationError", "PtdEntry", "PtdFile", "check_pair", "device_view_of", "open_pair", "register_host_memory", "unregister_host_memory", "verify_showing_progress"]


class HostRegistrationError(RuntimeError):
    """``cudaHostRegister`` refused the mapping; carries the CUDA error."""


class PtdFile:
    """A read-only mapping of a ``.ptd`` with its entries indexed by FQN."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise ArtifactError(self.path, "file", f"cannot be opened: {e.strerror}") from None
        try:
            stat = os.fstat(self._file.fileno())
            self.nbytes = stat.st_size
            self._identity = file_identity(stat)
            if self.nbytes == 0:
                raise ArtifactError(self.path, "header", "the file is empty")
            self.mapping = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self.index = read_ptd_index(lambda offset, length: self.mapping[offset : offset + length], self.nbytes, self.path)
        except BaseException:
            if hasattr(self, "mapping"):
                self.mapping.close()
            self._file.close()
            raise
        self.entries: dict[str, PtdEntry] = self.index.entries
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write through it
            self._bytes = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.registered: list[tuple[int, int]] = []  # (pointer, bytes) of each registered range
        self.closed = False

    def host_tensor(self, fqn: str) -> torch.Tensor:
        """A zero-copy CPU view of one weight inside the mapping."""
        e = self.entries[fqn]
        return self._bytes[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)

    @property
    def base_pointer(self) -> int:
        return self._bytes.data_ptr()

    @property
    def identity(self) -> tuple[int, int]:
        """(size, modification time in ns) of the file at load."""
        return self._identity

    def fileno(self) -> int:
        return self._file.fileno()

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self.registered)

    def check_unchanged(self) -> None:
        """Refuse to go on with a file that was replaced, truncated or rewritten since load."""
        # The file this mapping reads, not the path: a file renamed over the path leaves the
        # mapped one intact, and it still serves the weights checked at load.
        now = file_identity(os.fstat(self._file.fileno()))
        if now != self._identity:
            was = self._identity
            reason = f"size {was[0]} -> {now[0]} bytes, modified {time.ctime(was[1] / 1e9)} -> {time.ctime(now[1] / 1e9)}"
            raise ArtifactError(self.path, "file", f"changed on disk since it was loaded ({reason}); the weights it serves are no longer the ones checked at load. Load it again")

    def verify(self, fqns=None, progress=None) -> tuple[int, float]:
        """Hash every byte of the given weights (default: all) against the checksums stored at
        save; returns (bytes checked, seconds). ``progress(done_bytes, total_bytes)`` follows."""
        checksums = self.index.checksums
        if checksums is None:
            raise ArtifactError(self.path, "checksum trailer", "is missing: the file was not written by hostswap.save, so there is nothing to verify against")
        entries = sorted((self.entries[f] for f in (self.entries if fqns is None else fqns)), key=lambda e: e.offset)
        total = sum(e.nbytes for e in entries)
        done, bad = 0, []
        t = time.perf_counter()
        with memoryview(self.mapping) as view:
            for e in entries:
                with view[e.offset : e.offset + e.nbytes] as data:
                    if checksum(data) != checksums[e.fqn]:
                        bad.append(e.fqn)
                done += e.nbytes
                if progress:
                    progress(done, total)
        seconds = time.perf_counter() - t
        if bad:
            raise ArtifactError(self.path, f"weight '{bad[0]}'", f"its bytes do not match the checksum stored at save ({len(bad)} of {len(entries)} weights differ: {bad[:5]}); the file is corrupt")
        return total, seconds

    def _ranges(self, fqns) -> list[tuple[int, int]]:
        """Page-aligned (start, length) ranges holding the given weights (None: the whole file)."""
        if fqns is None:
            return [(0, self.nbytes)]
        return page_ranges(((self.entries[f].offset, self.entries[f].nbytes) for f in fqns), mmap.PAGESIZE)

    def prefault(self, fqns=None) -> None:
        """Touch every page of the given weights (default: all) so the first forward does not
        fault them in from the page cache."""
        page = mmap.PAGESIZE
        for start, length in self._ranges(fqns):
            self.mapping.madvise(mmap.MADV_WILLNEED, start, length)
            # a strided sum reads one byte per page, in C
            self._bytes[start : start + length : page].sum()

    def lock(self, fqns=None) -> None:
        """mlock the pages of the given weights (default: the whole mapping): they stay in RAM
        (needs RLIMIT_MEMLOCK)."""
        libc = ctypes.CDLL(None, use_errno=True)
        for start, length in self._ranges(fqns):
            if libc.mlock(ctypes.c_void_p(self.base_pointer + start), ctypes.c_size_t(length)) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mlock of {self.path} ({length} bytes at {start}) failed: {os.strerror(err)}")

    def register_with_cuda(self, fqns=None) -> int:
        """cudaHostRegister, read-only, the pages holding the given weights (default: the whole
        mapping), so copies from them are asynchronous DMA; returns the bytes registered."""
        for start, length in self._ranges(fqns):
            register_host_memory(self.base_pointer + start, length, what=f"{self.path} bytes {start}..{start + length}")
            self.registered.append((self.base_pointer + start, length))
        return self.pinned_bytes

    def device_view(self, fqn: str, device: torch.device) -> torch.Tensor:
        """A ``device`` tensor over one weight's registered host pages: kernels read it in
        place over the bus, nothing is copied. The pages must be registered (``register_with_cuda``)."""
        host = self.host_tensor(fqn)
        pointer, nbytes = host.data_ptr(), host.numel() * host.element_size()
        if not any(start <= pointer and pointer + nbytes <= start + length for start, length in self.registered):
            raise HostRegistrationError(f"weight '{fqn}' of {self.path} is not in a range registered with CUDA; register it before viewing it on the device")
        return device_view_of(host, device, f"weight '{fqn}' of {self.path}")

    def unregister_from_cuda(self) -> None:
        """Undo ``register_with_cuda``: every range registered goes back to pageable."""
        for pointer, _ in self.registered:
            unregister_host_memory(pointer)
        self.registered = []

    def __enter__(self) -> "PtdFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Unregister, unmap and close; idempotent. Views handed out must be dropped first:
        a mapping still viewed stays until the last view goes."""
        if self.closed:
            return
        self.closed = True
        self.unregister_from_cuda()
        self._bytes = None
        try:
            self.mapping.close()
        except BufferError:
            pass  # views handed out still reference it; the mapping goes with them
        self._file.close()


class _MappedBytes:
    """Bytes of registered host memory as the device addresses them, for ``torch.as_tensor``
    (the CUDA array interface); holds the host view, so the mapping outlives the tensor.
    Marked writable because torch refuses read-only arrays; nothing writes a weight (the pass
    refuses programs that do) and the pages are registered read-only."""

    def __init__(self, device_pointer: int, nbytes: int, owner: torch.Tensor):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (device_pointer, False), "version": 3, "strides": None}


def check_pair(pte_path: str, pte_bytes: bytes, program, ptd: PtdFile) -> None:
    """Refuse a ``.pte`` and ``.ptd`` that are not the pair one ``hostswap.save`` wrote, from
    the index and trailer alone (no weight is read).

    The trailer records the ``.pte``'s checksum: a corrupt ``.pte``, or one saved at another
    time, stops here. The ``.pte`` records the digest of its weights' names, dtypes, shapes
    and checksums: a ``.ptd`` holding another program's weights stops here.
    """
    recorded = ptd.index.program_checksum
    if recorded is None:
        raise ArtifactError(ptd.path, "checksum trailer", "is missing: hostswap loads weights files written by hostswap.save, which records the checksums it checks")
    want = saved_weights_digest(program, pte_path)
    have = weights_digest(ptd.index.records())
    if want != have:
        raise ArtifactError(ptd.path, "weights digest", f"is {have}; {pte_path} was saved with weights of digest {want}: the weights file belongs to another program")
    actual = checksum(pte_bytes)
    if actual != recorded:
        raise ArtifactError(
            pte_path, "file",
            f"its checksum {actual} differs from {recorded}, which {ptd.path} recorded for the program saved with it: "
            "the .pte is corrupt, or the two files come from different saves",
        )


def open_pair(pte_path: str, pte_bytes: bytes, program, ptd_path: str) -> PtdFile:
    """The ``.ptd`` at ``ptd_path``, mapped and checked to be the pair of the program read from
    ``pte_bytes`` (``check_pair``); closed again if it is not."""
    ptd = PtdFile(ptd_path)
    try:
        check_pair(pte_path, pte_bytes, program, ptd)
    except BaseException:
        ptd.close()
        raise
    return ptd


def verify_showing_progress(ptd: PtdFile) -> tuple[int, float]:
    """``ptd.verify()`` of every weight with a progress bar on stderr (tqdm); (bytes, seconds)."""
    from tqdm import tqdm

    total = sum(e.nbytes for e in ptd.entries.values())
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"verifying {os.path.basename(ptd.path)}", file=sys.stderr, leave=False) as bar:
        return ptd.verify(progress=lambda done, _total: bar.update(done - bar.n))


def file_identity(stat: os.stat_result) -> tuple[int, int]:
    """(size, modification time in ns): what tells a file changed since it was loaded."""
    return (stat.st_size, stat.st_mtime_ns)


def page_ranges(spans, page: int) -> list[tuple[int, int]]:
    """(start, length) of the page-aligned union of byte spans (offset, length), merged."""
    merged: list[list[int]] = []
    for offset, length in sorted(spans):
        start, end = offset // page * page, -(-(offset + length) // page) * page
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:  # older cuda-python layout
        from cuda import cudart  # type: ignore
    return cudart


def register_host_memory(pointer: int, nbytes: int, what: str = "host memory") -> None:
    cudart = _cudart()
    (err,) = cudart.cudaHostRegister(pointer, nbytes, CUDA_HOST_REGISTER_FLAGS)
    if err != cudart.cudaError_t.cudaSuccess:
        # Clear the sticky error so the next CUDA call does not report it instead.
        cudart.cudaGetLastError()
        _, name = cudart.cudaGetErrorName(err)
        _, text = cudart.cudaGetErrorString(err)
        raise HostRegistrationError(
            f"cudaHostRegister({what}, {nbytes} bytes, cudaHostRegisterReadOnly | cudaHostRegisterMapped) failed: "
            f"{name.decode()}: {text.decode()}"
        )


def device_view_of(host: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """A ``device`` tensor over the registered host memory of ``host`` (contiguous), read by
    kernels in place over the bus; it keeps ``host`` alive."""
    cudart = _cudart()
    with torch.cuda.device(device):
        err, device_pointer = cudart.cudaHostGetDevicePointer(host.data_ptr(), 0)
    if err != cudart.cudaError_t.cudaSuccess:
        cudart.cudaGetLastError()
        _, name = cudart.cudaGetErrorName(err)
        raise HostRegistrationError(f"cudaHostGetDevicePointer({what}) failed: {name.decode()}")
    raw = torch.as_tensor(_MappedBytes(int(device_pointer), host.numel() * host.element_size(), host), device=device)
    return raw.view(host.dtype).view(host.shape)


def unregister_host_memory(pointer: int) -> None:
    cudart = _cudart()
    cudart.cudaHostUnregister(pointer)
