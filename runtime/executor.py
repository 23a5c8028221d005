"""Executes an ExecuTorch method's instruction list with PyTorch's ATen kernels on a device.

ExecuTorch's PyPI wheel has no CUDA backend, so the runtime interprets the program itself:
values table, memory-planned arenas allocated on the device, operators resolved once at
load. Probe instructions bind their output to the weight pool's tensor; ``*_copy`` view
ops of a probe's output run as views (as ExecuTorch's CUDA backend does), so weights are
never copied on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from hostswap.schedules.custom_ops import OUT_OVERLOAD, PROBE_OPERATOR, out_variant_schema, run_into_outs
from hostswap.schedules.pte_program import SCALAR_EVALUES, evalue_scalar, tensor_nbytes, torch_dtype


def _copy_into(self: torch.Tensor, *, out: torch.Tensor, non_blocking: bool = False, memory_format=None) -> torch.Tensor:
    """``_to_copy.out`` / ``clone.out`` as one kernel: ATen's out variants allocate a temporary,
    convert into it and copy that into ``out`` (three launches); ``copy_`` converts straight
    into ``out``'s planned layout with the same conversion kernel."""
    return out.copy_(self, non_blocking)


_copy_into.accepted = frozenset({"out", "non_blocking", "memory_format"})

# ExecuTorch's dim-order ops (emitted for casts and clones) and the kernels that run them.
DIM_ORDER_OUT_OPS = {
    "dim_order_ops::_to_dim_order_copy": _copy_into,
    "dim_order_ops::_clone_dim_order": _copy_into,
    "dim_order_ops::_empty_dim_order": torch.ops.aten.empty.out,
}


class ProgramError(ValueError):
    """A program the executor cannot run; the message names the instruction or value."""


def _register_executorch_ops() -> None:
    # dim_order_ops::_clone_dim_order / _to_dim_order_copy are emitted for clones and casts.
    import executorch.exir.passes.dim_order_ops_registry  # noqa: F401


# ExecuTorch's emitter turns a view of a tensor it does not plan (here: a weight bound to the
# pool) into ``executorch_prim::et_view(self, size, out)``; it has no PyTorch op. It runs as
# a reshape, a view wherever the source's strides allow one.
ET_VIEW_OPERATOR = "executorch_prim::et_view"


class FunctionalAsOut:
    """The ``out`` overload hostswap gave a functional custom op at lowering, run in a process
    where it is not registered: the functional op, its results copied into ``out``."""

    def __init__(self, functional: torch._ops.OpOverload):
        self.functional = functional
        self._schema = torch._C.parse_schema(functional._schema.name.split("::")[0] + "::" + out_variant_schema(functional._schema))

    def __call__(self, *args, **kwargs):
        return run_into_outs(self.functional, args, kwargs)


def resolve_operator(name: str, overload: str):
    if name == ET_VIEW_OPERATOR:
        return torch.ops.aten.reshape.default
    namespace, _, op_name = name.partition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError) as e:
        raise ProgramError(
            f"operator {name} has no PyTorch kernel in this process ({e}); import the library that defines it before loading"
        ) from None
    try:
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError) as e:
        functional = getattr(packet, "default", None) if overload == OUT_OVERLOAD else None
        if functional is not None and namespace != "aten":
            return FunctionalAsOut(functional)
        raise ProgramError(f"operator {name}.{overload or 'default'} has no PyTorch kernel: {e}") from None


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _regions_overlap(a: tuple[int, int, int] | None, b: tuple[int, int, int] | None) -> bool:
    """Two (memory id, start, end) arena regions share a byte."""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


class Kernel(NamedTuple):
    """An operator call. ``view_op`` set: the call binds its result to a view of its first
    argument instead of writing an out tensor."""

    tag: str  # "kernel"
    op: Callable
    positional: list[int]  # value ids
    keyword: dict[str, int]  # argument name -> value id
    ret_ids: list[int]
    view_op: Callable | None
    index: int  # instruction index in the program
    scratch: dict[str, torch.dtype]  # zero-element out arguments given a fresh tensor per call
    constant_keyword: dict[str, object]  # arguments fixed at load


class Probe(NamedTuple):
    """Bind ``ret_id`` to the pool's device tensor of weight ``fqn``."""

    tag: str  # "probe"
    probe_id: int
    fqn: str
    ret_id: int


class Move(NamedTuple):
    tag: str  # "move"
    source: int
    target: int


class JumpFalse(NamedTuple):
    tag: str  # "jump_false"
    condition: int
    destination: int


class Free(NamedTuple):
    tag: str  # "free"
    value: int


Instruction = Kernel | Probe | Move | JumpFalse | Free


@dataclasses.dataclass
class _ListRef:
    indices: list[int]
    optional: bool = False


def _tensor_from_arena(t, arenas: dict[int, torch.Tensor], at: tuple[int, int] | None = None) -> torch.Tensor:
    """Program tensor ``t`` in its planned place, or at ``at`` = (memory id, offset)."""
    info = t.allocation_info
    memory_id, offset = at if at is not None else (info.memory_id, info.memory_offset_low + (info.memory_offset_high << 32))
    dtype = torch_dtype(t.scalar_type)
    raw = arenas[memory_id][offset : offset + tensor_nbytes(t)]
    return _shaped(raw.view(dtype), t)


def _shaped(flat: torch.Tensor, t) -> torch.Tensor:
    """Flat data of program tensor ``t`` with its logical sizes; data stored in ``t``'s dim
    order gets the matching strides."""
    if list(t.dim_order) == list(range(len(t.sizes))):
        return flat.view(list(t.sizes))
    physical = [t.sizes[d] for d in t.dim_order]
    return flat.view(physical).permute([list(t.dim_order).index(i) for i in range(len(t.sizes))])


class MethodExecutor:
    """One method of a program, ready to run: every value and kernel resolved at load."""

    def __init__(self, program, plan, device: torch.device, weights: Callable[[str], torch.Tensor] | None, probe_handler=None, elide_copies: bool = True, replan: bool = True):
        _register_executorch_ops()
        self.plan, self.device, self.name = plan, device, plan.name
        self.probe_handler = probe_handler
        self.arenas = {
            memory_id: torch.empty(size, dtype=torch.uint8, device=device)
            for memory_id, size in enumerate(plan.non_const_buffer_sizes)
            if size > 0
        }
        self.arena_bytes = sum(plan.non_const_buffer_sizes)
        self.values: list = [None] * len(plan.values)
        self.unplanned: set[int] = set()
        self.regions: dict[int, tuple[int, int, int]] = {}  # planned value -> (memory id, start, end)
        self.contiguous: dict[int, bool] = {}
        self._meta: dict[int, object] = {}  # planned value -> its program tensor (sizes, dtype, dim order)
        self.reads: list[set[int]] = []  # per instruction: value ids it reads
        self.writes: list[set[int]] = []  # per instruction: value ids it writes (out arguments)
        for i, value in enumerate(plan.values):
            self.values[i] = self._initial_value(i, value, program, weights)
        self.operators = [resolve_operator(op.name, op.overload) for op in plan.operators]
        self.instructions: list[Instruction] = []
        for chain_index, chain in enumerate(plan.chains):
            if chain_index > 0:
                raise ProgramError(f"method '{self.name}' has {len(plan.chains)} chains; only one is supported")
            for i, instruction in enumerate(chain.instructions):
                self.instructions.append(self._compile(i, instruction))
        self.elided_copies = 0
        if elide_copies:
            replanned = self._replan_with_views() if replan else None
            self.elided_copies = self._elide_copies() if replanned is None else replanned

    # --- values -----------------------------------------------------------------------------
    def _initial_value(self, i, value, program, weights):
        kind = type(value.val).__name__
        v = value.val
        if kind == "Null":
            return None
        if kind in SCALAR_EVALUES:
            return evalue_scalar(value)
        if kind in ("IntList", "TensorList"):
            return _ListRef(list(v.items))
        if kind == "OptionalTensorList":
            return _ListRef(list(v.items), optional=True)
        if kind == "DoubleList":
            return [float(x) for x in v.items]  # non-finite doubles come back as strings
        if kind == "BoolList":
            return list(v.items)
        if kind == "Tensor":
            return self._initial_tensor(i, v, program, weights)
        raise ProgramError(f"method '{self.name}': value {i} has kind {kind}, which the executor does not handle")

    def _initial_tensor(self, i, t, program, weights):
        info = t.extra_tensor_info
        if info is not None and info.location.name == "EXTERNAL":
            if weights is None:
                raise ProgramError(f"method '{self.name}' reads external weight '{info.fully_qualified_name}' but no .ptd was given")
            return weights(info.fully_qualified_name)
        if t.allocation_info is not None:
            self._meta[i] = t
            tensor = _tensor_from_arena(t, self.arenas)
            info = t.allocation_info
            low = info.memory_offset_low + (info.memory_offset_high << 32)
            self.regions[i] = (info.memory_id, low, low + tensor.numel() * tensor.element_size())
            self.contiguous[i] = tensor.is_contiguous()
            return tensor
        if t.data_buffer_idx > 0:
            return self._constant_tensor(t, program)
        # unplanned: inputs bound per call, probe outputs bound to the pool, views of them
        self.unplanned.add(i)
        return None

    def _constant_tensor(self, t, program):
        """A constant the program carries itself, read as exactly its own bytes.

        ExecuTorch pads each constant's slot of the constant buffer to an alignment: the
        tensor is the first ``numel x itemsize`` bytes of its slot, which must hold them.
        """
        dtype = torch_dtype(t.scalar_type)
        nbytes = tensor_nbytes(t)
        index = t.data_buffer_idx
        if not program.constant_buffer or index >= len(program.constant_buffer):
            raise ProgramError(f"method '{self.name}': constant tensor {index} has no data in the program")
        slot = program.constant_buffer[index].storage
        if nbytes > len(slot):
            raise ProgramError(
                f"method '{self.name}': constant tensor {index} of shape {list(t.sizes)} {dtype} needs {nbytes} bytes, "
                f"its slot of the constant buffer holds {len(slot)}"
            )
        if nbytes == 0:
            return torch.empty(list(t.sizes), dtype=dtype, device=self.device)
        flat = torch.frombuffer(bytearray(bytes(slot[:nbytes])), dtype=torch.uint8).view(dtype)
        return _shaped(flat, t).to(self.device)

    # --- instructions -----------------------------------------------------------------------
    def _compile(self, index: int, instruction):
        call = instruction.instr_args
        kind = type(call).__name__
        self.reads.append(set())
        self.writes.append(set())
        if kind == "KernelCall":
            return self._compile_kernel(index, call)
        if kind == "DelegateCall":
            delegate = self.plan.delegates[call.delegate_index]
            raise ProgramError(f"method '{self.name}' instruction {index} calls delegate backend '{delegate.id}'; hostswap runs non-delegated programs only")
        if kind == "MoveCall":
            return Move("move", call.move_from, call.move_to)
        if kind == "JumpFalseCall":
            return JumpFalse("jump_false", call.cond_value_index, call.destination_instruction)
        if kind == "FreeCall":
            return Free("free", call.value_index)
        raise ProgramError(f"method '{self.name}' instruction {index} is a {kind}, which the executor does not handle")

    def _compile_kernel(self, index: int, call):
        op_meta = self.plan.operators[call.op_index]
        op = self.operators[call.op_index]
        schema = op._schema
        n_in = len(schema.arguments)
        if isinstance(op, FunctionalAsOut) and len(call.args) != n_in + len(schema.returns):
            raise ProgramError(
                f"instruction {index} calls {op_meta.name}.{op_meta.overload} with {len(call.args)} values, but its functional "
                f"form makes an out variant of {n_in} arguments and {len(schema.returns)} results: the program was built with "
                "an out variant of its own; import the library that defines it before loading"
            )
        arg_ids, ret_ids = call.args[:n_in], call.args[n_in:]
        if op_meta.name == PROBE_OPERATOR:
            weight_value = self.plan.values[arg_ids[0]].val
            fqn = weight_value.extra_tensor_info.fully_qualified_name
            probe_id = self.plan.values[arg_ids[1]].val.int_val
            return Probe("probe", probe_id, fqn, ret_ids[0])
        if op_meta.name == ET_VIEW_OPERATOR:
            source, size, out = call.args
            self.reads[-1].update([source, size])
            return Kernel("kernel", op, [source, size], {}, [out], op, index, {}, {})
        positional, keyword = [], {}
        for arg_schema, value_id in zip(schema.arguments, arg_ids):
            if arg_schema.kwarg_only:
                keyword[arg_schema.name] = value_id
            else:
                positional.append(value_id)
        out_ids = [value_id for arg_schema, value_id in zip(schema.arguments, arg_ids) if arg_schema.alias_info is not None and arg_schema.alias_info.is_write]
        for value_id in arg_ids:
            v = self.values[value_id]
            if value_id in out_ids:
                self.writes[-1].add(value_id)
            else:
                self.reads[-1].update(v.indices if isinstance(v, _ListRef) else [value_id])
        self.writes[-1].update(ret_ids)
        view_op = None
        if op_meta.name.endswith("_copy") and len(out_ids) == 1 and out_ids[0] in self.unplanned:
            # a *_copy into an unplanned tensor: a view of a probe's output; run it as the view
            base_name = op_meta.name[: -len("_copy")]
            functional = resolve_operator(op_meta.name, "default" if op_meta.overload == "out" else op_meta.overload.replace("_out", ""))
            view_op = getattr(getattr(torch.ops.aten, base_name.split("::")[1]), functional._overloadname, None)
            if view_op is None:
                raise ProgramError(f"instruction {index}: no view op for {op_meta.name}")
        # A zero-element planned output (e.g. batch norm's save_mean in inference) occupies no
        # arena bytes, yet CUDA kernels resize it to (C,) and would write into whatever lives
        # at that offset. Give such outputs a fresh empty tensor per call instead.
        scratch = {}
        for name, value_id in keyword.items():
            v = self.values[value_id]
            if isinstance(v, torch.Tensor) and v.numel() == 0 and value_id not in self.unplanned:
                scratch[name] = v.dtype
        constant_keyword = {}
        if op_meta.name in DIM_ORDER_OUT_OPS:
            # ExecuTorch's Python kernel for these maps dim_order to a memory format on every
            # call; the dim order is a constant of the program, so map it once here.
            from executorch.exir.dim_order_utils import get_memory_format

            dim_order = self._get(keyword.pop("dim_order")) if "dim_order" in keyword else None
            constant_keyword["memory_format"] = get_memory_format(list(dim_order) if dim_order is not None else None)
            op = DIM_ORDER_OUT_OPS[op_meta.name]
            accepted = op.accepted if op is _copy_into else {a.name for a in op._schema.arguments}
            keyword = {name: value_id for name, value_id in keyword.items() if name in accepted}
        return Kernel("kernel", op, positional, keyword, ret_ids, view_op, index, scratch, constant_keyword)

    # --- copy elision -------------------------------------------------------------------------
    def _replan_with_views(self) -> int | None:
        """Run view-like copies as views, and plan the activation memory so that they may.

        ExecuTorch plans memory for its copy-everything edge dialect: a copy's source buffer
        is reused as soon as the copy has read it, so few copies can later run as views
        (``_elide_copies``). Here the copies are turned into views first, every view extends
        the life of the buffer it reads, and the buffers are placed again (largest first,
        lowest offset free over its lifetime) in one arena. Returns the number of copies run
        as views, or None to keep ExecuTorch's plan (jumps or moves, or a planned value whose
        aliasing is not understood).
        """
        if any(ins.tag in ("jump_false", "move") for ins in self.instructions):
            return None
        n = len(self.instructions)
        inputs, outputs = set(self.plan.inputs), set(self.plan.outputs)
        write_pcs: dict[int, list[int]] = {}
        read_pcs: dict[int, list[int]] = {}
        for pc in range(n):
            for v in self.writes[pc]:
                write_pcs.setdefault(v, []).append(pc)
            for v in self.reads[pc]:
                read_pcs.setdefault(v, []).append(pc)
        planned = [v for v in self.regions if v in self._meta]
        # Values no instruction writes are views ExecuTorch folded into planning: find the
        # written value whose bytes they read (the last one written into them before).
        folded_base: dict[int, int] = {}
        for v in planned:
            if write_pcs.get(v) or v in inputs:
                continue
            mem, lo, hi = self.regions[v]
            first = min(read_pcs.get(v, [n]))
            candidates = [(max(p for p in write_pcs[u] if p < first), u) for u in planned
                          if u != v and write_pcs.get(u) and any(p < first for p in write_pcs[u])
                          and self.regions[u][0] == mem and self.regions[u][1] <= lo and hi <= self.regions[u][2]]
            if not candidates:
                if hi > lo:
                    return None
                continue
            folded_base[v] = max(candidates)[1]
        folded_of = set(folded_base.values())
        # Decide the views. root: the buffer a view reads; contiguous: whether the view is.
        root: dict[int, int] = {}
        contiguous = dict(self.contiguous)
        views: dict[int, object] = {}  # pc -> the view op its copy runs as
        for pc, x, y, view_op, keeps_contiguity, needs_contiguous in self._copies_viewable():
            if x not in self._meta or y not in self._meta or y in inputs or write_pcs.get(y) != [pc] or y in folded_of:
                continue
            if needs_contiguous and not contiguous.get(x, False):
                continue
            # the buffer x's bytes live in: a view ExecuTorch folded into planning (the reshape
            # between a projection and its transpose) reads its base's bytes
            r = root.get(x, x)
            r = folded_base.get(r, r)
            if any(p > pc for p in write_pcs.get(r, [])):
                continue  # the buffer is written again later: a view would see the new bytes
            root[y] = r
            contiguous[y] = keeps_contiguity and contiguous.get(x, False)
            views[pc] = view_op
        # Lifetimes of the buffers that remain: first write (inputs: the start) to the last read
        # of the buffer, of the views ExecuTorch folded into it and of the views made here.
        owner = {v: root.get(v, v) for v in planned}
        owner.update({v: owner[b] for v, b in folded_base.items()})
        life: dict[int, list[int]] = {}
        for v in planned:
            o = owner[v]
            if o in folded_base or o in root:
                continue
            span = life.setdefault(o, [n, -1])
            pcs = write_pcs.get(v, []) + read_pcs.get(v, [])
            if v in inputs:
                pcs = pcs + [0]
            if v in outputs:
                pcs = pcs + [n]
            if pcs:
                span[0], span[1] = min(span[0], min(pcs)), max(span[1], max(pcs))
        sizes = {o: self.regions[o][2] - self.regions[o][1] for o in life}
        placed: list[tuple[int, int, int, int]] = []  # offset, end, first, last
        offset_of: dict[int, int] = {}
        align = 256
        for o in sorted(life, key=lambda o: (-sizes[o], o)):
            first, last = life[o]
            if sizes[o] == 0:
                offset_of[o] = 0
                continue
            busy = sorted((a, b) for a, b, f, l in placed if not (l < first or last < f))
            offset = 0
            for a, b in busy:
                if offset + sizes[o] <= a:
                    break
                offset = max(offset, -(-b // align) * align)
            offset_of[o] = offset
            placed.append((offset, offset + sizes[o], first, last))
        total = max((b for _, b, _, _ in placed), default=0)
        arena = torch.empty(total, dtype=torch.uint8, device=self.device)
        self.arenas = {0: arena}
        self.arena_bytes = total
        new_regions = {}
        for v in planned:
            if v in root:
                self.values[v] = None  # bound by its view instruction on every run
                continue
            # a folded view sits where it sat in its base (its base is never a view made here)
            start = offset_of[owner[v]] + (self.regions[v][1] - self.regions[folded_base[v]][1] if v in folded_base else 0)
            self.values[v] = _tensor_from_arena(self._meta[v], self.arenas, at=(0, start))
            new_regions[v] = (0, start, start + self.regions[v][2] - self.regions[v][1])
        for v in root:
            new_regions[v] = new_regions[root[v]]
        self.regions = new_regions
        for pc, view_op in views.items():
            self._run_as_view(pc, view_op)
        return len(views)

    def _elide_copies(self) -> int:
        """Run ``*_copy`` view ops (and same-dtype contiguous casts) between planned tensors as views.

        The edge dialect turns every view into a copy into its own planned buffer; eager
        PyTorch runs them as views. A copy ``Y = f_copy(X)`` may become ``Y = f(X)`` when the
        buffer that ``X`` lives in (its alias root) is written by no instruction from here to
        the last read of ``Y`` or of anything aliased to the same root (program outputs count
        as read at the end), and no view folded into memory planning reads ``Y``'s own bytes.
        Programs with jumps or moves keep every copy.
        """
        if any(ins.tag in ("jump_false", "move") for ins in self.instructions):
            return 0
        n = len(self.instructions)
        last_read: dict[int, int] = {}
        for pc, reads in enumerate(self.reads):
            for v in reads:
                last_read[v] = pc
        for v in self.plan.outputs:
            last_read[v] = n
        write_count: dict[int, int] = {}
        for writes in self.writes:
            for v in writes:
                write_count[v] = write_count.get(v, 0) + 1
        inputs = set(self.plan.inputs)
        # A planned value that no instruction writes is a view ExecuTorch folded into memory
        # planning (it shares the bytes of the tensor it views). A copy whose output bytes are
        # read that way must keep writing them.
        folded_views = [self.regions[v] for v in self.regions if write_count.get(v, 0) == 0 and v not in inputs]
        root: dict[int, int] = {}
        group_end: dict[int, int] = {}
        contiguous = dict(self.contiguous)

        elided = 0
        for pc, x, y, view_op, keeps_contiguity, needs_contiguous in self._copies_viewable():
            if x not in self.regions or y not in self.regions or y in inputs or write_count.get(y, 0) != 1:
                continue
            if needs_contiguous and not contiguous.get(x, False):
                continue
            if any(_regions_overlap(self.regions[y], f) for f in folded_views):
                continue
            r = root.get(x, x)
            end = max(group_end.get(r, pc), last_read.get(y, pc))
            if any(_regions_overlap(self.regions[r], self.regions.get(w)) for p in range(pc + 1, min(end, n - 1) + 1) for w in self.writes[p]):
                continue
            root[y], group_end[r] = r, end
            contiguous[y] = keeps_contiguity and contiguous.get(x, False)
            self.regions[y] = self.regions[r]
            self._run_as_view(pc, view_op)
            elided += 1
        return elided

    # view op, keeps contiguity, needs a contiguous input
    _VIEW_COPIES = {
        "aten::view_copy": ("view", True, True),
        "aten::unsqueeze_copy": ("unsqueeze", True, False),
        "aten::squeeze_copy": ("squeeze", True, False),
        "aten::alias_copy": ("alias", True, False),
        "aten::permute_copy": ("permute", False, False),
        "aten::transpose_copy": ("transpose", False, False),
        "aten::t_copy": ("t", False, False),
        "aten::expand_copy": ("expand", False, False),
        "aten::slice_copy": ("slice", False, False),
        "aten::select_copy": ("select", False, False),
    }

    def _view_of_copy(self, ins):
        op = ins.op
        if op is _copy_into or op._schema.name in ("aten::_to_copy", "aten::clone"):  # casts and clones
            # a cast to the dtype it already has, of a contiguous tensor, is the tensor itself
            x, out = ins.positional[0], ins.keyword.get("out")
            if ins.constant_keyword.get("memory_format") in (None, torch.contiguous_format, torch.preserve_format) and out is not None and x in self.regions and self.values[x].dtype == self.values[out].dtype:
                return (_identity, True, True)
            return None
        if op._schema.name in self._VIEW_COPIES:
            base, keeps, needs = self._VIEW_COPIES[op._schema.name]
            overload = op._overloadname
            functional = "default" if overload == "out" else overload.replace("_out", "")
            view_op = getattr(getattr(torch.ops.aten, base), functional, None)
            return None if view_op is None else (view_op, keeps, needs)
        return None

    def _copies_viewable(self):
        """(pc, source, output, view op, keeps contiguity, needs a contiguous source) of every
        copy kernel that could run as a view; the callers decide which may."""
        for pc, ins in enumerate(self.instructions):
            if ins.tag != "kernel" or ins.view_op is not None:
                continue
            view = self._view_of_copy(ins)
            y = ins.keyword.get("out")
            if view is not None and y is not None:
                yield (pc, ins.positional[0], y, *view)

    def _run_as_view(self, pc: int, view_op) -> None:
        """Rewrite copy kernel ``pc`` to bind its output to ``view_op`` of its source."""
        ins = self.instructions[pc]
        self.writes[pc] = set()
        self.instructions[pc] = Kernel("kernel", ins.op, ins.positional[:1] + self._view_args(ins), {}, ins.ret_ids, view_op, ins.index, {}, {})

    def _view_args(self, ins) -> list[int]:
        """Positional arguments of the view op: the copy's positional arguments after self."""
        return [] if ins.op is _copy_into else list(ins.positional[1:])

    def _get(self, value_id):
        v = self.values[value_id]
        if isinstance(v, _ListRef):
            items = [self.values[j] for j in v.indices] if not v.optional else [None if j < 0 else self.values[j] for j in v.indices]
            return items
        return v

    # --- running ----------------------------------------------------------------------------
    def check_inputs(self, inputs) -> None:
        """Raise ProgramError for inputs ``bind_inputs`` would refuse, before anything runs."""
        if len(inputs) != len(self.plan.inputs):
            raise ProgramError(f"method '{self.name}' takes {len(self.plan.inputs)} inputs, got {len(inputs)}")
        for value_id, given in zip(self.plan.inputs, inputs):
            slot = self.values[value_id]
            if isinstance(given, torch.Tensor) and isinstance(slot, torch.Tensor):
                if tuple(slot.shape) != tuple(given.shape) or slot.dtype != given.dtype:
                    raise ProgramError(f"method '{self.name}': input of shape {tuple(given.shape)} {given.dtype} does not match the program's {tuple(slot.shape)} {slot.dtype}")

    def bind_inputs(self, inputs) -> None:
        self.check_inputs(inputs)
        for value_id, given in zip(self.plan.inputs, inputs):
            slot = self.values[value_id]
            if isinstance(given, torch.Tensor):
                if slot is not None and isinstance(slot, torch.Tensor):
                    slot.copy_(given)
                else:
                    self.values[value_id] = given.to(self.device)
            else:
                self.values[value_id] = given

    def outputs(self) -> list:
        return [self._get(i) for i in self.plan.outputs]

    def run(self, on_kernel: Callable[[int], None] | None = None, hooked: frozenset[int] | None = None) -> None:
        """Execute the instruction list; ``on_kernel(index)`` follows each kernel in ``hooked``
        (every kernel when ``hooked`` is None).

        Straight-line programs (no jumps: every program hostswap emits) run as Python code
        generated from the instruction list on first use, one statement per instruction, so
        the per-kernel host cost is the ATen call itself; others are interpreted.
        """
        # bound methods compare equal when they wrap the same function and object
        if self._straight_line is None or self._straight_line[0] != (on_kernel, hooked):
            self._straight_line = ((on_kernel, hooked), self._generate(on_kernel, hooked))
        function = self._straight_line[1]
        if function is not None:
            function(self.values)
        else:
            self._interpret(on_kernel, hooked)

    _straight_line = None

    def _generate(self, on_kernel, hooked):
        if any(ins.tag == "jump_false" for ins in self.instructions):
            return None
        namespace: dict = {"_empty": torch.empty, "_device": self.device, "_acquire": self.probe_handler, "_hook": on_kernel}
        lines = ["def _run(V):"]

        def ref(value_id: int) -> str:
            v = self.values[value_id]
            if isinstance(v, _ListRef):
                items = ", ".join("None" if (v.optional and j < 0) else f"V[{j}]" for j in v.indices)
                return f"[{items}]"
            return f"V[{value_id}]"

        for pc, ins in enumerate(self.instructions):
            tag = ins.tag
            if tag == "kernel":
                _, op, positional, keyword, ret_ids, view_op, index, scratch, constant_keyword = ins
                target = view_op if view_op is not None else op
                namespace[f"_op{pc}"] = getattr(target, "_op", target)  # the C++ callable behind an OpOverload
                args = [ref(i) for i in positional]
                if view_op is None:
                    args += [f"{name}={ref(i)}" for name, i in keyword.items() if name not in scratch]
                    for name, value in constant_keyword.items():
                        namespace[f"_c{pc}_{name}"] = value
                        args.append(f"{name}=_c{pc}_{name}")
                    for name, dtype in scratch.items():
                        namespace[f"_d{pc}_{name}"] = dtype
                        args.append(f"{name}=_empty(0, dtype=_d{pc}_{name}, device=_device)")
                call = f"_op{pc}({', '.join(args)})"
                if view_op is not None or len(ret_ids) == 1:
                    lines.append(f"    V[{ret_ids[0]}] = {call}")
                else:
                    lines.append(f"    _r = {call}")
                    lines += [f"    V[{rid}] = _r[{k}]" for k, rid in enumerate(ret_ids)]
                if view_op is None and on_kernel is not None and (hooked is None or index in hooked):
                    lines.append(f"    _hook({index})")
            elif tag == "probe":
                _, probe_id, fqn, ret_id = ins
                namespace[f"_fqn{pc}"] = fqn
                lines.append(f"    V[{ret_id}] = _acquire({probe_id}, _fqn{pc})")
            elif tag == "move":
                lines.append(f"    V[{ins.target}] = V[{ins.source}]")
        lines.append("    return None")
        code = compile("\n".join(lines), f"<hostswap method {self.name}>", "exec")
        exec(code, namespace)
        return namespace["_run"]

    def _interpret(self, on_kernel, hooked) -> None:
        values, instructions = self.values, self.instructions
        pc, n = 0, len(instructions)
        while pc < n:
            ins = instructions[pc]
            tag = ins.tag
            if tag == "kernel":
                _, op, positional, keyword, ret_ids, view_op, index, scratch, constant_keyword = ins
                args = [self._get(i) for i in positional]
                if view_op is not None:
                    values[ret_ids[0]] = view_op(*args)
                else:
                    kwargs = {name: self._get(i) for name, i in keyword.items()}
                    kwargs.update(constant_keyword)
                    for name, dtype in scratch.items():
                        kwargs[name] = torch.empty(0, dtype=dtype, device=self.device)
                    result = op(*args, **kwargs)
                    if len(ret_ids) == 1:
                        values[ret_ids[0]] = result
                    else:
                        for rid, r in zip(ret_ids, result):
                            values[rid] = r
                    if on_kernel is not None and (hooked is None or index in hooked):
                        on_kernel(index)
            elif tag == "probe":
                _, probe_id, fqn, ret_id = ins
                values[ret_id] = self.probe_handler(probe_id, fqn)
            elif tag == "move":
                values[ins.target] = values[ins.source]
            elif tag == "jump_false":
                if not bool(values[ins.condition]):
                    pc = ins.destination
                    continue
            pc += 1
