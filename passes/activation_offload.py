"""Activation offload pass on AOTAutograd's partitioned forward and backward graphs.

``activation_offload_backend(model_layers=n, num_layers=k)`` is a ``torch.compile`` backend:
AOTAutograd traces the joint graph and partitions it (min-cut, as Inductor does); this pass
then rewrites the two graphs so that the saved activations of the offloaded layers go to
pinned host memory and come back, at the points the synchronization dictionary gives
(schedules/sync_dict.py), through the ops of runtime/activation_offload.py; the graphs are
then compiled by Inductor (default) or run eagerly.

Graph facts first, as plain data (``SavedGroup`` per offloaded base tensor), then rewrites
driven by them:

* a saved tensor belongs to the layer whose block produced it (``nn_module_stack``; the layers
  are the blocks of the repeated module list, found automatically or named by ``layers=``);
* views are traced to their base: the base is offloaded once and the views are rebuilt with
  ``as_strided`` after reload; a base saved twice is offloaded once;
* parameters and inputs (graph placeholders), tensors under ``min_tensor_size_to_offload``
  bytes and tensors passed through ``hostswap.mark_not_offload`` stay on the GPU;
* a saved tensor that is not dense is copied contiguous on the main stream (with a warning)
  and restored to its strides after reload.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import torch
import torch.fx

from hostswap.passes.graph_facts import is_aliasing_view
from hostswap.runtime.activation_offload import OffloadSynchronizer, is_dense
from hostswap.schedules.sync_dict import ActivationSchedule, LayerRecord, SyncDictError, default_sync_dict, validate_sync_dict

ACT_OFFLOAD = torch.ops.hostswap.act_offload.default
ACT_BOUNDARY = torch.ops.hostswap.act_boundary.default
ACT_RELOAD = torch.ops.hostswap.act_reload.default
NOT_OFFLOAD = torch.ops.hostswap.not_offload.default
INNER_COMPILERS = ("inductor", "eager")
_LAYER_SEGMENT = re.compile(r"^(?P<prefix>.+?)[.\[](?P<index>\d+)\]?(?=$|[.\[])")


class ActivationOffloadError(ValueError):
    """The model or options cannot be offloaded as asked; the message names the culprit."""


class OffloadCoverageWarning(UserWarning):
    """The layers asked to be offloaded save mostly tensors the pass keeps on the GPU."""


# Below this fraction of the asked layers' saved bytes actually offloaded, the backend warns.
LOW_COVERAGE_FRACTION = 0.5


class NonContiguousOffloadWarning(UserWarning):
    """A saved activation is not dense: it is copied contiguous on the main stream first."""


@dataclasses.dataclass
class SavedGroup:
    """One offloaded base tensor and the saved forward outputs that are it or views of it."""

    tensor_id: int
    layer: int
    base: torch.fx.Node
    saved: list[torch.fx.Node]
    nbytes: int
    dense: bool


def _tensor_val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _stack_paths(node: torch.fx.Node, backward: bool = False) -> list[str]:
    stack = node.meta.get("fwd_nn_module_stack" if backward else "nn_module_stack") or {}
    return [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]


def _layer_key(path: str) -> tuple[str, int] | None:
    m = _LAYER_SEGMENT.match(path)
    return (m.group("prefix"), int(m.group("index"))) if m else None


class LayerMap:
    """Which repeated block (layer 0..n-1 in forward order) a graph node belongs to."""

    def __init__(self, forward: torch.fx.Graph, layers: str | None):
        first_seen: dict[tuple[str, int], int] = {}
        for position, node in enumerate(forward.nodes):
            for path in _stack_paths(node):
                key = _layer_key(path)
                if key:
                    first_seen.setdefault(key, position)
                    break
        by_prefix: dict[str, set[int]] = {}
        for prefix, index in first_seen:
            by_prefix.setdefault(prefix, set()).add(index)
        if not by_prefix:
            # a graph with no block at all (a graph break's piece, such as a loss): nothing to offload
            self.prefix, self.index_to_layer, self.num_layers = None, {}, 0
            return
        if layers is not None:
            chosen = [p for p in by_prefix if p == layers or p.endswith("." + layers)]
            if not chosen:
                raise ActivationOffloadError(f"layers={layers!r} names no repeated block list of this model (found: {sorted(by_prefix)})")
            self.prefix = chosen[0]
        else:
            self.prefix = max(by_prefix, key=lambda p: (len(by_prefix[p]), -min(first_seen[(p, i)] for i in by_prefix[p])))
        ordered = sorted(by_prefix[self.prefix], key=lambda i: first_seen[(self.prefix, i)])
        self.index_to_layer = {index: layer for layer, index in enumerate(ordered)}
        self.num_layers = len(ordered)

    def layer(self, node: torch.fx.Node, backward: bool = False) -> int | None:
        for path in _stack_paths(node, backward):
            key = _layer_key(path)
            if key and key[0] == self.prefix:
                return self.index_to_layer.get(key[1])
        return None


def saved_groups(forward: torch.fx.GraphModule, num_fwd_outputs: int, layer_map: LayerMap, min_bytes: int) -> tuple[list[SavedGroup], dict[int, int]]:
    """Offloadable bases of the saved forward outputs, and the bytes kept on the GPU per layer."""
    outputs = list(forward.graph.output_node().args[0])
    saved = [n for n in outputs[num_fwd_outputs:] if isinstance(n, torch.fx.Node) and _tensor_val(n) is not None]
    groups: dict[torch.fx.Node, SavedGroup] = {}
    kept: dict[int, int] = {}
    for node in dict.fromkeys(saved):
        base, marked = node, False
        while True:
            marked |= base.op == "call_function" and base.target is NOT_OFFLOAD
            if not is_aliasing_view(base):
                break
            base = base.args[0]
        layer = layer_map.layer(base)
        if base.op == "placeholder" or layer is None:
            continue  # parameters, inputs and what no layer produced stay
        val = _tensor_val(base)
        nbytes = val.numel() * val.element_size()
        if marked or nbytes < min_bytes or any(u.target is NOT_OFFLOAD for u in base.users) or val.device.type == "meta":
            kept[layer] = kept.get(layer, 0) + nbytes
            continue
        if base not in groups:
            groups[base] = SavedGroup(len(groups), layer, base, [], nbytes, is_dense(val))
        groups[base].saved.append(node)
    return list(groups.values()), kept


def _insert_boundary(graph: torch.fx.Graph, first: torch.fx.Node, sync_id: int, point: int, avoid: set, keep: list | None = None) -> None:
    """Thread one tensor input of ``first`` through act_boundary, for ``first`` and all after it."""
    inputs = [n for n in first.all_input_nodes if _tensor_val(n) is not None]
    if not inputs:
        return
    x = next((n for n in inputs if n not in avoid and n.op != "placeholder"), next((n for n in inputs if n not in avoid), inputs[0]))
    with graph.inserting_before(first):
        marker = graph.call_function(ACT_BOUNDARY, (x, sync_id, point, list(keep or [])))
    marker.meta["val"] = _tensor_val(x)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for user in list(x.users):
        if user is not marker and order[user] > order[marker]:
            user.replace_input_with(x, marker)


class ActivationOffloadPass:
    """Rewrite a partitioned (forward, backward) pair so offload and reload follow the dictionary."""

    def __init__(self, schedule: ActivationSchedule, synchronizer: OffloadSynchronizer, layers: str | None, min_tensor_size_to_offload: int):
        self.schedule, self.synchronizer = schedule, synchronizer
        self.layers, self.min_bytes = layers, min_tensor_size_to_offload
        self.found_layers = False  # whether the last graph passed to call held a block

    def call(self, forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_fwd_outputs: int) -> list[SavedGroup]:
        layer_map = LayerMap(forward.graph, self.layers)
        n = self.schedule.model_layers
        self.found_layers = layer_map.num_layers > 0
        if not self.found_layers:
            return []
        if layer_map.num_layers != n:
            raise ActivationOffloadError(f"model_layers={n}, but the compiled model has {layer_map.num_layers} blocks in '{layer_map.prefix}'")
        groups, kept = saved_groups(forward, num_fwd_outputs, layer_map, self.min_bytes)
        for layer, nbytes in kept.items():
            self.schedule.layers.setdefault(layer, LayerRecord(layer)).kept_bytes += nbytes
        groups = [g for g in groups if g.layer in self.schedule.sync or self.schedule.manual]
        self._warn_on_low_coverage(groups, kept)
        for g in groups:
            rec = self.schedule.layers.setdefault(g.layer, LayerRecord(g.layer))
            rec.saved_bytes += g.nbytes
            rec.tensors += 1
            self.synchronizer.register(g.tensor_id, g.layer)
            if not g.dense:
                warnings.warn(
                    f"activation '{g.base.name}' of layer {g.layer} is not dense (stride {tuple(_tensor_val(g.base).stride())}): "
                    "it is copied contiguous on the main stream before its offload and restored after reload",
                    NonContiguousOffloadWarning, stacklevel=2,
                )
        self._rewrite_forward(forward, groups, layer_map)
        self._rewrite_backward(backward, groups, layer_map)
        for gm in (forward, backward):
            gm.graph.lint()
            gm.recompile()
        return groups

    def _warn_on_low_coverage(self, groups: list[SavedGroup], kept: dict[int, int]) -> None:
        asked = [layer for layer in range(self.schedule.model_layers) if layer in self.schedule.sync or self.schedule.manual]
        offloaded = sum(g.nbytes for g in groups)
        kept_in_asked = sum(kept.get(layer, 0) for layer in asked)
        if not asked or offloaded >= LOW_COVERAGE_FRACTION * (offloaded + kept_in_asked):
            return
        warnings.warn(
            f"activation offload of layers {asked}: {offloaded} bytes offloaded, {kept_in_asked} bytes of their saved "
            f"activations stay on the GPU (tensors under min_tensor_size_to_offload={self.min_bytes} bytes, or marked "
            "not to offload); lower min_tensor_size_to_offload to offload them",
            OffloadCoverageWarning, stacklevel=2,
        )

    def _rewrite_forward(self, forward, groups, layer_map) -> None:
        graph = forward.graph
        sync_id = self.synchronizer.id
        replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        for g in groups:
            with graph.inserting_after(g.base):
                placeholder = graph.call_function(ACT_OFFLOAD, (g.base, sync_id, g.tensor_id))
            placeholder.meta["val"] = _tensor_val(g.base).new_empty((0,))
            for s in g.saved:
                replaced[s] = placeholder
        output = graph.output_node()
        outs = list(output.args[0])
        output.args = (tuple(replaced.get(o, o) if isinstance(o, torch.fx.Node) else o for o in outs),)
        graph.eliminate_dead_code()
        if self.schedule.manual:
            return
        first_of_layer: dict[int, torch.fx.Node] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target not in (ACT_OFFLOAD,):
                layer = layer_map.layer(node)
                if layer is not None:
                    first_of_layer.setdefault(layer, node)
        # A boundary at every layer, whether or not something happens there: the graphs of
        # num_layers=0 and of any dictionary then differ only in the offload and reload nodes,
        # so compilers fuse the same kernels and comparisons of the two see like with like.
        released_at: dict[int, list[torch.fx.Node]] = {}
        for g in groups:
            released_at.setdefault(self.schedule.finish_point(g.layer), []).append(g.base)
        for layer in range(self.schedule.model_layers):
            if layer in first_of_layer:
                _insert_boundary(graph, first_of_layer[layer], sync_id, layer, avoid=set(), keep=released_at.get(layer, []))


    def _rewrite_backward(self, backward, groups, layer_map) -> None:
        graph = backward.graph
        sync_id = self.synchronizer.id
        placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
        saved_placeholders = set()
        n = self.schedule.model_layers
        if not self.schedule.manual:
            first_of_layer: dict[int, torch.fx.Node] = {}
            for node in graph.nodes:
                if node.op == "call_function":
                    layer = layer_map.layer(node, backward=True)
                    if layer is not None:
                        first_of_layer.setdefault(layer, node)
            avoid = {placeholders[s.name] for g in groups for s in g.saved if s.name in placeholders}
            for layer in reversed(range(n)):
                p = 2 * n - 1 - layer
                if layer in first_of_layer:
                    _insert_boundary(graph, first_of_layer[layer], sync_id, p, avoid)
        order = {node: i for i, node in enumerate(graph.nodes)}
        first_read: dict[int, int] = {}
        for g in groups:
            phs = [placeholders[s.name] for s in g.saved if s.name in placeholders]
            if not phs:
                continue
            saved_placeholders.update(phs)
            users = [u for ph in phs for u in ph.users]
            first_user = min(users, key=lambda u: order[u]) if users else graph.output_node()
            first_read[g.tensor_id] = order[first_user]
            val = _tensor_val(g.base)
            with graph.inserting_before(first_user):
                reloaded = graph.call_function(ACT_RELOAD, (phs[0], sync_id, g.tensor_id, list(val.shape), list(val.stride()), val.dtype))
            reloaded.meta["val"] = val
            for s, ph in zip([s for s in g.saved if s.name in placeholders], phs):
                target = reloaded
                if s is not g.base:
                    sval = _tensor_val(s)
                    with graph.inserting_after(reloaded):
                        target = graph.call_function(torch.ops.aten.as_strided.default, (reloaded, list(sval.shape), list(sval.stride()), sval.storage_offset() - val.storage_offset()))
                    target.meta["val"] = sval
                for user in list(ph.users):
                    if user is not reloaded:
                        user.replace_input_with(ph, target)
        for ph in saved_placeholders:
            ph.meta["val"] = ph.meta["val"].new_empty((0,))
        self.synchronizer.set_reload_order(sorted(first_read, key=first_read.get))


def offloads_kept_alive(graph: torch.fx.Graph) -> list[bool]:
    """Per offload node: is its tensor an argument of a later boundary (its release)?"""
    kept = set()
    for node in graph.nodes:
        if node.target is ACT_BOUNDARY and len(node.args) > 3:
            kept.update(node.args[3])
    return [node.args[0] in kept for node in graph.nodes if node.target is ACT_OFFLOAD]


def _compile_forward_keeping_offloaded_buffers(gm, example_inputs, **kwargs):
    """Inductor on the forward; in-graph buffer reuse only where it is safe.

    Inductor reuses a buffer's memory for a later kernel once the graph has no further use
    for it (and may compute in place into it). The offload stream reads an offloaded
    activation until its release, so every offloaded buffer must be used by the graph until
    then: the release boundary takes them as ``keep`` arguments. Where some release is not in
    the forward (manual mode, or a dictionary releasing in backward), reuse is turned off and
    freeing is left to the allocator, which sees the synchronizer's reference. With reuse on
    and no ``keep``, a copy on the GPU would read overwritten bytes (copies on the CPU are
    synchronous, so only GPU tests can see it).
    """
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    # Releases inside the forward pass their tensors to the boundary op (``keep``): Inductor
    # then keeps each buffer until the main stream has waited for its copy, and reuse is safe.
    safe = all(offloads_kept_alive(gm.graph))
    with config.patch(allow_buffer_reuse=safe, inplace_buffers=safe):
        return compile_fx_inner(gm, example_inputs, **kwargs)


class ActivationOffloadBackend:
    """A ``torch.compile`` backend that offloads activations by the synchronization dictionary.

    ``num_layers=0`` compiles the same graphs without offload, so a comparison of the two differs only in it.
    """

    def __init__(self, model_layers: int, num_layers: int | None = None, *, synchronization_dict: dict | None = None, manual: bool = False,
                 min_tensor_size_to_offload: int = 1 << 20, layers: str | None = None, compiler: str = "inductor", reload_ahead: int | None = None):
        if compiler not in INNER_COMPILERS:
            raise ActivationOffloadError(f"compiler must be one of {INNER_COMPILERS}, got {compiler!r}")
        if isinstance(min_tensor_size_to_offload, bool) or not isinstance(min_tensor_size_to_offload, int) or min_tensor_size_to_offload < 0:
            raise ActivationOffloadError(f"min_tensor_size_to_offload must be an int >= 0 (bytes), got {min_tensor_size_to_offload!r}")
        if sum(x is not None and x is not False for x in (num_layers, synchronization_dict, manual or None)) != 1:
            raise ActivationOffloadError("give exactly one of num_layers=, synchronization_dict= or manual=True")
        if reload_ahead is not None and num_layers is None:
            raise ActivationOffloadError("reload_ahead= applies to the default schedule: give it with num_layers=")
        if reload_ahead == "auto":
            raise ActivationOffloadError("reload_ahead='auto' is OffloadContext's: it moves reload points after measuring steps, and the "
                                         "backend's points are fixed in the graphs when it compiles; give an int (layers ahead)")
        if manual:
            default_sync_dict(model_layers, 0)  # validates model_layers
            sync = {i: (True, min(i + 1, model_layers - 1), False, i) for i in range(model_layers)}
        elif synchronization_dict is not None:
            default_sync_dict(model_layers, 0)
            sync = validate_sync_dict(synchronization_dict, model_layers)
        else:
            sync = default_sync_dict(model_layers, num_layers, reload_ahead)
        self.schedule = ActivationSchedule(model_layers, sync, manual=manual)
        self.synchronizer = OffloadSynchronizer(self.schedule)
        self.layers, self.min_bytes, self.compiler = layers, min_tensor_size_to_offload, compiler
        self.groups: list[SavedGroup] = []
        self.compiled_graphs = 0
        self.graphs_without_layers = 0  # graph-break pieces holding no block: compiled without offload
        self.graphs_with_layers = 0

    @property
    def stats(self) -> dict:
        """Bytes per step the compiled graphs offload, and the saved bytes of the offloaded
        layers that stay on the GPU; ``offloaded_fraction`` is the first over their sum."""
        asked = [r for r in self.schedule.rows() if r["offloaded"]]
        offloaded = sum(r["offloaded_bytes"] for r in asked)
        kept = sum(r["kept_bytes"] for r in asked)
        return {
            "layers_offloaded": [r["layer"] for r in asked],
            "offloaded_bytes": offloaded,
            "kept_bytes_in_offloaded_layers": kept,
            "offloaded_fraction": offloaded / (offloaded + kept) if offloaded + kept else 0.0,
            "min_tensor_size_to_offload": self.min_bytes,
            "compiled_graphs": self.compiled_graphs,
            "graphs_without_layers": self.graphs_without_layers,
            # the copies of the last step, to host and back (waits for those still running)
            "transfer_seconds": sum(self.synchronizer.transfer_seconds().values()),
        }

    # the manual API
    def start_offload_layer(self, layer: int) -> None:
        self.synchronizer.start_offload_layer(layer)

    def release_activation_forward_gpu_memory(self, layer: int) -> None:
        self.synchronizer.release_activation_forward_gpu_memory(layer)

    def start_reload_layer(self, layer: int) -> None:
        self.synchronizer.start_reload_layer(layer)

    def _partition(self, joint, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
        offload_pass = ActivationOffloadPass(self.schedule, self.synchronizer, self.layers, self.min_bytes)
        groups = offload_pass.call(forward, backward, kwargs["num_fwd_outputs"])
        self.compiled_graphs += 1
        if not offload_pass.found_layers:
            self.graphs_without_layers += 1
            if self.graphs_with_layers == 0:
                warnings.warn(
                    f"a graph compiled with model_layers={self.schedule.model_layers} holds no block of a repeated layer list "
                    "(an nn.ModuleList or nn.Sequential seen in nn_module_stack), and no graph before it did: nothing of it is "
                    "offloaded; name the list with layers= if the model has one",
                    OffloadCoverageWarning, stacklevel=2,
                )
        else:
            # the graph pieces of one step (graph breaks): the last one holding the layers is the one reported
            self.graphs_with_layers += 1
            self.groups = groups
            self.forward_graph, self.backward_graph = forward, backward
        return forward, backward

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        if self.compiler == "eager":
            from functorch.compile import make_boxed_func

            def compiler(graph, inputs):
                return make_boxed_func(graph.forward)

            fw = bw = inference = compiler
            decompositions = None
        else:
            from torch._inductor.compile_fx import compile_fx_inner
            from torch._inductor.decomposition import select_decomp_table

            fw = inference = _compile_forward_keeping_offloaded_buffers
            bw = functools.partial(compile_fx_inner, is_backward=True)
            decompositions = select_decomp_table()
        return aot_autograd(fw_compiler=fw, bw_compiler=bw, inference_compiler=inference, partition_fn=self._partition, decompositions=decompositions)(gm, example_inputs)


def activation_offload_backend(model_layers: int, num_layers: int | None = None, **options) -> ActivationOffloadBackend:
    """``torch.compile(model, backend=activation_offload_backend(model_layers=n, num_layers=k))``."""
    return ActivationOffloadBackend(model_layers, num_layers, **options)


__all__ = ["ActivationOffloadBackend", "ActivationOffloadError", "OffloadCoverageWarning", "SyncDictError", "activation_offload_backend"]
