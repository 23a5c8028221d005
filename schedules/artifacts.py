"""Reading hostswap's files without trusting them: one error type and a bounds-checked
flatbuffer reader.

A ``.pte`` or ``.ptd`` comes from a user's disk, a network copy or a typo. Every read of one
is checked against the bytes that exist before it is used, so a truncated, corrupt or
foreign file fails with ``ArtifactError`` naming the file and the field, never with an
``IndexError``, a ``struct.error`` or a crash later in the runtime.
"""

from __future__ import annotations

import struct


class ArtifactError(ValueError):
    """A ``.pte`` or ``.ptd`` that is truncated, corrupt, foreign, or not written for the
    program it is loaded with. ``path`` is the file and ``field`` the part of it at fault."""

    def __init__(self, path: str, field: str, message: str):
        self.path = path
        self.field = field
        super().__init__(f"{path}: {field}: {message}")


_UNSIGNED = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}
_SIGNED = {1: "<b", 2: "<h", 4: "<i", 8: "<q"}


class FlatbufferReader:
    """Reads tables, scalars, strings and vectors of one flatbuffer, checking every offset and
    count against the buffer before following it."""

    def __init__(self, data, path: str, region: str = "flatbuffer"):
        self.data = memoryview(data).cast("B")
        self.path = path
        self.region = region

    def fail(self, field: str, message: str):
        raise ArtifactError(self.path, f"{self.region} {field}", message)

    def integer(self, offset: int, size: int, field: str, signed: bool = False) -> int:
        if offset < 0 or offset + size > len(self.data):
            self.fail(field, f"reads {size} bytes at offset {offset}, outside the {len(self.data)}-byte region")
        return struct.unpack_from((_SIGNED if signed else _UNSIGNED)[size], self.data, offset)[0]

    def root(self, identifier: bytes | None = None) -> "Table":
        if identifier is not None and bytes(self.data[4:8]) != identifier:
            self.fail("identifier", f"is {bytes(self.data[4:8])!r}, expected {identifier!r}")
        return self.table_at(self.integer(0, 4, "root offset"), "root")

    def table_at(self, position: int, field: str) -> "Table":
        vtable = position - self.integer(position, 4, f"{field} (table)", signed=True)
        vtable_size = self.integer(vtable, 2, f"{field} (vtable size)")
        table_size = self.integer(vtable + 2, 2, f"{field} (table size)")
        if vtable_size < 4 or vtable_size % 2 or vtable + vtable_size > len(self.data):
            self.fail(field, f"vtable of {vtable_size} bytes at offset {vtable} is malformed")
        if position + table_size > len(self.data):
            self.fail(field, f"table of {table_size} bytes at offset {position} runs past the region")
        return Table(self, position, vtable, vtable_size, table_size, field)


class Table:
    def __init__(self, reader: FlatbufferReader, position: int, vtable: int, vtable_size: int, table_size: int, field: str):
        self.reader = reader
        self.position = position
        self.vtable = vtable
        self.vtable_size = vtable_size
        self.table_size = table_size
        self.field = field

    def _slot(self, index: int, name: str) -> int | None:
        """The absolute offset of field ``index``, or None where it is absent (its default)."""
        entry = 4 + 2 * index
        if entry + 2 > self.vtable_size:
            return None
        offset = self.reader.integer(self.vtable + entry, 2, f"{self.field}.{name}")
        if offset == 0:
            return None
        if offset >= self.table_size:
            self.reader.fail(f"{self.field}.{name}", f"field offset {offset} lies outside its {self.table_size}-byte table")
        return self.position + offset

    def scalar(self, index: int, name: str, size: int, default: int = 0, signed: bool = False) -> int:
        at = self._slot(index, name)
        return default if at is None else self.reader.integer(at, size, f"{self.field}.{name}", signed)

    def _target(self, index: int, name: str) -> int | None:
        at = self._slot(index, name)
        return None if at is None else at + self.reader.integer(at, 4, f"{self.field}.{name}")

    def table(self, index: int, name: str) -> "Table | None":
        target = self._target(index, name)
        return None if target is None else self.reader.table_at(target, f"{self.field}.{name}")

    def string(self, index: int, name: str) -> str | None:
        target = self._target(index, name)
        if target is None:
            return None
        length = self.reader.integer(target, 4, f"{self.field}.{name} (length)")
        raw = self._span(target + 4, length, f"{self.field}.{name}")
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            self.reader.fail(f"{self.field}.{name}", f"is not UTF-8 ({e.reason})")

    def _vector(self, index: int, name: str, element_size: int) -> tuple[int, int]:
        target = self._target(index, name)
        if target is None:
            return 0, 0
        count = self.reader.integer(target, 4, f"{self.field}.{name} (length)")
        self._span(target + 4, count * element_size, f"{self.field}.{name}")
        return target + 4, count

    def _span(self, start: int, length: int, field: str) -> memoryview:
        if start + length > len(self.reader.data):
            self.reader.fail(field, f"{length} bytes at offset {start} run past the {len(self.reader.data)}-byte region")
        return self.reader.data[start : start + length]

    def scalars(self, index: int, name: str, size: int, signed: bool = False) -> list[int]:
        start, count = self._vector(index, name, size)
        fmt = "<%d%s" % (count, (_SIGNED if signed else _UNSIGNED)[size][1])
        return list(struct.unpack_from(fmt, self.reader.data, start)) if count else []

    def tables(self, index: int, name: str) -> list["Table"]:
        start, count = self._vector(index, name, 4)
        out = []
        for i in range(count):
            element = start + 4 * i
            out.append(self.reader.table_at(element + self.reader.integer(element, 4, f"{self.field}.{name}[{i}]"), f"{self.field}.{name}[{i}]"))
        return out
