"""The weight schedule as flat, versioned ExecuTorch constant methods, and back.

ExecuTorch flattens nested lists in constant methods and turns an empty list into a method
with no outputs, so every entry is a scalar or a flat list of one type.
"""

from __future__ import annotations

import os

from hostswap.schedules.pte_program import constant_method_outputs, external_weights, plan_by_name, read_program, tensor_nbytes
from hostswap.schedules.weight_schedule import SCHEDULE_VERSION, ScheduleError, WeightSchedule

PREFIX = "hostswap_"
VERSION = PREFIX + "schedule_version"
METHOD = PREFIX + "method"
FQNS = PREFIX + "weight_fqns"
PROBE_WEIGHT = PREFIX + "probe_weight"
PROBE_KERNEL = PREFIX + "probe_kernel"
KERNEL_OPS = PREFIX + "kernel_ops"
PREFETCH_DEPTH = PREFIX + "prefetch_depth"
PIN = PREFIX + "pin"
FLOOR_BYTES = PREFIX + "floor_bytes"
TOTAL_BYTES = PREFIX + "total_bytes"


def encode(schedule: WeightSchedule, method: str = "forward") -> dict[str, object]:
    return {
        VERSION: SCHEDULE_VERSION,
        METHOD: method,
        FQNS: list(schedule.fqns),
        PROBE_WEIGHT: list(schedule.probe_weight),
        PROBE_KERNEL: list(schedule.probe_kernel),
        KERNEL_OPS: list(schedule.kernel_ops),
        PREFETCH_DEPTH: schedule.prefetch_depth,
        PIN: list(schedule.pin),
        FLOOR_BYTES: schedule.floor_bytes,
        TOTAL_BYTES: schedule.total_bytes,
    }


def decode_program(program, source: str = "<program>") -> tuple[str, WeightSchedule]:
    """(method name, schedule) from a deserialized program; checks it against the program."""
    version = constant_method_outputs(program, VERSION)
    if version is None:
        raise ScheduleError(f"{source} was not produced by hostswap.apply_weight_offload (it has no {VERSION} method)")
    if version != [SCHEDULE_VERSION]:
        raise ScheduleError(f"{source} carries schedule version {version}, this hostswap reads version {SCHEDULE_VERSION}")

    def get(name: str) -> list:
        out = constant_method_outputs(program, name)
        if out is None:
            raise ScheduleError(f"{source} lacks the constant method {name}")
        return out

    (method,) = get(METHOD)
    plan = plan_by_name(program, method)
    if plan is None:
        raise ScheduleError(f"{source}: the schedule is for method '{method}', which the program does not have")
    fqns = get(FQNS)
    weights = external_weights(plan)
    missing = [f for f in fqns if f not in weights]
    if missing:
        raise ScheduleError(f"{source}: scheduled weight '{missing[0]}' is not an external constant of method '{method}'")
    (prefetch_depth,) = get(PREFETCH_DEPTH)
    schedule = WeightSchedule(
        fqns=tuple(fqns),
        weight_bytes=tuple(tensor_nbytes(weights[f]) for f in fqns),
        probe_weight=tuple(get(PROBE_WEIGHT)),
        probe_kernel=tuple(get(PROBE_KERNEL)),
        kernel_ops=tuple(get(KERNEL_OPS)),
        prefetch_depth=prefetch_depth,
        pin=tuple(get(PIN)),
    )
    if len(schedule.probe_weight) != len(schedule.probe_kernel):
        raise ScheduleError(f"{source}: {PROBE_WEIGHT} and {PROBE_KERNEL} differ in length")
    (stored_floor,) = get(FLOOR_BYTES)
    if stored_floor != schedule.floor_bytes:
        raise ScheduleError(
            f"{source}: stored floor {stored_floor} bytes differs from {schedule.floor_bytes} recomputed "
            "from the program's weights; the file is inconsistent"
        )
    return method, schedule


def load_weight_schedule(pte: str | os.PathLike | bytes) -> WeightSchedule:
    """Read the schedule that ``hostswap.save`` stored in a ``.pte``."""
    source = "<bytes>" if isinstance(pte, (bytes, bytearray)) else os.fspath(pte)
    return decode_program(read_program(pte), source)[1]
