"""The index of an ExecuTorch ``.ptd``, read and validated without reading any weight.

Layout (ExecuTorch's FlatTensor): a flatbuffer whose first bytes embed the extended header
``FH01`` (flatbuffer size, segment base offset, segment data size), then the segments, each
aligned; hostswap appends its checksum trailer (``schedules/checksums.py``) after them.
Every entry must lie inside the segment region, no two segments may overlap, a segment's
size must be ``numel * itemsize`` of its layout, offsets must keep the alignment the format
promises, and keys that share a segment must carry the same checksum (ExecuTorch stores
identical tensors once). A failure is an ``ArtifactError`` naming the key and the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch
from executorch.exir.scalar_type import ScalarType

from hostswap.schedules.artifacts import ArtifactError, FlatbufferReader
from hostswap.schedules.checksums import ALGORITHM, MAX_TRAILER_BYTES, TRAILER_FOOTER, TRAILER_MAGIC, dtype_name
from hostswap.schedules.pte_program import torch_dtype

HEADER_OFFSET = 8  # after the flatbuffer's root offset and file identifier
HEADER_LENGTH = 40
HEADER_MAGIC = b"FH01"
FILE_IDENTIFIER = b"FT01"
# ExecuTorch aligns every segment to 128 bytes by default (FlatTensorConfig); hostswap needs
# at least this much for its typed views and DMA copies, and checks it.
SEGMENT_ALIGNMENT = 16
MAX_RANK = 16


@dataclasses.dataclass(frozen=True)
class PtdEntry:
    fqn: str
    offset: int  # absolute offset in the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    segment: int


@dataclasses.dataclass(frozen=True)
class PtdIndex:
    path: str
    file_size: int
    segment_base: int
    data_end: int  # where ExecuTorch's segments end (the trailer follows)
    entries: dict[str, PtdEntry]
    checksums: dict[str, str] | None  # None: the file has no hostswap trailer
    program_checksum: str | None  # of the .pte saved with this file

    def records(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """What ``weights_digest`` hashes: name -> (dtype, shape, checksum)."""
        return {fqn: (dtype_name(e.dtype), e.shape, self.checksums[fqn]) for fqn, e in self.entries.items()}


def _dtype(code: int, path: str, field: str) -> torch.dtype:
    try:
        return torch_dtype(ScalarType(code))
    except ValueError:
        raise ArtifactError(path, field, f"scalar type {code} is not one ExecuTorch defines") from None


def read_ptd_index(read, file_size: int, path: str) -> PtdIndex:
    """Parse and check the index; ``read(offset, length)`` returns bytes of the file."""
    if file_size < HEADER_OFFSET + HEADER_LENGTH:
        raise ArtifactError(path, "header", f"the file has {file_size} bytes; an ExecuTorch .ptd starts with a {HEADER_OFFSET + HEADER_LENGTH}-byte header")
    head = read(0, HEADER_OFFSET + HEADER_LENGTH)
    if head[HEADER_OFFSET : HEADER_OFFSET + 4] != HEADER_MAGIC:
        raise ArtifactError(path, "header", f"magic is {bytes(head[HEADER_OFFSET:HEADER_OFFSET + 4])!r}, not {HEADER_MAGIC!r}: not an ExecuTorch .ptd")
    field = lambda at: int.from_bytes(head[HEADER_OFFSET + at : HEADER_OFFSET + at + 8], "little")
    length = int.from_bytes(head[HEADER_OFFSET + 4 : HEADER_OFFSET + 8], "little")
    flatbuffer_offset, flatbuffer_size, base, data_size = field(8), field(16), field(24), field(32)
    if length < HEADER_LENGTH:
        raise ArtifactError(path, "header length", f"is {length}, at least {HEADER_LENGTH} expected")
    flatbuffer_end = flatbuffer_offset + flatbuffer_size
    if flatbuffer_end > base or base > file_size:
        raise ArtifactError(path, "header", f"flatbuffer ends at {flatbuffer_end}, segments start at {base}, the file has {file_size} bytes")
    if base + data_size > file_size:
        raise ArtifactError(path, "segment data size", f"the header promises segments up to byte {base + data_size}, the file has {file_size} bytes: truncated")
    if base % SEGMENT_ALIGNMENT:
        raise ArtifactError(path, "segment base offset", f"{base} is not a multiple of {SEGMENT_ALIGNMENT}")
    reader = FlatbufferReader(read(0, flatbuffer_end), path, "index")
    root = reader.root(FILE_IDENTIFIER)
    segments = []
    for i, s in enumerate(root.tables(1, "segments")):
        offset, size = s.scalar(0, "offset", 8), s.scalar(1, "size", 8)
        if offset + size > data_size:
            raise ArtifactError(path, f"segments[{i}]", f"bytes {offset}..{offset + size} lie outside the {data_size}-byte segment region")
        if offset % SEGMENT_ALIGNMENT:
            raise ArtifactError(path, f"segments[{i}]", f"offset {offset} is not a multiple of {SEGMENT_ALIGNMENT}")
        segments.append((offset, size))
    ordered = sorted(range(len(segments)), key=lambda i: segments[i])
    for a, b in zip(ordered, ordered[1:]):
        if segments[a][0] + segments[a][1] > segments[b][0]:
            raise ArtifactError(path, f"segments[{b}]", f"bytes {segments[b][0]}..{sum(segments[b])} overlap segments[{a}] (bytes {segments[a][0]}..{sum(segments[a])})")
    entries: dict[str, PtdEntry] = {}
    for i, named in enumerate(root.tables(2, "named_data")):
        key = named.string(0, "key")
        where = f"named_data[{i}] '{key}'"
        if not key:
            raise ArtifactError(path, f"named_data[{i}].key", "is missing or empty")
        if key in entries:
            raise ArtifactError(path, where, "the key appears twice")
        index = named.scalar(1, "segment_index", 4)
        if index >= len(segments):
            raise ArtifactError(path, f"{where}.segment_index", f"is {index}; the file has {len(segments)} segments")
        layout = named.table(2, "tensor_layout")
        if layout is None:
            raise ArtifactError(path, f"{where}.tensor_layout", "is missing; hostswap stores tensors only")
        dtype = _dtype(layout.scalar(0, "scalar_type", 1, signed=True), path, f"{where}.tensor_layout.scalar_type")
        shape = tuple(layout.scalars(1, "sizes", 4, signed=True))
        dim_order = layout.scalars(2, "dim_order", 1)
        if len(shape) > MAX_RANK or any(d < 0 for d in shape):
            raise ArtifactError(path, f"{where}.tensor_layout.sizes", f"{list(shape)} is not a tensor shape")
        if dim_order and dim_order != list(range(len(shape))):
            raise ArtifactError(path, f"{where}.tensor_layout.dim_order", f"{dim_order} is not contiguous; hostswap stores contiguous tensors")
        offset, size = segments[index]
        want = math.prod(shape) * dtype.itemsize
        if size != want:
            raise ArtifactError(path, where, f"segment {index} holds {size} bytes; shape {list(shape)} {dtype} needs {want}")
        entries[key] = PtdEntry(key, base + offset, size, dtype, shape, index)
    data_end = base + data_size
    checksums, program_checksum = _read_trailer(read, file_size, data_end, path)
    if checksums is not None:
        _check_checksums(entries, checksums, path)
    return PtdIndex(path, file_size, base, data_end, entries, checksums, program_checksum)


def _read_trailer(read, file_size: int, data_end: int, path: str) -> tuple[dict[str, str] | None, str | None]:
    if file_size - data_end < TRAILER_FOOTER.size:
        return None, None
    length, magic = TRAILER_FOOTER.unpack(read(file_size - TRAILER_FOOTER.size, TRAILER_FOOTER.size))
    if magic != TRAILER_MAGIC:
        return None, None
    start = file_size - TRAILER_FOOTER.size - length
    if length > MAX_TRAILER_BYTES or start < data_end:
        raise ArtifactError(path, "checksum trailer", f"claims {length} bytes; {file_size - TRAILER_FOOTER.size - data_end} lie between the segments and the end")
    try:
        body = json.loads(bytes(read(start, length)).decode("utf-8"))
        algorithm, checksums, program = body["algorithm"], body["checksums"], body["program"]
        if not isinstance(checksums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()):
            raise TypeError("checksums is not a map of names to hex digests")
        if not isinstance(program, str):
            raise TypeError("program is not a hex digest")
    except (ValueError, KeyError, TypeError) as e:
        raise ArtifactError(path, "checksum trailer", f"does not parse: {e}") from None
    if algorithm != ALGORITHM:
        raise ArtifactError(path, "checksum trailer", f"uses {algorithm!r}; this hostswap reads {ALGORITHM!r}")
    return checksums, program


def _check_checksums(entries: dict[str, PtdEntry], checksums: dict[str, str], path: str) -> None:
    missing = sorted(set(entries) - set(checksums))
    extra = sorted(set(checksums) - set(entries))
    if missing or extra:
        raise ArtifactError(path, "checksum trailer", f"does not cover the index: no checksum for {missing[:3]}, checksums for unknown {extra[:3]}")
    by_segment: dict[int, str] = {}
    for fqn, e in entries.items():
        first = by_segment.setdefault(e.segment, fqn)
        if checksums[first] != checksums[fqn]:
            raise ArtifactError(path, f"named_data '{fqn}'", f"points at segment {e.segment}, which holds '{first}' (checksum {checksums[first]}, not {checksums[fqn]})")
