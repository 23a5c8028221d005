"""Probe pass: read every weight through ``hostswap::probe`` and record the static schedule."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from hostswap.passes import probe_op
from hostswap.passes.fused_attention import KeepFusedAttentionPass
from hostswap.passes.fused_rms_norm import FuseRmsNormPass
from hostswap.passes.fused_rotary import FuseRotaryPass
from hostswap.passes.grouped_query_attention import GroupedQueryAttentionPass
from hostswap.passes.quantized_linear import is_torchao_tensor
from hostswap.passes.graph_facts import first_tensor_input, gathered_only, is_probe, is_view_like, reads_no_data, underlying_op, view_chain_root, views_and_readers
from hostswap.passes.schedule_builder import schedule_from_graph
from hostswap.schedules.weight_schedule import WeightSchedule, check_prefetch_depth

SCHEDULE_META_KEY = "hostswap_weight_schedule"
OPTIONS_META_KEY = "hostswap_weight_offload_options"

WEIGHT_INPUT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


class WeightOffloadError(ValueError):
    """A program or an argument the weight pass cannot handle; the message names the culprit."""


@dataclasses.dataclass(frozen=True)
class WeightOffloadOptions:
    prefetch_depth: int
    pin: tuple[str, ...]
    host_read: tuple[str, ...] = ()  # weights that kernels read in place from host memory, unprobed


# ExecuTorch keeps a constant whose placeholder name contains this inline in the .pte, not in
# the .ptd (its external-constants pass: "lifted constants are closer to code than data"):
# tensors a forward creates (``torch.tensor(...)``) and the scalars lowering lifts. They are
# not streamed; the runtime puts them on the device at load, outside the budget.
INLINE_CONSTANT_MARK = "_lifted_tensor"
# An inline constant larger than this is refused: it would sit on the device unbudgeted.
MAX_INLINE_CONSTANT_BYTES = 1 << 20


def _input_weights(ep: ExportedProgram) -> dict[str, str]:
    return {
        spec.arg.name: spec.target
        for spec in ep.graph_signature.input_specs
        if spec.kind in WEIGHT_INPUT_KINDS and spec.target is not None
    }


def state_buffers(ep: ExportedProgram) -> set[str]:
    """FQNs of the buffers the program mutates (functionally, or in place in a graph export
    left unfunctionalised): its state (a KV cache), kept on the device across calls and
    never streamed."""
    buffers = {spec.arg.name: spec.target for spec in ep.graph_signature.input_specs if spec.kind == InputKind.BUFFER}
    return set(ep.graph_signature.buffers_to_mutate.values()) | _written_in_place(ep, buffers)


def weight_placeholders(ep: ExportedProgram) -> dict[str, str]:
    """Placeholder name -> FQN of the weights hostswap streams: parameters, buffers and tensor
    constants, less the constants ExecuTorch keeps inline and the program's state."""
    state = state_buffers(ep)
    return {name: fqn for name, fqn in _input_weights(ep).items() if INLINE_CONSTANT_MARK not in name and fqn not in state}


def weight_tensor(ep: ExportedProgram, fqn: str) -> torch.Tensor:
    if fqn in ep.state_dict:
        return ep.state_dict[fqn]
    return ep.constants[fqn]


def _check_streamable(fqn: str, tensor: torch.Tensor) -> None:
    if isinstance(tensor, torch.nn.Parameter):
        tensor = tensor.data
    if type(tensor) is not torch.Tensor:
        hint = ("a torchao quantized weight: call hostswap.prepare_quantized(model) before torch.export, which makes its packed "
                "data and scales plain weights of one kernel (hostswap.llm.export does this)") if is_torchao_tensor(tensor) else "convert it to a plain tensor before export"
        raise WeightOffloadError(f"weight '{fqn}' is a {type(tensor).__name__}, a tensor subclass hostswap cannot stream; {hint}")
    if tensor.numel() == 0:
        raise WeightOffloadError(f"weight '{fqn}' has zero elements (shape {tuple(tensor.shape)}); it cannot be streamed")
    storage_bytes = tensor.untyped_storage().nbytes()
    own_bytes = tensor.numel() * tensor.element_size()
    if tensor.storage_offset() != 0 or storage_bytes != own_bytes:
        raise WeightOffloadError(
            f"weight '{fqn}' is a view into a larger storage (shape {tuple(tensor.shape)}, "
            f"storage offset {tensor.storage_offset()}, {own_bytes} of {storage_bytes} storage bytes); "
            "give it its own storage with .clone().contiguous() before export"
        )


# Views whose result depends on the strides of their input: a permuted weight stored
# contiguous would change what they read.
STRIDE_DEPENDENT_VIEWS = frozenset({"aten::view", "aten::_unsafe_view", "aten::view_copy", "aten::as_strided", "aten::as_strided_copy"})


def _stride_dependent_reader(placeholder: torch.fx.Node) -> torch.fx.Node | None:
    """A view of ``placeholder`` (through a chain of views) that depends on its strides."""
    views, _ = views_and_readers(placeholder)
    return next((v for v in views if (op := underlying_op(v.target)) is not None and op._schema.name in STRIDE_DEPENDENT_VIEWS), None)


def _permuted_weights(ep: ExportedProgram, by_placeholder: dict[str, str]):
    """(placeholder, FQN, tensor) of every weight that is not contiguous."""
    for node in ep.graph.nodes:
        fqn = by_placeholder.get(node.name) if node.op == "placeholder" else None
        if fqn is not None and not weight_tensor(ep, fqn).is_contiguous():
            yield node, fqn, weight_tensor(ep, fqn)


def _check_contiguous_storage_is_safe(ep: ExportedProgram, by_placeholder: dict[str, str]) -> None:
    for node, fqn, tensor in _permuted_weights(ep, by_placeholder):
        reader = _stride_dependent_reader(node)
        if reader is not None:
            raise WeightOffloadError(
                f"weight '{fqn}' is not contiguous (stride {tuple(tensor.stride())}) and '{reader.name}' "
                f"({reader.target}) views it through its strides; make it contiguous with .contiguous() before export"
            )


def _make_contiguous(ep: ExportedProgram, by_placeholder: dict[str, str]) -> None:
    """Store dense weights that are laid out permuted (a transposed constant) contiguously.

    The ``.ptd`` holds each weight as a contiguous run of its own bytes; the values, and so
    every kernel's result, are unchanged. The placeholder's metadata follows.
    """
    for node, fqn, tensor in list(_permuted_weights(ep, by_placeholder)):
        if fqn in ep.state_dict:
            data = tensor.data.contiguous() if isinstance(tensor, torch.nn.Parameter) else tensor.contiguous()
            ep.state_dict[fqn] = torch.nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else data
        else:
            ep.constants[fqn] = tensor.contiguous()
        node.meta["val"] = node.meta["val"].contiguous()


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


class WeightOffloadPass:
    """Put a ``hostswap::probe`` in front of every (consumer, weight) use, views behind it."""

    def __init__(self, weight_fqn_by_placeholder: dict[str, str]):
        self.weight_fqn_by_placeholder = weight_fqn_by_placeholder

    def _weight_root(self, node: torch.fx.Node) -> torch.fx.Node | None:
        """The weight placeholder that ``node`` is (a view chain of), else None."""
        root = view_chain_root(node)
        return root if root is not None and root.op == "placeholder" and root.name in self.weight_fqn_by_placeholder else None

    @staticmethod
    def _view_chain(node: torch.fx.Node, root: torch.fx.Node) -> list[torch.fx.Node]:
        chain = []
        while node is not root:
            chain.append(node)
            node = first_tensor_input(node)
        return list(reversed(chain))

    def call(self, graph_module: torch.fx.GraphModule) -> int:
        """Rewrites the graph in place; returns the number of probes inserted."""
        graph = graph_module.graph
        next_probe_id = 0
        for consumer in list(graph.nodes):
            if consumer.op == "output":
                for arg in consumer.all_input_nodes:
                    root = self._weight_root(arg)
                    if root is not None:
                        raise WeightOffloadError(
                            f"weight '{self.weight_fqn_by_placeholder[root.name]}' is returned by the program; "
                            "hostswap serves weights only to kernels (return a copy instead)"
                        )
                continue
            if consumer.op != "call_function" or is_view_like(consumer) or is_probe(consumer) or reads_no_data(consumer):
                continue
            probes: dict[torch.fx.Node, torch.fx.Node] = {}
            replacements: dict[torch.fx.Node, torch.fx.Node] = {}
            weight_args = [(arg, root) for arg in consumer.all_input_nodes if (root := self._weight_root(arg)) is not None]
            # A kernel's largest weight is probed (and so copied) first: the order does not
            # depend on the argument order of the dialect (``addmm`` takes the bias first,
            # ``linear`` last), and the planned ring packs large-before-small tighter.
            weight_args.sort(key=lambda pair: -_nbytes(pair[1]))
            for arg, root in weight_args:
                with graph.inserting_before(consumer):
                    if root not in probes:
                        probe_node = graph.call_function(probe_op.probe, (root, next_probe_id))
                        probe_node.meta["val"] = root.meta["val"]
                        probe_node.meta["hostswap_fqn"] = self.weight_fqn_by_placeholder[root.name]
                        probe_node.meta.setdefault("stack_trace", consumer.meta.get("stack_trace"))
                        probe_node.meta["nn_module_stack"] = consumer.meta.get("nn_module_stack", {})
                        probes[root] = probe_node
                        next_probe_id += 1
                    current = probes[root]
                    for view in self._view_chain(arg, root):
                        parent = first_tensor_input(view)
                        current = graph.node_copy(view, lambda n, parent=parent, new_parent=current: new_parent if n is parent else n)
                replacements[arg] = current
            for old, new in replacements.items():
                consumer.replace_input_with(old, new)
        graph.eliminate_dead_code()
        graph_module.recompile()
        return next_probe_id


def reprobe(ep: ExportedProgram, fqns: Iterable[str]) -> int:
    """Derive the probes of a lowered program from its own kernels.

    Lowering deletes ops (checks, no-op casts), decomposes others and may leave one probe
    in front of two kernels. The probes are therefore taken out and put back by the same
    pass on the lowered graph, so every probe id is dense and each probe feeds exactly one
    kernel that survives into the emitted program. Only ``fqns``, the weights of the program
    before lowering, are probed: lowering lifts scalars into constants of its own, which the
    program carries inline. Returns the number of probes.
    """
    fqns = set(fqns)
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if is_probe(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    weights = {name: fqn for name, fqn in weight_placeholders(ep).items() if fqn in fqns}
    return WeightOffloadPass(weights).call(ep.graph_module)


def _written_in_place(ep: ExportedProgram, by_placeholder: dict[str, str]) -> set[str]:
    """FQNs that an op of the graph writes in place (export may keep ``add_`` on a buffer)."""
    written = set()
    for node in ep.graph.nodes:
        op = underlying_op(node.target) if node.op == "call_function" else None
        if op is None:
            continue
        for arg_schema, arg in zip(op._schema.arguments, node.args):
            alias = arg_schema.alias_info
            if alias is not None and alias.is_write and isinstance(arg, torch.fx.Node):
                root = view_chain_root(arg)
                if root is not None and root.op == "placeholder" and root.name in by_placeholder:
                    written.add(by_placeholder[root.name])
    return written


def host_read_weights(ep: ExportedProgram, by_placeholder: dict[str, str], pin: Iterable[str]) -> tuple[str, ...]:
    """FQNs of the weights that only row gathers read (an untied embedding table), pinned
    ones aside: a gather on the device reads its few rows from host memory, so the table is
    neither copied nor counted in the budget."""
    pin = set(pin)
    return tuple(by_placeholder[n.name] for n in ep.graph.nodes
                 if n.op == "placeholder" and n.name in by_placeholder and by_placeholder[n.name] not in pin and gathered_only(n))


def _validate(ep: ExportedProgram, prefetch_depth: int, pin: Iterable[str]) -> tuple[dict[str, str], tuple[str, ...]]:
    if not isinstance(ep, ExportedProgram):
        raise WeightOffloadError(
            f"apply_weight_offload expects a torch.export.ExportedProgram, got {type(ep).__name__}"
        )
    if OPTIONS_META_KEY in ep.graph_module.meta or any(is_probe(n) for n in ep.graph.nodes):
        raise WeightOffloadError("apply_weight_offload was already applied to this program (it contains hostswap::probe nodes)")
    check_prefetch_depth(prefetch_depth, WeightOffloadError)
    if isinstance(pin, str):
        raise WeightOffloadError(f"pin must be a collection of FQNs, got the string {pin!r}")
    pin = tuple(dict.fromkeys(pin))
    for name, fqn in _input_weights(ep).items():
        t = weight_tensor(ep, fqn)
        nbytes = t.numel() * t.element_size()
        if INLINE_CONSTANT_MARK in name and nbytes > MAX_INLINE_CONSTANT_BYTES:
            raise WeightOffloadError(
                f"tensor constant '{fqn}' ({nbytes} bytes) is created inside forward; ExecuTorch keeps such "
                "constants in the program, on the device outside the budget. Register it as a buffer of the module instead"
            )
    by_placeholder = weight_placeholders(ep)
    fqns = set(by_placeholder.values())
    if not fqns:
        raise WeightOffloadError("the program has no weights (parameters, buffers or tensor constants) to offload")
    for fqn in pin:
        if fqn not in fqns:
            raise WeightOffloadError(f"pin names '{fqn}', which is not a weight of this program (weights: {sorted(fqns)[:8]}...)")
    written = _written_in_place(ep, by_placeholder)
    for fqn in sorted(fqns):
        if fqn in written:
            raise WeightOffloadError(f"weight '{fqn}' is written in place by the program; hostswap streams read-only weights")
        _check_streamable(fqn, weight_tensor(ep, fqn))
    for fqn in sorted(state_buffers(ep)):
        # The runtime keeps state in device memory it zeroes at load: any other start would be lost.
        t = weight_tensor(ep, fqn)
        # a meta tensor (a model traced without its weights) has no values: a static cache starts at zero by construction
        if t.numel() and t.device.type != "meta" and bool(t.detach().ne(0).any()):
            raise WeightOffloadError(
                f"buffer '{fqn}' is program state (the program mutates it) and starts nonzero; hostswap starts "
                "program state at zero on the device. Zero it before export, or make it an input"
            )
    _check_contiguous_storage_is_safe(ep, by_placeholder)
    return by_placeholder, pin


def apply_weight_offload(ep: ExportedProgram, *, prefetch_depth: int = 1, pin: Sequence[str] = (), gather_from_host: bool = True) -> ExportedProgram:
    """Read every weight of ``ep`` through ``hostswap::probe`` and record the access order and floor.

    Rewrites ``ep`` in place (after every check has passed, so a refused program is left as
    it was) and returns it. ``pin`` FQNs stay resident for the program's lifetime. With
    ``gather_from_host``, a weight that only row gathers read (an embedding table not tied
    to the output layer) gets no probe: on the GPU the gather reads the rows it needs
    straight from the registered host mapping, so the table takes no budget and no copies.
    """
    by_placeholder, pin = _validate(ep, prefetch_depth, pin)
    if not isinstance(gather_from_host, bool):
        raise WeightOffloadError(f"gather_from_host must be True or False, got {gather_from_host!r}")
    host_read = host_read_weights(ep, by_placeholder, pin) if gather_from_host else ()
    _make_contiguous(ep, by_placeholder)
    WeightOffloadPass({name: fqn for name, fqn in by_placeholder.items() if fqn not in host_read}).call(ep.graph_module)
    # lowering would otherwise decompose attention into the math reference (see fused_attention.py)
    KeepFusedAttentionPass().call(ep.graph_module)
    # which reads a grouped-query cache in place, not with its heads repeated (grouped_query_attention.py)
    GroupedQueryAttentionPass().call(ep.graph_module)
    # and run each RMSNorm and rotary embedding as one op, not a launch per ATen op (fused_rms_norm.py, fused_rotary.py)
    FuseRmsNormPass().call(ep.graph_module)
    FuseRotaryPass().call(ep.graph_module)
    options = WeightOffloadOptions(prefetch_depth=prefetch_depth, pin=pin, host_read=host_read)
    ep.graph_module.meta[OPTIONS_META_KEY] = options
    schedule = schedule_from_exported_program(ep)
    ep.graph_module.meta[SCHEDULE_META_KEY] = schedule
    return ep


def schedule_from_exported_program(ep: ExportedProgram) -> WeightSchedule:
    """The weight schedule of a probed program (aten or edge dialect)."""
    return schedule_with_options(ep, ep.graph_module.meta[OPTIONS_META_KEY])


def schedule_with_options(ep: ExportedProgram, options: WeightOffloadOptions) -> WeightSchedule:
    """The weight schedule of ``ep``'s probes, with the pass options given (lowering passes
    them explicitly: lowered graph modules do not keep the pass's metadata)."""
    by_placeholder = weight_placeholders(ep)
    weight_bytes, weight_dtypes = {}, {}
    for fqn in by_placeholder.values():
        t = weight_tensor(ep, fqn)
        weight_bytes[fqn] = t.numel() * t.element_size()
        weight_dtypes[fqn] = str(t.dtype).removeprefix("torch.")
    # Lowering must leave a host-read table to row gathers alone; a kernel that read it whole
    # on the device would read host memory at PCIe speed, unscheduled.
    still = set(host_read_weights(ep, by_placeholder, options.pin))
    lost = [fqn for fqn in options.host_read if fqn not in still]
    if lost:
        raise WeightOffloadError(f"weight '{lost[0]}' was read only by row gathers (embedding) before lowering, but not after; "
                                 "export with apply_weight_offload(..., gather_from_host=False)")
    return schedule_from_graph(
        ep.graph_module.graph,
        fqn_of_placeholder=by_placeholder,
        weight_bytes=weight_bytes,
        weight_dtypes=weight_dtypes,
        prefetch_depth=options.prefetch_depth,
        pin=options.pin,
        host_read=options.host_read,
    )


def get_weight_schedule(ep: ExportedProgram) -> WeightSchedule:
    """The schedule ``apply_weight_offload`` recorded on ``ep``."""
    if SCHEDULE_META_KEY not in ep.graph_module.meta:
        raise WeightOffloadError("this program was not passed through hostswap.apply_weight_offload")
    return ep.graph_module.meta[SCHEDULE_META_KEY]
