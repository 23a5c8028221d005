"""The weight schedule as flat, versioned ExecuTorch constant methods, and back.

ExecuTorch flattens nested lists in constant methods and turns an empty list into a method
with no outputs, so every entry is a scalar or a flat list of one type.
"""

from __future__ import annotations

import os

from hostswap.schedules.artifacts import ArtifactError
from hostswap.schedules.experts import ExpertBlock, shared_dtype
from hostswap.schedules.pte_program import constant_method_outputs, external_weights, plan_by_name, read_program, tensor_nbytes, torch_dtype
from hostswap.schedules.weight_schedule import SCHEDULE_VERSION, ScheduleError, WeightSchedule

PREFIX = "hostswap_"
VERSION = PREFIX + "schedule_version"
METHODS = PREFIX + "methods"
WEIGHTS_DIGEST = PREFIX + "weights_digest"  # schedules/checksums.py: ties the .pte to its .ptd
# Per method m, the constant method PREFIX + m + "_" + field.
FQNS = "weight_fqns"
PROBE_WEIGHT = "probe_weight"
PROBE_KERNEL = "probe_kernel"
KERNEL_OPS = "kernel_ops"
PREFETCH_DEPTH = "prefetch_depth"
PIN = "pin"
HOST_READ = "host_read"
FLOOR_BYTES = "floor_bytes"
TOTAL_BYTES = "total_bytes"
# MoE blocks (written only where a method has some; a program without them reads as none):
# per block its name, top-k and tokens per call, and its tables as one flat list with a count each
EXPERT_BLOCKS = "expert_blocks"
EXPERT_TOP_K = "expert_top_k"
EXPERT_TOKENS = "expert_tokens"
EXPERT_TABLES = "expert_tables"
EXPERT_TABLE_COUNTS = "expert_table_counts"


def _key(method: str, field: str) -> str:
    return f"{PREFIX}{method}_{field}"


def encode(schedules: dict[str, WeightSchedule], weights_digest: str) -> dict[str, object]:
    """Constant methods carrying the schedule of every probed method of a program and the
    digest of the weights it was saved with."""
    out: dict[str, object] = {VERSION: SCHEDULE_VERSION, METHODS: list(schedules), WEIGHTS_DIGEST: weights_digest}
    for method, schedule in schedules.items():
        out.update({
            _key(method, FQNS): list(schedule.fqns),
            _key(method, PROBE_WEIGHT): list(schedule.probe_weight),
            _key(method, PROBE_KERNEL): list(schedule.probe_kernel),
            _key(method, KERNEL_OPS): list(schedule.kernel_ops),
            _key(method, PREFETCH_DEPTH): schedule.prefetch_depth,
            _key(method, PIN): list(schedule.pin),
            _key(method, HOST_READ): list(schedule.host_read),
            _key(method, FLOOR_BYTES): schedule.floor_bytes,
            _key(method, TOTAL_BYTES): schedule.total_bytes,
        })
        if schedule.expert_blocks:
            blocks = schedule.expert_blocks
            out.update({
                _key(method, EXPERT_BLOCKS): [b.block for b in blocks],
                _key(method, EXPERT_TOP_K): [b.top_k for b in blocks],
                _key(method, EXPERT_TOKENS): [b.tokens for b in blocks],
                _key(method, EXPERT_TABLES): [t for b in blocks for t in b.tables],
                _key(method, EXPERT_TABLE_COUNTS): [len(b.tables) for b in blocks],
            })
    return out


def decode_program(program, source: str = "<program>") -> dict[str, WeightSchedule]:
    """Method name -> schedule, for every probed method of a deserialized program; each is
    checked against the program."""
    version = _outputs(program, source, VERSION)
    if version is None:
        raise ArtifactError(source, VERSION, "is missing: the program was not saved by hostswap.save from a program apply_weight_offload transformed")
    if version != [SCHEDULE_VERSION]:
        raise ArtifactError(source, VERSION, f"is {version}; this hostswap reads version {SCHEDULE_VERSION}. Export and save the model again")
    get = _getter(program, source)
    methods = get(METHODS)
    if not methods or not all(isinstance(m, str) for m in methods):
        raise ArtifactError(source, METHODS, f"is {methods!r}, not a list of method names")
    schedules = {}
    for method in methods:
        try:
            schedules[method] = _decode_method(program, source, method, get)
        except (ScheduleError, TypeError, ValueError) as e:
            if isinstance(e, ArtifactError):
                raise
            raise ArtifactError(source, f"schedule of method '{method}'", str(e)) from None
    return schedules


def _outputs(program, source: str, name: str) -> list | None:
    try:
        return constant_method_outputs(program, name)
    except ValueError as e:
        raise ArtifactError(source, name, str(e)) from None


def _getter(program, source: str):
    def get(name: str) -> list:
        out = _outputs(program, source, name)
        if out is None:
            raise ArtifactError(source, name, "the constant method is missing")
        return out

    return get


def saved_weights_digest(program, source: str = "<program>") -> str:
    """The digest of the weights the program was saved with (schedules/checksums.py)."""
    value = _getter(program, source)(WEIGHTS_DIGEST)
    if len(value) != 1 or not isinstance(value[0], str):
        raise ArtifactError(source, WEIGHTS_DIGEST, f"is {value!r}, not one digest")
    return value[0]


def _decode_method(program, source: str, method: str, get) -> WeightSchedule:
    plan = plan_by_name(program, method)
    if plan is None:
        raise ArtifactError(source, METHODS, f"names method '{method}', which the program does not have")
    fqns = get(_key(method, FQNS))
    weights = external_weights(plan)
    host_read = get(_key(method, HOST_READ))
    for field, names in ((FQNS, fqns), (HOST_READ, host_read)):
        missing = [f for f in names if f not in weights]
        if missing:
            raise ArtifactError(source, _key(method, field), f"names '{missing[0]}', which is not an external constant of method '{method}'")
    (prefetch_depth,) = get(_key(method, PREFETCH_DEPTH))
    schedule = WeightSchedule(
        fqns=tuple(fqns),
        weight_bytes=tuple(tensor_nbytes(weights[f]) for f in fqns),
        weight_dtypes=tuple(str(torch_dtype(weights[f].scalar_type)).removeprefix("torch.") for f in fqns),
        probe_weight=tuple(get(_key(method, PROBE_WEIGHT))),
        probe_kernel=tuple(get(_key(method, PROBE_KERNEL))),
        kernel_ops=tuple(get(_key(method, KERNEL_OPS))),
        prefetch_depth=prefetch_depth,
        pin=tuple(get(_key(method, PIN))),
        host_read=tuple(host_read),
        host_read_bytes=tuple(tensor_nbytes(weights[f]) for f in host_read),
        expert_blocks=_decode_expert_blocks(program, source, method, get, weights),
    ).check()
    (stored_floor,) = get(_key(method, FLOOR_BYTES))
    if stored_floor != schedule.floor_bytes:
        raise ArtifactError(source, _key(method, FLOOR_BYTES), f"is {stored_floor} bytes; {schedule.floor_bytes} recomputed from the program's weights: the file is inconsistent")
    return schedule


def _decode_expert_blocks(program, source: str, method: str, get, weights) -> tuple[ExpertBlock, ...]:
    names = _outputs(program, source, _key(method, EXPERT_BLOCKS))
    if names is None:
        return ()
    top_k, tokens = get(_key(method, EXPERT_TOP_K)), get(_key(method, EXPERT_TOKENS))
    tables, counts = get(_key(method, EXPERT_TABLES)), get(_key(method, EXPERT_TABLE_COUNTS))
    if not (len(names) == len(top_k) == len(tokens) == len(counts)) or sum(counts) != len(tables) or any(c <= 0 for c in counts):
        raise ArtifactError(source, _key(method, EXPERT_BLOCKS), f"lists {len(names)} blocks with {len(top_k)} top-k, {len(tokens)} token counts "
                                                                 f"and {len(counts)} table counts summing to {sum(counts)} for {len(tables)} tables")
    blocks, start = [], 0
    for name, k, n, count in zip(names, top_k, tokens, counts):
        own = tuple(tables[start : start + count])
        start += count
        missing = [t for t in own if t not in weights]
        if missing:
            raise ArtifactError(source, _key(method, EXPERT_TABLES), f"names '{missing[0]}', which is not an external constant of method '{method}'")
        num_experts = int(weights[own[0]].sizes[0]) if weights[own[0]].sizes else 0
        if num_experts <= 0 or any(not weights[t].sizes or int(weights[t].sizes[0]) != num_experts for t in own):
            raise ArtifactError(source, _key(method, EXPERT_TABLES), f"tables {list(own)} of block '{name}' do not stack the same number of experts")
        dtype = shared_dtype([str(torch_dtype(weights[t].scalar_type)).removeprefix("torch.") for t in own])
        blocks.append(ExpertBlock(name, own, k, n, num_experts, sum(tensor_nbytes(weights[t]) for t in own) // num_experts, dtype))
    return tuple(blocks)


def load_weight_schedules(pte: str | os.PathLike | bytes) -> dict[str, WeightSchedule]:
    """Method name -> the schedule that ``hostswap.save`` stored for it in a ``.pte``."""
    source = "<bytes>" if isinstance(pte, (bytes, bytearray)) else os.fspath(pte)
    return decode_program(read_program(pte, source), source)


def load_weight_schedule(pte: str | os.PathLike | bytes, method: str | None = None) -> WeightSchedule:
    """The schedule of ``method`` (default: the program's only probed method) in a ``.pte``."""
    schedules = load_weight_schedules(pte)
    if method is None:
        if len(schedules) != 1:
            raise ScheduleError(f"the program has schedules for methods {list(schedules)}; name one")
        return next(iter(schedules.values()))
    if method not in schedules:
        raise ScheduleError(f"the program has no schedule for method '{method}' (it has {list(schedules)})")
    return schedules[method]
