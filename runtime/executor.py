"""Runs a loaded method (runtime/method_loader.py) with PyTorch's ATen kernels on a device.

Probe instructions bind their output to the weight pool's tensor; ``*_copy`` view ops of a
probe's output run as views, so weights are never copied on the device. Straight-line
methods (every method hostswap emits) run as Python code generated from their instruction
list, one statement per instruction; methods with jumps are interpreted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hostswap.runtime.instructions import ListRef, ProgramError, value_of
from hostswap.runtime.method_loader import LoadedMethod
from hostswap.runtime.view_planning import plan_views

__all__ = ["MethodExecutor", "ProgramError"]


class MethodExecutor:
    """One method of a program, ready to run; ``probe_handler(probe_id, fqn)`` serves its probes."""

    def __init__(self, method: LoadedMethod, probe_handler=None, elided_copies: int = 0):
        self.method = method
        self.plan, self.device, self.name = method.plan, method.device, method.name
        self.values, self.instructions = method.values, method.instructions
        self.probe_handler = probe_handler
        self.elided_copies = elided_copies

    @classmethod
    def load(cls, program, plan, device: torch.device, weights: Callable[[str], torch.Tensor] | None, probe_handler=None, state: dict[int, torch.Tensor] | None = None) -> "MethodExecutor":
        """Method ``plan`` of ``program`` loaded on ``device``, its view-like copies run as
        views; ``state``: the program's state arenas (method_loader.state_memory_ids)."""
        method = LoadedMethod(program, plan, device, weights, state)
        elided = plan_views(method)
        return cls(method, probe_handler, elided)

    @property
    def arena_bytes(self) -> int:
        return self.method.arena_bytes

    def _get(self, value_id):
        return value_of(self.values, value_id)

    # --- running ----------------------------------------------------------------------------
    def check_inputs(self, inputs) -> None:
        """Raise ProgramError for inputs ``bind_inputs`` would refuse, before anything runs."""
        if len(inputs) != len(self.plan.inputs):
            raise ProgramError(f"method '{self.name}' takes {len(self.plan.inputs)} inputs, got {len(inputs)}")
        for position, (value_id, given) in enumerate(zip(self.plan.inputs, inputs)):
            slot = self.values[value_id]
            if given is None and slot is not None:
                raise ProgramError(f"method '{self.name}': input {position} is None; the program takes a tensor there")
            if isinstance(slot, torch.Tensor):
                want = f"a tensor of shape {tuple(slot.shape)} {slot.dtype}"
                if not isinstance(given, torch.Tensor):
                    raise ProgramError(f"method '{self.name}': input {position} is a {type(given).__name__}; the program takes {want}")
                if tuple(slot.shape) != tuple(given.shape) or slot.dtype != given.dtype:
                    raise ProgramError(f"method '{self.name}': input {position} of shape {tuple(given.shape)} {given.dtype} does not match the program's: it takes {want} (shapes are the exported ones)")
                if given.device.type not in ("cpu", "cuda"):
                    raise ProgramError(f"method '{self.name}': input {position} is on {given.device}; give it on the CPU or a CUDA device (it is copied to {self.device})")

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
            if isinstance(v, ListRef):
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
