"""Loading one method of a program: its values table, its arenas and its instructions.

Values are resolved once: scalars and lists to Python values, planned tensors to views of the
method's arenas on the device, constants to device copies of exactly their bytes, external
weights through ``weights``. Tensors the method does not plan (inputs bound per call, probe
outputs bound to the weight pool, views of them) start as None. Each instruction becomes a
typed tuple (runtime/instructions.py) with the value ids it reads and writes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hostswap.runtime.instructions import (
    DIM_ORDER_OUT_OPS, ET_VIEW_OPERATOR, Free, FunctionalAsOut, Instruction, JumpFalse, Kernel, ListRef, Move, Probe,
    ProgramError, copy_into, register_executorch_ops, resolve_operator, value_of,
)
from hostswap.schedules.custom_ops import PROBE_OPERATOR
from hostswap.schedules.op_facts import is_view_copy, view_for_copy
from hostswap.schedules.pte_program import SCALAR_EVALUES, evalue_scalar, tensor_nbytes, torch_dtype


def tensor_from_arena(t, arenas: dict[int, torch.Tensor], at: tuple[int, int] | None = None) -> torch.Tensor:
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


def _state_tensors(plan):
    """The planned tensors of ``plan`` that are program state (buffers it mutates, emitted
    with their names)."""
    for value in plan.values:
        t = value.val
        if type(t).__name__ != "Tensor" or t.allocation_info is None:
            continue
        info = t.extra_tensor_info
        if info is not None and info.fully_qualified_name and info.location.name != "EXTERNAL":
            yield t


def state_memory_ids(plan) -> dict[int, int]:
    """Memory id -> bytes, of the arenas where ``plan`` keeps program state."""
    return {t.allocation_info.memory_id: plan.non_const_buffer_sizes[t.allocation_info.memory_id] for t in _state_tensors(plan)}


class LoadedMethod:
    """One method of a program with every value and instruction resolved at load.

    ``regions`` maps each planned value to its (memory id, start, end) bytes in the arenas,
    ``reads`` and ``writes`` give per instruction the value ids it reads and writes (out
    arguments). The view planner (runtime/view_planning.py) may rewrite instructions, values
    and arenas before the method runs.
    """

    def __init__(self, program, plan, device: torch.device, weights: Callable[[str], torch.Tensor] | None, state: dict[int, torch.Tensor] | None = None):
        register_executorch_ops()
        self.plan, self.device, self.name = plan, device, plan.name
        # Memory ids holding program state (state_memory_ids) come from ``state``: one tensor
        # per id for every method of the program, kept across calls.
        self.state_ids = frozenset(state or ())
        for memory_id in state_memory_ids(plan):
            if memory_id not in self.state_ids:
                raise ProgramError(f"method '{self.name}' keeps program state in memory id {memory_id}, which was not allocated")
            if state[memory_id].numel() < plan.non_const_buffer_sizes[memory_id]:
                raise ProgramError(f"method '{self.name}' needs {plan.non_const_buffer_sizes[memory_id]} bytes of state in memory id {memory_id}, {state[memory_id].numel()} were allocated")
        self.arenas = {
            memory_id: (state[memory_id] if memory_id in self.state_ids else torch.empty(size, dtype=torch.uint8, device=device))
            for memory_id, size in enumerate(plan.non_const_buffer_sizes)
            if size > 0
        }
        self.arena_bytes = sum(size for memory_id, size in enumerate(plan.non_const_buffer_sizes) if memory_id not in self.state_ids)
        self.values: list = [None] * len(plan.values)
        self.unplanned: set[int] = set()
        self.regions: dict[int, tuple[int, int, int]] = {}  # planned value -> (memory id, start, end)
        self.contiguous: dict[int, bool] = {}
        self.meta: dict[int, object] = {}  # planned value -> its program tensor (sizes, dtype, dim order)
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

    # --- values -----------------------------------------------------------------------------
    def _initial_value(self, i, value, program, weights):
        kind = type(value.val).__name__
        v = value.val
        if kind == "Null":
            return None
        if kind in SCALAR_EVALUES:
            return evalue_scalar(value)
        if kind in ("IntList", "TensorList"):
            return ListRef(list(v.items))
        if kind == "OptionalTensorList":
            return ListRef(list(v.items), optional=True)
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
            self.meta[i] = t
            tensor = tensor_from_arena(t, self.arenas)
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
                self.reads[-1].update(v.indices if isinstance(v, ListRef) else [value_id])
        self.writes[-1].update(ret_ids)
        view_op = None
        if len(out_ids) == 1 and out_ids[0] in self.unplanned and is_view_copy(op):
            # a *_copy into an unplanned tensor: a view of a probe's output; run it as the view
            view_op = view_for_copy(op)
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

            dim_order = value_of(self.values, keyword.pop("dim_order")) if "dim_order" in keyword else None
            op = DIM_ORDER_OUT_OPS[op_meta.name]
            if op is not torch.ops.aten.empty.out:  # the planned out is the empty tensor, in its dim order; ATen refuses a format beside it
                constant_keyword["memory_format"] = get_memory_format(list(dim_order) if dim_order is not None else None)
            accepted = op.accepted if op is copy_into else {a.name for a in op._schema.arguments}
            keyword = {name: value_id for name, value_id in keyword.items() if name in accepted}
        return Kernel("kernel", op, positional, keyword, ret_ids, view_op, index, scratch, constant_keyword)
