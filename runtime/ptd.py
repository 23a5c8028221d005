"""The ``.ptd`` weight file: memory-mapped read-only, indexed from its header and flatbuffer.

Weights are zero-copy CPU views into the mapping; pages fault in from the page cache on
first touch. On CUDA the mapping is registered with the driver (read-only flag) so that
host-to-device copies are true asynchronous DMA.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import warnings

import torch

from hostswap.schedules.pte_program import torch_dtype

_HEADER_OFFSET = 8  # FlatTensor's extended header sits after the flatbuffer root offset and identifier
_HEADER_LENGTH = 40
CUDA_HOST_REGISTER_READ_ONLY = 8


class PtdError(ValueError):
    """A ``.ptd`` that cannot serve the program; the message names the file and entry."""


class HostRegistrationError(RuntimeError):
    """``cudaHostRegister`` refused the mapping; carries the CUDA error."""


@dataclasses.dataclass(frozen=True)
class PtdEntry:
    fqn: str
    offset: int  # absolute offset in the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _parse_header(head: bytes, path: str) -> tuple[int, int]:
    if len(head) < _HEADER_OFFSET + _HEADER_LENGTH or head[_HEADER_OFFSET : _HEADER_OFFSET + 4] != b"FH01":
        raise PtdError(f"{path} is not an ExecuTorch .ptd (no FlatTensor header)")
    flatbuffer_region = int.from_bytes(head[_HEADER_OFFSET + 24 : _HEADER_OFFSET + 32], "little")  # segment base offset
    segment_data_size = int.from_bytes(head[_HEADER_OFFSET + 32 : _HEADER_OFFSET + 40], "little")
    return flatbuffer_region, segment_data_size


class PtdFile:
    """A read-only mapping of a ``.ptd`` with its entries indexed by FQN."""

    def __init__(self, path: str | os.PathLike):
        from executorch.extension.flat_tensor.serialize.serialize import _deserialize_to_flat_tensor

        self.path = os.fspath(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise PtdError(f"cannot open weight file {self.path}: {e.strerror}") from e
        size = os.fstat(self._file.fileno()).st_size
        if size < _HEADER_OFFSET + _HEADER_LENGTH:
            raise PtdError(f"{self.path} is not an ExecuTorch .ptd ({size} bytes)")
        self.mapping = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self.nbytes = size
        base, data_size = _parse_header(self.mapping[: _HEADER_OFFSET + _HEADER_LENGTH], self.path)
        if base + data_size > size:
            raise PtdError(f"{self.path} is truncated: header promises {base + data_size} bytes, file has {size}")
        flat = _deserialize_to_flat_tensor(bytes(self.mapping[:base]))  # only the index is read
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write through it
            self._bytes = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.entries: dict[str, PtdEntry] = {}
        for named in flat.named_data:
            segment = flat.segments[named.segment_index]
            layout = named.tensor_layout
            self.entries[named.key] = PtdEntry(
                fqn=named.key,
                offset=base + segment.offset,
                nbytes=segment.size,
                dtype=torch_dtype(layout.scalar_type),
                shape=tuple(layout.sizes),
            )
        self.registered = False

    def host_tensor(self, fqn: str) -> torch.Tensor:
        """A zero-copy CPU view of one weight inside the mapping."""
        e = self.entries[fqn]
        view = self._bytes[e.offset : e.offset + e.dtype.itemsize * _numel(e.shape)]
        return view.view(e.dtype).view(e.shape)

    @property
    def base_pointer(self) -> int:
        return self._bytes.data_ptr()

    def prefault(self) -> None:
        """Touch every page so the first forward does not fault them in from the page cache."""
        self.mapping.madvise(mmap.MADV_WILLNEED)
        page = mmap.PAGESIZE
        # a strided sum reads one byte per page, in C
        self._bytes[::page].sum()

    def lock(self) -> None:
        """mlock the mapping: its pages stay in RAM (needs RLIMIT_MEMLOCK)."""
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mlock(ctypes.c_void_p(self.base_pointer), ctypes.c_size_t(self.nbytes)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mlock of {self.path} ({self.nbytes} bytes) failed: {os.strerror(err)}")

    def register_with_cuda(self) -> None:
        """cudaHostRegister the mapping read-only, so copies from it are asynchronous DMA."""
        register_host_memory(self.base_pointer, self.nbytes, what=self.path)
        self.registered = True

    def close(self) -> None:
        if self.registered:
            unregister_host_memory(self.base_pointer)
            self.registered = False
        self._bytes = None
        try:
            self.mapping.close()
        except BufferError:
            pass  # views handed out still reference it; the mapping goes with them
        self._file.close()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:  # older cuda-python layout
        from cuda import cudart  # type: ignore
    return cudart


def register_host_memory(pointer: int, nbytes: int, what: str = "host memory") -> None:
    cudart = _cudart()
    (err,) = cudart.cudaHostRegister(pointer, nbytes, CUDA_HOST_REGISTER_READ_ONLY)
    if err != cudart.cudaError_t.cudaSuccess:
        # Clear the sticky error so the next CUDA call does not report it instead.
        cudart.cudaGetLastError()
        _, name = cudart.cudaGetErrorName(err)
        _, text = cudart.cudaGetErrorString(err)
        raise HostRegistrationError(
            f"cudaHostRegister({what}, {nbytes} bytes, cudaHostRegisterReadOnly) failed: "
            f"{name.decode()}: {text.decode()}"
        )


def unregister_host_memory(pointer: int) -> None:
    cudart = _cudart()
    cudart.cudaHostUnregister(pointer)
