"""Fuse linears that read the same input into one: q/k/v, gate/up.

A program held whole on the device (a speculative draft) is bound by its kernel launches, not
its bytes: a decode step's int8 GEMV reads a few hundred KB, in about the time of a launch.
An attention block's q, k and v projections read the same normed hidden state, as an MLP's
gate and up projections do, so one linear over their weights stacked by output rows gives all
of them, sliced after: two launches less an attention block, one less an MLP.

Only weights stacked by rows fuse: ``aten.linear``, and ``hostswap::quantized_linear`` of
torchao's int8 weight-only per-row layout (each output row has its own scale, so a stacked row
is quantized as it was); with biases (stacked too) on all of a group or on none. Each output is the same dot product as before; a
kernel that blocks its sum by the output count may round it otherwise in the last bit.

Not for a program whose weights stream: a fused unit is fetched whole, which raises the floor.
"""

from __future__ import annotations

import collections
import json

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from hostswap.passes.quantized_linear import _is_int8_weight_only_per_row, quantized_linear

LINEAR = torch.ops.aten.linear.default
SLICE = torch.ops.aten.slice.Tensor
FUSABLE_OPS = (LINEAR, quantized_linear)


class FuseSiblingLinearsPass:
    """Stack the weights of bias-free linears that read one input into one linear."""

    def __init__(self, exported_program: ExportedProgram):
        self.ep = exported_program
        # stacked parameter's FQN -> (FQN, shape, dtype) of each part, in row order: what a
        # writer that reads weights by name (checkpoint.py) concatenates for it
        self.stacked: dict[str, tuple[tuple[str, tuple[int, ...], torch.dtype], ...]] = {}

    def call(self, graph_module: torch.fx.GraphModule) -> int:
        """Fuses in place; returns how many linears were removed."""
        graph = graph_module.graph
        groups = collections.defaultdict(list)
        for node in graph.nodes:
            key = self._key(node)
            if key is not None:
                groups[key].append(node)
        removed = 0
        for nodes in groups.values():
            if len(nodes) > 1:
                self._fuse(graph, nodes)
                removed += len(nodes) - 1
        if removed:
            graph.eliminate_dead_code()
            for node in [n for n in graph.nodes if n.op == "placeholder" and not n.users and n.name in self.ep.graph_signature.inputs_to_parameters]:
                _delete_parameter(self.ep, node)
            graph_module.recompile()
        return removed

    def _parameter(self, node) -> torch.Tensor | None:
        target = self.ep.graph_signature.inputs_to_parameters.get(getattr(node, "name", None))
        return None if target is None else self.ep.state_dict[target]

    def _key(self, node):
        """What a linear fuses by (its input and how its weights are laid out), or None."""
        if node.op != "call_function" or node.target not in FUSABLE_OPS:
            return None
        if node.target is LINEAR:
            x, weight, *bias = node.args
            w = self._parameter(weight)
            if w is None or w.dim() != 2 or not self._bias_fuses(bias[0] if bias else None):
                return None
            return (node.target, x, w.dtype, w.shape[1], bool(bias and bias[0] is not None))
        x, inner, bias, layout = node.args
        tensors = [self._parameter(t) for t in inner]
        if not self._bias_fuses(bias) or not _is_int8_weight_only_per_row(layout) or any(t is None for t in tensors):
            return None
        rows = json.loads(layout)["size"][0]
        if any(t.dim() == 0 or t.shape[0] != rows for t in tensors):
            return None
        spec = json.loads(layout)
        spec["size"] = spec["size"][1:]  # all but the rows, which differ
        return (node.target, x, tuple((t.dtype, tuple(t.shape[1:])) for t in tensors), json.dumps(spec, sort_keys=True), bias is not None)

    def _bias_fuses(self, bias) -> bool:
        return bias is None or (self._parameter(bias) is not None and self._parameter(bias).dim() == 1)

    def _stacked_bias(self, graph, nodes, index: int, name: str):
        biases = [n.args[index] if len(n.args) > index else None for n in nodes]
        if biases[0] is None:
            return None
        with graph.inserting_before(next(n for n in graph.nodes if n.op == "placeholder" and n.name in _user_inputs(self.ep))):
            return self._stack(graph, f"{name}_bias", biases)

    def _stack(self, graph, name: str, parts: list[torch.fx.Node]) -> torch.fx.Node:
        """A parameter of ``parts``' tensors stacked by rows, recorded in ``stacked``."""
        tensors = [self._parameter(p) for p in parts]
        node = _create_parameter(self.ep, graph, name, torch.cat(tensors))
        self.stacked[self.ep.graph_signature.inputs_to_parameters[node.name]] = tuple(
            (self.ep.graph_signature.inputs_to_parameters[p.name], tuple(t.shape), t.dtype) for p, t in zip(parts, tensors))
        return node

    def _fuse(self, graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
        first_input = next(n for n in graph.nodes if n.op == "placeholder" and n.name in _user_inputs(self.ep))
        names = [_stem(self.ep.graph_signature.inputs_to_parameters[(n.args[1] if n.target is LINEAR else n.args[1][0]).name]) for n in nodes]
        fused_name = _common_prefix(names) + "_".join(name[len(_common_prefix(names)):] for name in names)
        if nodes[0].target is LINEAR:
            rows = [self._parameter(n.args[1]).shape[0] for n in nodes]
            with graph.inserting_before(first_input):
                weight = self._stack(graph, f"{fused_name}_weight", [n.args[1] for n in nodes])
            args = (nodes[0].args[0], weight, self._stacked_bias(graph, nodes, 2, fused_name))
        else:
            spec = json.loads(nodes[0].args[3])
            rows = [json.loads(n.args[3])["size"][0] for n in nodes]
            spec["size"] = [sum(rows), *spec["size"][1:]]
            with graph.inserting_before(first_input):
                stacked = [self._stack(graph, f"{fused_name}_{name}", [n.args[1][i] for n in nodes]) for i, name in enumerate(spec["names"])]
            args = (nodes[0].args[0], stacked, self._stacked_bias(graph, nodes, 2, fused_name), json.dumps(spec))
        position = min(nodes, key=_order(graph))
        with graph.inserting_before(position):
            fused = graph.call_function(nodes[0].target, args)
            fused.meta["val"] = _fake_result(nodes[0], sum(rows))
            start = 0
            for node, n in zip(nodes, rows):
                piece = graph.call_function(SLICE, (fused, -1, start, start + n))
                piece.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(piece)
                graph.erase_node(node)
                start += n


def fuse_sibling_linears(exported_program: ExportedProgram) -> dict[str, tuple[tuple[str, tuple[int, ...], torch.dtype], ...]]:
    """Fuse ``exported_program``'s sibling linears in place; returns each stacked parameter's
    parts (``FuseSiblingLinearsPass.stacked``), empty where nothing fused."""
    fuse = FuseSiblingLinearsPass(exported_program)
    fuse.call(exported_program.graph_module)
    return fuse.stacked


def _user_inputs(ep: ExportedProgram) -> set[str]:
    return {spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT}


def _order(graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _stem(fqn: str) -> str:
    """A weight's module path as an identifier, less its tensor's own name."""
    module = fqn.rsplit(".", 1)[0]
    return module.replace(".", "_")


def _common_prefix(names: list[str]) -> str:
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    return prefix[: prefix.rfind("_") + 1]


def _fake_result(node: torch.fx.Node, rows: int):
    val = node.meta["val"]
    return val.new_empty((*val.shape[:-1], rows))


def _create_parameter(ep: ExportedProgram, graph: torch.fx.Graph, name: str, data: torch.Tensor) -> torch.fx.Node:
    from executorch.backends.transforms.utils import create_constant_placeholder

    return create_constant_placeholder(ep, graph, name, InputKind.PARAMETER, data)


def _delete_parameter(ep: ExportedProgram, node: torch.fx.Node) -> None:
    from executorch.backends.transforms.utils import delete_constant_placeholder

    delete_constant_placeholder(ep, node)


__all__ = ["FUSABLE_OPS", "FuseSiblingLinearsPass", "fuse_sibling_linears"]
