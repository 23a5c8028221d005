"""A method whose weights are all resident, run as one graph compiled by TorchInductor.

The executor (runtime/executor.py) launches one ATen kernel per instruction. Where weights
stream, that is right: the pool must see each kernel launched, and the bus, not the launches,
bounds a step. A program held whole on the device (a speculative draft) is bound by its
launches instead: a small decoder's step is some fifty short kernels per layer, most of them
elementwise (norms, rotary, activations), each costing a launch whatever its bytes.

Here the method's instruction list is rebuilt as an FX graph of functional ATen ops:
- each out variant becomes its functional overload; an in-place op on program state (a KV
  cache write) becomes its functional form, and the state is written back at the graph's end;
- a probe becomes the weight's resident tensor; views of it stay views;
- a view's copy (``slice_copy``) becomes the view and a clone, which inductor fuses into its
  readers;
- values are followed by what was last written to them: a planned value by its id (memory
  planning gives no two live values the same bytes), program state by its bytes (the cache
  a method reads and the one its update returns are two values in one place).

The graph is compiled once (``torch.compile``, inductor), which fuses the elementwise chains
into a few kernels per layer. The result is checked against the program at build: every
instruction's functional form must give the shape and dtype the program planned for it.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable

import torch
import torch.fx

from hostswap.kernels.rms_norm import rms_norm_reference
from hostswap.kernels.rotary import rotary_reference
from hostswap.runtime.executor import MethodExecutor
from hostswap.runtime.instructions import FunctionalAsOut, ListRef, ProgramError, copy_into
from hostswap.runtime.method_loader import LoadedMethod

__all__ = ["CompiledExecutor", "compiled_or_none", "functional_overload", "method_graph"]

# argument types that ExecuTorch stores as integers and ATen's Python ops take as enums
_MEMORY_FORMATS = (torch.contiguous_format, torch.preserve_format, torch.channels_last, torch.channels_last_3d)
_FACTORY_ARGUMENTS = ("dtype", "layout", "device", "pin_memory")


def _packet(qualified: str):
    namespace, _, name = qualified.partition("::")
    return getattr(getattr(torch.ops, namespace), name)


def _writes(schema) -> list[str]:
    return [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def functional_overload(schema: torch.FunctionSchema) -> torch._ops.OpOverload:
    """The functional op an out variant or an in-place op of ``schema`` stands for: an
    in-place ``name_`` becomes ``name`` with the same overload; an out variant becomes the
    overload of its name whose arguments are the out variant's less its outs (further ones
    only factory arguments, given from the out tensor, or arguments with defaults)."""
    if schema.name.endswith("_"):
        return getattr(_packet(schema.name[:-1]), schema.overload_name or "default")
    outs = set(_writes(schema))
    kept = [a for a in schema.arguments if a.name not in outs]
    packet = _packet(schema.name)
    for name in packet.overloads():
        candidate = getattr(packet, name)._schema
        if _writes(candidate) or len(candidate.returns) != max(len(outs), 1):
            continue
        by_name = {a.name: a for a in candidate.arguments}
        if any(a.name not in by_name or str(a.type) != str(by_name[a.name].type) for a in kept):
            continue
        extra = [a for a in candidate.arguments if a.name not in {k.name for k in kept}]
        if all(a.name in _FACTORY_ARGUMENTS or a.has_default_value() for a in extra):
            positional = [a.name for a in candidate.arguments if not a.kwarg_only]
            if positional == [a.name for a in kept if not a.kwarg_only][: len(positional)]:
                return getattr(packet, name)
    raise ProgramError(f"{schema.name}.{schema.overload_name} has no functional overload to compile it as")


def _enum_argument(argument: torch.Argument, value):
    """An ExecuTorch integer given for a ScalarType / MemoryFormat / Layout argument (optional or
    not), as the enum; a code with no enum here stays the integer, as ATen takes it."""
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    kind = argument.real_type
    kind = str(kind.getElementType() if isinstance(kind, torch.OptionalType) else kind)
    if kind == "ScalarType":
        return _SCALAR_TYPES.get(value, value)
    if kind == "MemoryFormat":
        return _MEMORY_FORMATS[value] if 0 <= value < len(_MEMORY_FORMATS) else value
    if kind == "Layout":
        return torch.strided if value == 0 else value
    return value


# c10::ScalarType numbering, which ExecuTorch's programs use for ScalarType arguments
_SCALAR_TYPES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16, 6: torch.float32,
                 7: torch.float64, 11: torch.bool, 15: torch.bfloat16, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn}


def attention_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``hostswap::sdpa`` as plain tensor ops, for inductor to fuse: softmax(q kᵀ scale + mask) v,
    in fp32, each key/value head serving its group of query heads. The fused kernels the
    executor calls are one opaque launch each, with the mask converted around them; for a
    decode step's one query these few fused ops are cheaper."""
    if dropout_p:
        raise ProgramError("a compiled method runs attention without dropout")
    b, heads, s, d = query.shape
    kv_heads, t = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = d**-0.5 if scale is None else scale
    q = query.float().reshape(b, kv_heads, group * s, d)
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # [b, kv heads, group x s, t]
    if attn_mask is not None:
        mask = attn_mask.expand(b, heads, s, t).reshape(b, kv_heads, group * s, t)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if is_causal:  # SDPA's causal mask is the upper-left one, on top of any mask given
        causal = torch.ones(s, t, dtype=torch.bool, device=query.device).tril().repeat(group, 1)
        scores = scores.masked_fill(~causal, float("-inf"))
    # a row masked everywhere gives zeros, as SDPA's does, not NaN
    out = torch.matmul(torch.ops.aten._safe_softmax.default(scores, -1), value.float())
    return out.reshape(b, heads, s, value.shape[-1]).to(query.dtype)


# ops a compiled graph runs as plain tensor ops instead of their opaque kernel (inductor fuses them)
_COMPILED_FORMS = {"hostswap::sdpa": attention_math, "hostswap::rms_norm": rms_norm_reference, "hostswap::rotary": rotary_reference}


def view_copy_form(functional: torch._ops.OpOverload):
    """A ``*_copy`` op (the form a view takes in an ExecuTorch program) as its view and a
    contiguous clone: the same fresh tensor, but inductor fuses a view into the kernels that
    read it, where some copies (``slice_copy``, ``select_copy``) it runs as a separate eager
    kernel each, four per decoder layer for rotary's halves. None for any other op."""
    namespace, _, name = functional._schema.name.partition("::")
    if namespace != "aten" or not name.endswith("_copy") or name in ("copy", "_to_copy") or [str(r.type) for r in functional._schema.returns] != ["Tensor"]:
        return None  # (a split's copies, a list, stay as they are)
    view = getattr(getattr(torch.ops.aten, name[: -len("_copy")], None), functional._overloadname, None)
    if view is None or [str(a.type) for a in view._schema.arguments] != [str(a.type) for a in functional._schema.arguments]:
        return None

    def as_view_and_clone(*args, **kwargs):
        return torch.ops.aten.clone.default(view(*args, **kwargs), memory_format=torch.contiguous_format)

    as_view_and_clone.__name__ = f"{name}_as_view"
    return as_view_and_clone


class MethodGraph:
    """A method as an FX graph: ``module`` takes ``inputs`` (tensors, in placeholder order) and
    returns the method's outputs, writing program state in place."""

    def __init__(self, module: torch.fx.GraphModule, inputs: list[torch.Tensor], output_ids: list[int], checks: list[tuple[torch.fx.Node, int, object]]):
        self.module, self.inputs, self.output_ids, self._checks = module, inputs, output_ids, checks

    def check(self) -> None:
        """Raise ProgramError where an instruction's functional form gives another shape or dtype
        than the program planned (its meta computed on fake tensors)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        FakeTensorProp(self.module, mode).propagate_dont_convert_inputs(*[mode.from_tensor(t) for t in self.inputs])
        for node, index, planned in self._checks:
            got = node.meta.get("val")
            if got is None:
                continue
            if tuple(got.shape) != tuple(planned.shape) or got.dtype != planned.dtype:
                raise ProgramError(f"instruction {index}: its functional form gives {tuple(got.shape)} {got.dtype}, the program planned "
                                   f"{tuple(planned.shape)} {planned.dtype}; this method cannot be compiled")


class _Memory:
    """What was last written to each planned byte range, as graph nodes: a read of a range
    gets the node of the last write that overlaps it, viewed as the reader's tensor.

    ExecuTorch gives a static view no instruction: its value is planned in its base's bytes.
    So a value is followed by its bytes, not its id; two live values never share bytes
    otherwise (memory planning), and state is followed the same way."""

    def __init__(self, graph: torch.fx.Graph, method: LoadedMethod):
        self.graph, self.method = graph, method
        self.writes: list[tuple[tuple[int, int, int], torch.fx.Node, int]] = []  # (region, node, value id)

    def write(self, vid: int, node: torch.fx.Node) -> None:
        self.writes.append((self.method.regions[vid], node, vid))

    def read(self, vid: int) -> torch.fx.Node | None:
        memory, start, end = region = self.method.regions[vid]
        for (m, s, e), node, written in reversed(self.writes):
            if m != memory or e <= start or end <= s:
                continue
            if region == (m, s, e) and written == vid:
                return node
            return self._view(node, written, vid, s, e)
        return None

    def _view(self, node, written: int, vid: int, s: int, e: int) -> torch.fx.Node:
        method, graph = self.method, self.graph
        memory, start, end = method.regions[vid]
        have, want = method.values[written], method.values[vid]
        if not (start >= s and end <= e):
            raise ProgramError(f"method '{method.name}': value {vid} reads bytes {start}-{end} of memory {memory}, which no one write covers; cannot compile it")
        if have.dtype != want.dtype or not (method.contiguous[written] and method.contiguous[vid]):
            raise ProgramError(f"method '{method.name}': value {vid} views the bytes of value {written} as another dtype or layout; cannot compile it")
        if (start, end) == (s, e) and tuple(have.shape) == tuple(want.shape):
            return node
        flat = graph.call_function(torch.ops.aten.reshape.default, (node, [-1]))
        first = (start - s) // want.element_size()
        if (start, end) != (s, e):
            flat = graph.call_function(torch.ops.aten.slice.Tensor, (flat, 0, first, first + want.numel()))
        return graph.call_function(torch.ops.aten.reshape.default, (flat, list(want.shape)))


def method_graph(method: LoadedMethod, instructions, resident_weight: Callable[[int, str], torch.Tensor]) -> MethodGraph:
    """``method`` (its values; ``instructions`` as loaded, without view planning) as an FX graph;
    ``resident_weight(probe_id, fqn)`` gives each probe's tensor on the device."""
    graph = torch.fx.Graph()
    values = method.values
    memory = _Memory(graph, method)
    inputs: list[torch.Tensor] = []
    placeholder_of: dict[int, torch.fx.Node] = {}  # id(tensor) -> its placeholder
    unplanned: dict[int, object] = {}  # value id -> the node of a probe's weight, or of a view of one
    checks: list = []
    state_writes: list[tuple[int, torch.fx.Node]] = []

    def placeholder(t: torch.Tensor) -> torch.fx.Node:
        node = placeholder_of.get(id(t))
        if node is None:
            node = graph.placeholder(f"t{len(inputs)}")
            placeholder_of[id(t)] = node
            inputs.append(t)
        return node

    for vid in method.plan.inputs:  # bound into their planned slots before each run
        if vid in method.regions:
            memory.write(vid, placeholder(values[vid]))

    def read(vid: int):
        v = values[vid]
        if isinstance(v, ListRef):
            return [None if (v.optional and j < 0) else read(j) for j in v.indices]
        if vid in method.regions:
            node = memory.read(vid)
            if node is not None:
                return node
            if method.regions[vid][0] not in method.state_ids:
                raise ProgramError(f"method '{method.name}' reads value {vid} before anything writes its bytes; cannot compile it")
            node = placeholder(v)  # program state as the last call left it
            memory.write(vid, node)
            return node
        if vid in unplanned:
            return unplanned[vid]
        if vid in method.unplanned:
            raise ProgramError(f"method '{method.name}' reads value {vid} before anything binds it; cannot compile it")
        if vid in method.plan.inputs and not isinstance(v, torch.Tensor):
            raise ProgramError(f"method '{method.name}' takes a non-tensor input (value {vid}); a compiled graph would keep its value at load")
        return placeholder(v) if isinstance(v, torch.Tensor) else v  # a constant, or a table read in place

    def write(vid: int, node, index: int) -> None:
        if vid not in method.regions:
            unplanned[vid] = node
            return
        memory.write(vid, node)
        checks.append((node, index, values[vid]))
        if method.regions[vid][0] in method.state_ids:
            state_writes.append((vid, node))

    for ins in instructions:
        if ins.tag == "probe":
            unplanned[ins.ret_id] = placeholder(resident_weight(ins.probe_id, ins.fqn))
        elif ins.tag == "move":
            v = read(ins.source)
            write(ins.target, v, -1) if isinstance(v, torch.fx.Node) else unplanned.__setitem__(ins.target, v)
        elif ins.tag == "free":
            continue
        elif ins.tag == "jump_false":
            raise ProgramError(f"method '{method.name}' has jumps; only straight-line methods compile")
        else:
            _kernel(graph, ins, values, read, write)
    outputs = [read(vid) for vid in method.plan.outputs]
    # program state the method wrote goes back in place: the last write of each range
    last: dict[tuple[int, int, int], tuple[int, int, torch.fx.Node]] = {}  # region -> (write order, value id, node)
    for order, (vid, node) in enumerate(state_writes):
        last[method.regions[vid]] = (order, vid, node)
    for _, vid, node in sorted(last.values(), key=lambda w: w[0]):  # in the order written: a later write over an earlier one's bytes wins
        graph.call_function(torch.ops.aten.copy_.default, (placeholder(values[vid]), node))
    graph.output(tuple(outputs))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    return MethodGraph(module, inputs, list(method.plan.outputs), checks)


def _kernel(graph: torch.fx.Graph, ins, values, read, write) -> None:
    _, op, positional, keyword, ret_ids, view_op, index, scratch, constant_keyword = ins
    if view_op is not None:
        node = graph.call_function(view_op, tuple(read(i) for i in positional))
        write(ret_ids[0], node, index)
        return
    if op is copy_into:  # dim-order casts and clones: the out tensor's dtype and layout
        out = keyword["out"]
        fmt = constant_keyword.get("memory_format")
        node = graph.call_function(torch.ops.aten._to_copy.default, (read(positional[0]),),
                                   {"dtype": values[out].dtype, **({"memory_format": fmt} if fmt is not None else {})})
        for vid in [out, *ret_ids]:
            write(vid, node, index)
        return
    schema = op._schema
    functional = op.functional if isinstance(op, FunctionalAsOut) else functional_overload(schema)
    outs = [name for name in _writes(schema)]
    by_name = {a.name: a for a in schema.arguments}
    args = []
    positional_names = [a.name for a in schema.arguments if not a.kwarg_only]
    in_place_targets = []
    for name, vid in zip(positional_names, positional):
        if name in outs:  # in place: self is read, then written
            in_place_targets.append(vid)
        args.append(_enum_argument(by_name[name], read(vid)))
    kwargs = {}
    out_ids = []  # (value id, whether it is a zero-element scratch the program does not read)
    for name, vid in keyword.items():
        if name in outs or name in scratch:
            out_ids.append((vid, name in scratch))
            continue
        kwargs[name] = _enum_argument(by_name[name], read(vid))
    kwargs.update(constant_keyword)
    wanted = {a.name for a in functional._schema.arguments}
    if out_ids:
        planned = values[out_ids[0][0]]
        given_positionally = {a.name for a in functional._schema.arguments if not a.kwarg_only}.intersection(positional_names[: len(args)])
        if "dtype" in wanted and "dtype" not in given_positionally and kwargs.get("dtype") is None and isinstance(planned, torch.Tensor):
            kwargs["dtype"] = planned.dtype
        if "device" in wanted and isinstance(planned, torch.Tensor):
            kwargs["device"] = planned.device
    kwargs = {name: v for name, v in kwargs.items() if name in wanted}
    form = _COMPILED_FORMS.get(functional._schema.name) or view_copy_form(functional) or functional
    node = graph.call_function(form, tuple(args), kwargs)
    results = [node] if len(functional._schema.returns) == 1 else [graph.call_function(operator.getitem, (node, i)) for i in range(len(functional._schema.returns))]
    targets = [(vid, False) for vid in in_place_targets] or out_ids
    if len(targets) == 1 and isinstance(values[targets[0][0]], ListRef):  # a list of outs (split): one result per item
        items = values[targets[0][0]].indices
        targets = [(vid, False) for vid in items]
        results = [graph.call_function(operator.getitem, (node, i)) for i in range(len(items))]
        ret_ids = []
    for (vid, is_scratch), result in zip(targets, results):
        if not is_scratch:
            write(vid, result, index)
    for vid, result in zip(ret_ids, results):
        write(vid, result, index)


class CompiledExecutor(MethodExecutor):
    """A method run as one compiled graph; ``resident_weight(probe_id, fqn)`` gives each probe's
    tensor, fixed for the method's life (every weight resident). ``prepare`` builds and checks
    the graph (at load); the first run compiles it. ``where_possible``: a graph inductor cannot
    compile runs as it is, op by op, with a warning, instead of failing."""

    def __init__(self, method: LoadedMethod, resident_weight: Callable[[int, str], torch.Tensor], where_possible: bool = False):
        super().__init__(method, probe_handler=None)
        self._resident_weight = resident_weight
        self.where_possible = where_possible
        self._graph: MethodGraph | None = None
        self._compiled = None

    @classmethod
    def load_compiled(cls, program, plan, device: torch.device, weights, resident_weight, state=None, where_possible: bool = False) -> "CompiledExecutor":
        return cls(LoadedMethod(program, plan, device, weights, state), resident_weight, where_possible)

    def prepare(self) -> "CompiledExecutor":
        """Build the graph and check it against the program; raises ProgramError where it cannot."""
        if self._graph is None:
            graph = method_graph(self.method, self.instructions, self._resident_weight)
            graph.check()
            self._graph = graph
        return self

    def run(self, on_kernel=None, hooked=None) -> None:
        graph = self.prepare()._graph
        if self._compiled is None:
            compiled = torch.compile(graph.module, fullgraph=True, dynamic=False)
            try:
                results = compiled(*graph.inputs)  # compiles here: the first call
            except torch._dynamo.exc.TorchDynamoException as e:
                if not self.where_possible:
                    raise
                warnings.warn(f"method '{self.name}' could not be compiled ({type(e).__name__}: {str(e).splitlines()[0][:200]}); it runs op by op")
                compiled = graph.module
                results = compiled(*graph.inputs)
            self._compiled = compiled
        else:
            results = self._compiled(*graph.inputs)
        for vid, result in zip(graph.output_ids, results):
            planned = self.values[vid]
            if isinstance(planned, torch.Tensor) and isinstance(result, torch.Tensor) and planned is not result:
                planned.copy_(result)
            else:
                self.values[vid] = result


def compiled_or_none(load: Callable[[], CompiledExecutor], where_possible: bool, what: str) -> CompiledExecutor | None:
    """``load()``'s prepared executor; where its graph cannot be built and ``where_possible``,
    None (the caller loads the method to run a kernel per instruction) with a warning naming
    ``what`` and why."""
    try:
        return load().prepare()
    except Exception as e:  # a ProgramError, or an op whose functional form fake tensors refuse
        if not where_possible:
            raise
        warnings.warn(f"{what} runs a kernel per instruction: {e}")
        return None
