"""Lower a probed program with ExecuTorch: weights external in a .ptd, schedule as constant methods."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from hostswap.passes.graph_facts import first_tensor_input, is_probe, is_view_like, view_chain_root
from hostswap.passes.out_variants import CustomOpOutVariantPass
from hostswap.passes.ptd_writer import PtdTensor, PtdWriter, check_room, entries_in_order
from hostswap.passes.weight_offload import (
    INLINE_CONSTANT_MARK,
    OPTIONS_META_KEY,
    WeightOffloadError,
    WeightOffloadOptions,
    get_weight_schedule,
    reprobe,
    schedule_with_options,
    state_buffers,
    weight_placeholders,
    weight_tensor,
)
from hostswap.schedules import serialization
from hostswap.schedules.checksums import checksum, dtype_name, encode_trailer, tensor_checksum, weights_digest
from hostswap.schedules.custom_ops import PROBE_OPERATOR
from hostswap.schedules.pte_program import plan_by_name
from hostswap.schedules.ptd_index import read_ptd_index
from hostswap.schedules.weight_schedule import ScheduleError

METHOD = "forward"
# Ops the edge dialect would decompose that have an ATen out variant: kept, they run as the
# one kernel eager PyTorch launches.
PRESERVED_OPS = (torch.ops.aten.silu.default,)


def _probe_derived(node: torch.fx.Node) -> bool:
    """True if ``node`` is a probe's output or a view chain of one (out-variant graph)."""
    root = view_chain_root(node)
    return root is not None and is_probe(root)


def _view_spec_base(spec):
    """The storage spec an ExecuTorch ``_ViewSpec`` views, else None."""
    from executorch.exir.passes.replace_view_copy_with_view_pass import _ViewSpec

    return object.__getattribute__(spec, "_base") if isinstance(spec, _ViewSpec) else None


def _set_view_spec_dynamism(spec, dynamism) -> None:
    """Give a ``_ViewSpec`` its base's new dynamism; its creation-time guard records the old."""
    for guard in object.__getattribute__(spec, "_guards"):
        if guard.name == "shape_dynamism_init":
            guard.expected_val = dynamism
    spec.shape_dynamism = dynamism


def _in_place_results_as_their_inputs(graph_module: torch.fx.GraphModule) -> None:
    """Give every reference to an in-place op's result the storage of the tensor the op wrote:
    the result itself, each memory view of it, and the program's outputs that return it.

    ExecuTorch's planner gives an in-place op's result the spec of the input it writes
    (``memory_planning._alias_inplace_result_specs``) only while planning, after
    ``ReplaceViewCopyWithViewPass`` made the views of that result views of its own spec. Such a
    view (DeepSeek-V3 reads its cached latent, the result of the cache's in-place write, through
    a linear: a view of it) would be planned as storage of its own that nothing writes, and read
    as whatever bytes the arena held there."""
    from executorch.exir.memory_planning import _alias_inplace_result_specs, _is_inplace_node
    from executorch.exir.tensor import TensorSpec

    for node in graph_module.graph.nodes:
        if _is_inplace_node(node) and node.meta.get("spec") is not None:
            _alias_inplace_result_specs(node)
    for node in graph_module.graph.nodes:
        spec = node.meta.get("spec")
        if node.op == "output" and isinstance(spec, (list, tuple)):
            # The outputs that return a state update (the write-back of every cache layer) kept
            # the result's spec too: planned in the activation arena, a second cache's bytes
            # that nothing reads. The emitter takes outputs from the values, not these specs.
            returned = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            fixed = [a.meta["spec"] if isinstance(a, torch.fx.Node) and _is_inplace_node(a) and isinstance(a.meta.get("spec"), TensorSpec) else s
                     for a, s in zip(returned, spec)]
            node.meta["spec"] = type(spec)(fixed)
            continue
        if _view_spec_base(spec) is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        written = node.args[0].meta.get("spec")
        written = _view_spec_base(written) or written  # a view's own storage
        if _is_inplace_node(node.args[0]) and isinstance(written, TensorSpec) and written is not _view_spec_base(spec):
            object.__setattr__(spec, "_base", written)


def _make_memory_planning_pass(share_mutable_buffers: bool = False):
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.schema import TensorShapeDynamism

    class ProbeAwareMemoryPlanningPass(MemoryPlanningPass):
        """Leave probe outputs (and view copies of them) out of the planned arenas.

        The runtime binds them to the weight pool's tensors, so planning arena space for
        them would only make the activation arena hold weight-sized holes.
        """

        def _set_alloc_node_spec(self, graph_module: torch.fx.GraphModule) -> None:
            super()._set_alloc_node_spec(graph_module)
            unplanned = set()
            for node in graph_module.graph.nodes:
                if node.op != "call_function" or "out" not in node.kwargs:
                    continue
                if is_probe(node) or (is_view_like(node) and _probe_derived(first_tensor_input(node))):
                    spec = node.kwargs["out"].meta.get("spec")
                    if spec is not None:
                        spec.shape_dynamism = TensorShapeDynamism.DYNAMIC_UNBOUND
                        unplanned.add(id(spec))
            _in_place_results_as_their_inputs(graph_module)
            # A view_copy that ExecuTorch already turned into a memory view shares its base's
            # storage spec; it must share the base's dynamism too (the emitter then emits it
            # as an et_view instruction, which the runtime runs as a view of the pool tensor).
            for node in graph_module.graph.nodes:
                spec = node.meta.get("spec")
                base = _view_spec_base(spec)
                if base is not None and id(base) in unplanned:
                    _set_view_spec_dynamism(spec, TensorShapeDynamism.DYNAMIC_UNBOUND)
                    unplanned.add(id(spec))

    return ProbeAwareMemoryPlanningPass(share_mutable_buffers=share_mutable_buffers)


def emitted_probe_sequence(program, method: str = METHOD) -> list[tuple[int, str]]:
    """(probe_id, FQN) of every probe instruction of ``method``, in instruction order."""
    plan = plan_by_name(program, method)
    probe_ops = {i for i, op in enumerate(plan.operators) if op.name == PROBE_OPERATOR}
    sequence = []
    for chain in plan.chains:
        for instruction in chain.instructions:
            call = instruction.instr_args
            if type(call).__name__ == "KernelCall" and call.op_index in probe_ops:
                weight = plan.values[call.args[0]].val
                probe_id = plan.values[call.args[1]].val.int_val
                sequence.append((probe_id, weight.extra_tensor_info.fully_qualified_name))
    return sequence


def to_executorch(programs: ExportedProgram | dict[str, ExportedProgram], *, constant_methods: dict | None = None, progress=None):
    """Lower programs returned by ``apply_weight_offload`` to one ExecutorchProgramManager.

    ``programs`` is one program (the method ``forward``) or method name -> program; the
    methods of one program read the same weights and may share mutable buffers (state such
    as a KV cache, kept across method calls). Each method's schedule is rebuilt on the
    lowered graph (decompositions change the kernels, e.g. ``linear`` becomes
    ``permute_copy`` + ``addmm``) and checked against the emitted instructions, so what the
    ``.pte`` carries describes what the runtime will execute. ``constant_methods`` (name ->
    a scalar or a flat list) are stored beside the schedules.
    """
    edge, schedules = lower_to_edge(programs, progress)
    say = progress or (lambda _msg: None)
    say("hashing the weights")
    checksums, records = _weight_checksums({name: edge.exported_program(name) for name in schedules})
    return emit(edge, schedules, checksums, records, constant_methods=constant_methods, progress=progress)


def lower_to_edge(programs: ExportedProgram | dict[str, ExportedProgram], progress=None):
    """(EdgeProgramManager, method -> schedule of its lowered graph): the first half of
    ``to_executorch``, which reads no weight's values."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    if isinstance(programs, ExportedProgram):
        programs = {METHOD: programs}
    weights, options = {}, {}
    for name, ep in programs.items():
        weights[name] = get_weight_schedule(ep).fqns  # raises a clear error for a program the pass did not touch
        options[name] = ep.graph_module.meta[OPTIONS_META_KEY]
    say = progress or (lambda _msg: None)
    say("lowering to the edge dialect")
    # silu stays one kernel, as in eager PyTorch (the edge dialect would run sigmoid and mul)
    edge = to_edge_transform_and_lower(dict(programs), compile_config=EdgeCompileConfig(_check_ir_validity=False, preserve_ops=list(PRESERVED_OPS)))
    schedules = {}
    for name in programs:
        lowered = edge.exported_program(name)
        reprobe(lowered, weights[name])
        CustomOpOutVariantPass().call(lowered.graph_module)
        schedules[name] = schedule_with_options(lowered, options[name])
    return edge, schedules


@contextlib.contextmanager
def _external_weights_unread(fqns: set[str]):
    """While ExecuTorch emits a program, record the external weights named ``fqns`` by name
    only. Its emitter copies every constant's bytes into memory (to write its own .ptd, and
    to store identical tensors once); a program traced without its weights' values has none to
    copy, and the .ptd of such a program is written by ``save_streamed``.
    A weight's entry in the .pte is its name, dtype and shape, which stay the emitter's."""
    from executorch.exir.emit import _emitter
    from executorch.exir.schema import TensorDataLocation

    original = _emitter._Emitter._tensor_spec_to_evalue

    def to_evalue(self, spec, constant_tag=None):
        info = spec.extra_tensor_info
        if spec.const and info is not None and info.location == TensorDataLocation.EXTERNAL and info.fully_qualified_name in fqns:
            buffer_index = len(self.program_state.external_constant_buffer)
            self.program_state.external_constant_buffer.append(b"")
            self._save_to_external_constant_map(info.fully_qualified_name, buffer_index, constant_tag)
            return _emitter.EValue(_emitter.make_tensor_value(buffer_index, None, spec))
        return original(self, spec, constant_tag)

    _emitter._Emitter._tensor_spec_to_evalue = to_evalue
    try:
        yield
    finally:
        _emitter._Emitter._tensor_spec_to_evalue = original


def emit(edge, schedules: dict, checksums: dict[str, str], records: dict, *, constant_methods: dict | None = None, progress=None,
         unread: set[str] = frozenset()):
    """The second half of ``to_executorch``: the ExecuTorch program of the lowered methods,
    their schedules and the weights' digest (from ``records``) as constant methods.
    ``unread``: weights recorded by name only (``_external_weights_unread``)."""
    from executorch.exir import ExecutorchBackendConfig

    say = progress or (lambda _msg: None)
    # ExecutorchProgramManager emits EdgeProgramManager._config_methods as constant methods;
    # the schedules are only known after lowering, so they are set here rather than at creation.
    edge._config_methods = {**(edge._config_methods or {}), **(constant_methods or {}), **serialization.encode(schedules, weights_digest(records))}
    say("emitting the ExecuTorch program")
    with _external_weights_unread(set(unread)) if unread else contextlib.nullcontext():
        manager = edge.to_executorch(
            ExecutorchBackendConfig(
                external_constants=True,
                # State the methods mutate (a KV cache) gets a memory id of its own, at the same
                # offsets in every method: the runtime allocates it once and the methods share it.
                memory_planning_pass=_make_memory_planning_pass(share_mutable_buffers=True),
                emit_mutable_buffer_names=True,
                # state updates (the cache write of each layer) in place, not a copy of the whole buffer
                run_reinplace_pass=True,
            )
        )
    for name, schedule in schedules.items():
        emitted = emitted_probe_sequence(manager.executorch_program, name)
        expected = list(enumerate(schedule.probe_fqns()))
        if emitted != expected:
            first = next((i for i, (a, b) in enumerate(zip(emitted, expected)) if a != b), min(len(emitted), len(expected)))
            raise ScheduleError(
                f"method '{name}': the emitted probe sequence diverges from the lowered schedule at position {first}: "
                f"{emitted[first] if first < len(emitted) else 'end'} vs {expected[first] if first < len(expected) else 'end'}"
            )
    manager.hostswap_schedules = schedules
    manager.hostswap_weight_checksums = checksums
    # same kernels as the .pte: the bitwise reference
    manager.hostswap_edge_programs = {name: edge.exported_program(name) for name in schedules}
    if METHOD in schedules:
        manager.hostswap_schedule = schedules[METHOD]
        manager.hostswap_edge_program = manager.hostswap_edge_programs[METHOD]
    return manager


def _weight_checksums(programs: dict[str, ExportedProgram]) -> tuple[dict[str, str], dict]:
    """(FQN -> checksum, FQN -> (dtype, shape, checksum)) of every tensor ExecuTorch writes to
    the .ptd (read or not), hashed once (schedules/checksums.py)."""
    checksums, records = {}, {}
    for ep in programs.values():
        for fqn in weight_placeholders(ep).values():
            if fqn not in checksums:
                tensor = weight_tensor(ep, fqn)
                checksums[fqn] = tensor_checksum(tensor)
                records[fqn] = (dtype_name(tensor.dtype), tuple(tensor.shape), checksums[fqn])
    return checksums, records


def _check_ptd_holds(path: str, checksums: dict[str, str]) -> None:
    def read(offset: int, length: int) -> bytes:  # the index only, not the weights
        f.seek(offset)
        return f.read(length)

    with open(path, "rb") as f:
        keys = set(read_ptd_index(read, os.path.getsize(path), path).entries)
    if keys != set(checksums):
        raise WeightOffloadError(f"ExecuTorch wrote weights {sorted(keys - set(checksums))[:5]} that were not hashed, and hashed {sorted(set(checksums) - keys)[:5]} that it did not write")


def save(programs: ExportedProgram | dict[str, ExportedProgram], path: str | os.PathLike, *, constant_methods: dict | None = None, progress=None) -> tuple[str, str]:
    """Lower ``programs`` (one, or method name -> program) and write ``<path>.pte`` and
    ``<path>.ptd``; returns both paths.

    Both files are written under temporary names in the same folder and renamed only once both
    are complete, the ``.ptd`` first: an interrupted or failed save leaves nothing under the
    final names (and no temporary file), and an earlier pair there stays as it was until the
    new one replaces it."""
    directory, pte_path, ptd_path = _target_paths(path)
    manager = to_executorch(programs, constant_methods=constant_methods, progress=progress)
    if progress:
        progress(f"writing {pte_path} and {ptd_path}")
    program = manager.buffer  # the .pte holds no weights: small
    with tempfile.TemporaryDirectory(dir=directory, prefix=".hostswap-save-") as tmp:
        manager.write_tensor_data_to_file(tmp)
        written = [f for f in os.listdir(tmp) if f.endswith(".ptd")]
        if len(written) != 1:
            raise WeightOffloadError(f"expected ExecuTorch to write one .ptd, it wrote {written}")
        written = os.path.join(tmp, written[0])
        _check_ptd_holds(written, manager.hostswap_weight_checksums)
        _place_pair(tmp, program, written, manager.hostswap_weight_checksums, pte_path, ptd_path, progress)
    return pte_path, ptd_path


def _place_pair(tmp: str, program: bytes, weights_file: str, checksums: dict[str, str], pte_path: str, ptd_path: str, progress=None) -> None:
    """Finish a save in ``tmp``: the checksum trailer after the weights file's segments
    (schedules/checksums.py), the program beside it, then both moved to their final names, the
    ``.ptd`` first."""
    with open(weights_file, "ab") as f:
        f.write(encode_trailer(checksums, checksum(program)))
    program_file = os.path.join(tmp, "program.pte")
    with open(program_file, "wb") as f:
        f.write(program)
    if progress:
        progress("both files written; moving them into place")
    os.replace(weights_file, ptd_path)
    os.replace(program_file, pte_path)


def _target_paths(path) -> tuple[str, str, str]:
    """(directory, .pte path, .ptd path) of a save to ``path`` (with or without a suffix)."""
    path = os.fspath(path)
    for suffix in (".pte", ".ptd"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    return directory, path + ".pte", path + ".ptd"


def _zero_meta_state(ep: ExportedProgram) -> None:
    """Program state (a KV cache) traced on the meta device becomes zeros, as the runtime
    starts it; the emitter records its shape."""
    state = state_buffers(ep)
    for table in (ep.state_dict, ep.constants):
        for fqn, tensor in list(table.items()):
            if fqn in state and isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                table[fqn] = torch.zeros(tensor.shape, dtype=tensor.dtype)


class UntracedConstantError(ValueError):
    """A constant the program keeps inline was traced on the meta device: its value is unknown."""


def _check_constants_have_values(programs: dict[str, ExportedProgram], values: dict[str, torch.Tensor]) -> None:
    """Refuse, before lowering, a tensor the forward creates (``torch.tensor(...)``, kept inline
    in the ``.pte``) that tracing on the meta device left without a value."""
    for name, ep in programs.items():
        for spec in ep.graph_signature.input_specs:
            if spec.kind != InputKind.CONSTANT_TENSOR or INLINE_CONSTANT_MARK not in spec.arg.name or spec.target in values:
                continue
            tensor = ep.constants.get(spec.target)
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                raise UntracedConstantError(
                    f"method '{name}' creates a tensor in its forward ('{spec.target}', shape {list(tensor.shape)}) whose value tracing "
                    "without weights cannot know; export the loaded model instead (hostswap.llm.export, or export-llm of a model folder "
                    "loaded with transformers)")


def save_streamed(programs: dict[str, ExportedProgram], path: str | os.PathLike, tensor_for, *, constant_methods: dict | None = None,
                  progress=None, on_start=None, on_written=None, values: dict[str, torch.Tensor] | None = None) -> tuple[str, str]:
    """``save`` for programs traced with their weights on the meta device: each such weight's
    bytes come from ``tensor_for(entry)`` (a ``PtdTensor``: name, dtype, shape) when its turn
    comes, and go straight to the ``.ptd`` (index first, weights in access order, hashed as
    written), one tensor in memory at a time. ``values``: tensors traced on the meta device
    whose values are known (buffers computed at construction), put back by FQN once lowered.
    Other weights (constants made by tracing) are written from the programs themselves. The
    same temporary names and final moves as ``save``."""
    (pair,) = save_streamed_together([programs], [path], lambda entry, _: tensor_for(entry), constant_methods=[constant_methods], progress=progress,
                                     on_start=on_start, on_written=on_written, values=values)
    return pair


@dataclasses.dataclass
class _StreamedSave:
    """One program set of ``save_streamed_together``, lowered, its entries known."""

    directory: str
    pte: str
    ptd: str
    edge: object
    schedules: dict
    lowered: dict
    entries: list
    holder: dict  # FQN -> the lowered program's tensor (meta where its bytes come from tensor_for)
    unread: set
    constants: dict | None
    tmp: str = ""
    weights_file: str = ""


def save_streamed_together(program_sets: list[dict[str, ExportedProgram]], paths: list, tensor_for, *, constant_methods: list[dict | None],
                           progress=None, on_start=None, on_written=None, values: dict[str, torch.Tensor] | None = None) -> list[tuple[str, str]]:
    """``save_streamed`` of several program sets (a tensor-parallel model's ranks), their
    ``.ptd``s written side by side: the i-th weight of every set, then the (i+1)-th, each from
    ``tensor_for(entry, set_index)``. Sets that list the same weights in the same order (ranks
    of one model) ask for each weight in turn, so a source read once can serve them all.
    ``on_start`` gets every set's entries together; nothing is placed unless every set is written."""
    say = progress or (lambda _msg: None)
    saves = []
    for programs, path, constants in zip(program_sets, paths, constant_methods):
        directory, pte_path, ptd_path = _target_paths(path)
        _check_constants_have_values(programs, values or {})
        edge, schedules = lower_to_edge(programs, progress)
        lowered = {name: edge.exported_program(name) for name in schedules}
        for ep in lowered.values():
            for table in (ep.state_dict, ep.constants):
                for fqn in table.keys() & (values or {}).keys():
                    table[fqn] = values[fqn]
        tensors, holder = {}, {}
        for ep in lowered.values():
            for fqn in weight_placeholders(ep).values():
                if fqn not in tensors:
                    t = weight_tensor(ep, fqn)
                    tensors[fqn], holder[fqn] = PtdTensor(fqn, t.dtype, tuple(t.shape)), t
        entries = entries_in_order([s.fqns for s in schedules.values()], tensors)
        unread = {fqn for fqn, t in holder.items() if t.device.type == "meta"}
        saves.append(_StreamedSave(directory, pte_path, ptd_path, edge, schedules, lowered, entries, holder, unread, constants))
    with contextlib.ExitStack() as stack:
        for save in saves:
            save.tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=save.directory, prefix=".hostswap-save-"))
            save.weights_file = os.path.join(save.tmp, "weights.ptd")
        say(f"writing {sum(len(save.entries) for save in saves)} weights, {sum(e.nbytes for save in saves for e in save.entries) / 2**30:.2f} GiB")
        if on_start is not None:
            on_start([e for save in saves for e in save.entries])
        if len(saves) > 1:  # the files together must fit (each writer checks its own)
            check_room(saves[0].directory, sum(e.nbytes for save in saves for e in save.entries))
        writers = [PtdWriter(save.weights_file, save.entries) for save in saves]
        for i in range(max(len(save.entries) for save in saves)):
            for index, (save, writer) in enumerate(zip(saves, writers)):
                if i < len(save.entries):
                    entry = save.entries[i]
                    writer.write(tensor_for(entry, index) if entry.fqn in save.unread else save.holder[entry.fqn])
                    if on_written is not None:
                        on_written(entry)
        placed = []
        for save, writer in zip(saves, writers):
            checksums = writer.close()
            save.holder = {}
            records = {e.fqn: (dtype_name(e.dtype), e.shape, checksums[e.fqn]) for e in save.entries}
            for ep in save.lowered.values():
                _zero_meta_state(ep)
            manager = emit(save.edge, save.schedules, checksums, records, constant_methods=save.constants, progress=progress, unread=save.unread)
            _place_pair(save.tmp, manager.buffer, save.weights_file, checksums, save.pte, save.ptd, progress)
            placed.append((save.pte, save.ptd))
    return placed
