"""Read an ExecuTorch ``.pte`` with ExecuTorch's own deserializer; no execution."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from hostswap.schedules.artifacts import ArtifactError

# ExecuTorch's ScalarType follows c10's numbering; map by name so the table is self-evident.
_DTYPE_BY_SCALAR_TYPE_NAME = {
    "BYTE": torch.uint8,
    "CHAR": torch.int8,
    "SHORT": torch.int16,
    "INT": torch.int32,
    "LONG": torch.int64,
    "HALF": torch.float16,
    "FLOAT": torch.float32,
    "DOUBLE": torch.float64,
    "BOOL": torch.bool,
    "BFLOAT16": torch.bfloat16,
    "COMPLEX32": torch.complex32,
    "COMPLEX64": torch.complex64,
    "COMPLEX128": torch.complex128,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "FLOAT8E5M2": torch.float8_e5m2,
    "FLOAT8E4M3FN": torch.float8_e4m3fn,
}


def torch_dtype(scalar_type) -> torch.dtype:
    try:
        return _DTYPE_BY_SCALAR_TYPE_NAME[scalar_type.name]
    except (KeyError, AttributeError):
        raise ValueError(f"ExecuTorch scalar type {scalar_type} has no torch dtype mapping") from None


def tensor_nbytes(tensor_value) -> int:
    dtype = torch_dtype(tensor_value.scalar_type)
    return math.prod(tensor_value.sizes) * dtype.itemsize


PROGRAM_IDENTIFIER = b"ET12"  # the .pte flatbuffer's file identifier, bytes 4..8


def read_program_bytes(pte: str | os.PathLike) -> bytes:
    path = os.fspath(pte)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ArtifactError(path, "file", f"cannot be read: {e.strerror}") from None


def read_program(pte: str | os.PathLike | bytes, name: str | None = None):
    """The deserialized ``executorch.exir.schema.Program``, read with ExecuTorch's Python
    flatbuffer classes (no external tool). A file that is not one raises ``ArtifactError``."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    if isinstance(pte, (bytes, bytearray, memoryview)):
        data, name = bytes(pte), name or "<bytes>"
    else:
        data, name = read_program_bytes(pte), os.fspath(pte)
    if len(data) < 8 or data[4:8] != PROGRAM_IDENTIFIER:
        raise ArtifactError(name, "identifier", f"bytes 4..8 are {data[4:8]!r}, not {PROGRAM_IDENTIFIER!r}: not an ExecuTorch program")
    try:
        pte_file = deserialize_pte_binary(data)
    except Exception as e:  # noqa: BLE001  the generated reader raises whatever corrupt bytes lead it to
        raise ArtifactError(name, "program flatbuffer", f"does not parse ({type(e).__name__}: {e})") from None
    program = getattr(pte_file, "program", pte_file)
    if not getattr(program, "execution_plan", None):
        raise ArtifactError(name, "execution_plan", "is empty: the program has no methods")
    return program


def plan_by_name(program, name: str):
    for plan in program.execution_plan:
        if plan.name == name:
            return plan
    return None


# EValue kind -> its Python value; non-finite doubles come back from the deserializer as strings.
SCALAR_EVALUES = {
    "Int": lambda v: v.int_val,
    "Bool": lambda v: v.bool_val,
    "Double": lambda v: float(v.double_val),
    "String": lambda v: v.string_val,
}


def evalue_scalar(value) -> Any:
    """The Python value of an Int/Bool/Double/String EValue."""
    kind = type(getattr(value, "val", None)).__name__
    if kind not in SCALAR_EVALUES:
        raise ValueError(f"EValue of kind {kind} is not a plain scalar")
    return SCALAR_EVALUES[kind](value.val)


def constant_method_outputs(program, name: str) -> list[Any] | None:
    """The values a zero-input constant method returns, or None if there is no such method."""
    plan = plan_by_name(program, name)
    if plan is None:
        return None
    if any(not 0 <= i < len(plan.values) for i in plan.outputs):
        raise ValueError(f"constant method '{name}' returns value indices {list(plan.outputs)[:4]} outside its {len(plan.values)} values")
    return [evalue_scalar(plan.values[i]) for i in plan.outputs]


def external_weights(plan) -> dict[str, Any]:
    """FQN -> the schema Tensor of each external (``.ptd``) constant the plan references."""
    result = {}
    for value in plan.values:
        t = value.val
        info = getattr(t, "extra_tensor_info", None)
        if info is not None and info.fully_qualified_name and info.location.name == "EXTERNAL":
            result[info.fully_qualified_name] = t
    return result
