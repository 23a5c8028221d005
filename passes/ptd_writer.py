"""Write a ``.ptd`` one tensor at a time: the index first, then each tensor's bytes as it comes.

The layout is ExecuTorch's FlatTensor (the one ``schedules/ptd_index.py`` reads): a flatbuffer
with the extended header ``FH01`` embedded, then one segment per tensor, each aligned to
``SEGMENT_ALIGNMENT``. The index depends only on names, dtypes and shapes, so it is written
before any weight is read, and the weights follow in the order given, each hashed as it is
written. Peak memory is one tensor, whatever the model's size. Identical tensors are stored
once each (ExecuTorch's own writer stores them once): the data need not be read twice.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
from collections.abc import Iterable

import torch

from hostswap.schedules.checksums import checksum
from hostswap.schedules.pte_program import torch_dtype

SEGMENT_ALIGNMENT = 128  # ExecuTorch's FlatTensorConfig default
_FLATBUFFER_ALIGNMENT = 16


@dataclasses.dataclass(frozen=True)
class PtdTensor:
    """One entry of the index: its name, dtype and shape."""

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _scalar_type(dtype: torch.dtype):
    from executorch.exir.scalar_type import ScalarType

    for scalar_type in ScalarType:
        try:
            if torch_dtype(scalar_type) == dtype:
                return scalar_type
        except ValueError:
            continue
    raise ValueError(f"{dtype} has no ExecuTorch scalar type")


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def ptd_index_bytes(tensors: list[PtdTensor]) -> tuple[bytes, list[int]]:
    """(the bytes before the first segment, each tensor's absolute offset in the file)."""
    from executorch.exir._serialize._program import _insert_flatbuffer_header
    from executorch.exir.tensor_layout import TensorLayout
    from executorch.extension.flat_tensor.serialize.flat_tensor_schema import DataSegment, FlatTensor, NamedData
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, _serialize_to_flatbuffer

    offsets, end = [], 0
    for t in tensors:
        offsets.append(_aligned(end, SEGMENT_ALIGNMENT))
        end = offsets[-1] + t.nbytes
    flat = FlatTensor(
        version=0,
        segments=[DataSegment(offset=o, size=t.nbytes) for o, t in zip(offsets, tensors)],
        named_data=[NamedData(key=t.fqn, segment_index=i, tensor_layout=TensorLayout(_scalar_type(t.dtype), list(t.shape), list(range(len(t.shape)))))
                    for i, t in enumerate(tensors)],
    )
    flatbuffer = _serialize_to_flatbuffer(flat).__bytes__()
    header_length = _aligned(FlatTensorHeader.EXPECTED_LENGTH, _FLATBUFFER_ALIGNMENT)
    base = _aligned(len(flatbuffer) + header_length, SEGMENT_ALIGNMENT)
    header = FlatTensorHeader(flatbuffer_offset=header_length, flatbuffer_size=len(flatbuffer), segment_base_offset=base,
                              segment_data_size=end).to_bytes()
    header = header + b"\0" * (header_length - len(header))
    head = _insert_flatbuffer_header(flatbuffer_data=flatbuffer, magic_regex=r"FT[0-9a-zA-Z][0-9a-zA-Z]", header_data=header)
    return head + b"\0" * (base - len(head)), [base + o for o in offsets]


class DiskFullError(OSError):
    """The filesystem cannot hold the file being written; names it and the bytes it needs."""


# what a full disk or a file-size limit looks like to a write
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def check_room(directory: str, nbytes: int, free_bytes: int | None = None) -> None:
    """Refuse, before writing, ``nbytes`` that ``directory``'s filesystem has no room for
    (``free_bytes``: what it has, default from statvfs)."""
    if free_bytes is None:
        stat = os.statvfs(directory)
        free_bytes = stat.f_bavail * stat.f_frsize
    if nbytes > free_bytes:
        raise DiskFullError(errno.ENOSPC, f"{directory} has {free_bytes / 2**30:.2f} GiB free; the weights need {nbytes / 2**30:.2f} GiB. "
                                          "Free space there or write elsewhere")


class PtdWriter:
    """A ``.ptd`` being written: the index at once, then each tensor in the order given, hashed as
    it is written. Raises ValueError naming a tensor whose data disagrees with its entry, and
    ``DiskFullError`` (before the first byte where the filesystem reports too little room, else
    when a write fails for it)."""

    def __init__(self, path: str | os.PathLike, tensors: list[PtdTensor]):
        self.path, self.tensors = os.fspath(path), tensors
        head, self.offsets = ptd_index_bytes(tensors)
        self.total = (self.offsets[-1] + tensors[-1].nbytes) if tensors else len(head)
        check_room(os.path.dirname(os.path.abspath(self.path)), self.total)
        self.checksums: dict[str, str] = {}
        self._file = open(self.path, "wb")
        self._guarded(self._file.write, head)

    def _guarded(self, write, *args) -> None:
        try:
            write(*args)
        except OSError as e:
            where = self.total if self._file.closed else self._file.tell()
            self._file.close()
            if e.errno not in _NO_ROOM:
                raise
            raise DiskFullError(e.errno, f"writing {self.path} stopped at about {where / 2**30:.2f} of {self.total / 2**30:.2f} GiB: "
                                         f"{e.strerror}. Nothing was written under the final names; free space there or write elsewhere") from None

    def write(self, tensor: torch.Tensor) -> None:
        """The next entry's bytes."""
        i = len(self.checksums)
        entry, offset = self.tensors[i], self.offsets[i]
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            self._file.close()
            raise ValueError(f"tensor '{entry.fqn}' is {tensor.dtype} {list(tensor.shape)}; the program reads {entry.dtype} {list(entry.shape)}")
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._guarded(self._write_at, offset, raw)
        self.checksums[entry.fqn] = checksum(raw)

    def _write_at(self, offset: int, raw) -> None:
        self._file.write(b"\0" * (offset - self._file.tell()))
        self._file.write(memoryview(raw))

    def close(self) -> dict[str, str]:
        """Finish the file; FQN -> checksum of every tensor."""
        if len(self.checksums) != len(self.tensors):
            self._file.close()
            raise ValueError(f"{self.path}: {len(self.checksums)} of {len(self.tensors)} tensors were written")
        self._guarded(self._file.flush)
        self._file.close()
        return self.checksums


def entries_in_order(orders: Iterable[Iterable[str]], tensors: dict[str, PtdTensor]) -> list[PtdTensor]:
    """The entries of ``tensors`` in first-use order over ``orders`` (access orders), then the rest by name."""
    seen: dict[str, None] = {}
    for order in orders:
        for fqn in order:
            if fqn in tensors:
                seen.setdefault(fqn)
    return [tensors[f] for f in seen] + [tensors[f] for f in sorted(set(tensors) - set(seen))]
