"""``hostswap.runtime.Module``: load a lowered program with ``weight_offload_budget_mb`` and run it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
import time
import weakref

import torch

from hostswap.kernels.routed_experts import REPLAYED_COUNTS, ExpertReads, reading_rows, recording_reads, using_caches, using_host_experts, warming_a_graph
from hostswap.runtime.budget import (
    AUTO, auto_budget, check_budget_argument, check_device_memory, expert_scratch_on, free_memory, grouped_attention_scratch_on, total_memory,
)
from hostswap.runtime.compiled_method import CompiledExecutor, compiled_or_none
from hostswap.runtime.executor import MethodExecutor
from hostswap.runtime.host_tier import check_host_budget_argument, open_disk_reader, plan_placement
from hostswap.runtime.expert_cache import DEFAULT_POLICY, check_policy, check_prefetch, expert_read_stats, place_experts
from hostswap.runtime.expert_store import check_expert_host_cache_argument, close_host_experts, open_host_experts
from hostswap.runtime.instructions import ListRef, ProgramError
from hostswap.runtime.method_loader import state_memory_ids
from hostswap.runtime.lru_pool import LruPool
from hostswap.runtime.planned_pool import PlannedPool
from hostswap.runtime.pool import PoolCreationError
from hostswap.runtime.ptd import PtdFile, open_pair, verify_showing_progress
from hostswap.schedules.artifacts import ArtifactError
from hostswap.schedules.policies import check_budget
from hostswap.schedules.pte_program import constant_method_outputs, external_weights, plan_by_name, read_program, read_program_bytes, torch_dtype
from hostswap.schedules.serialization import decode_program
from hostswap.schedules.weight_schedule import check_prefetch_depth


# PoolStats counters a graph replay advances by what its captured forward counted.
_REPLAY_COUNTED = ("forwards", "hits", "misses", "bytes_h2d", "prefetches_issued", "prefetches_used", "fills_carried", "bytes_carried")
# The PoolStats fields it leaves as they are, and why. Every field is in one of the two
# (tests/test_runtime.py): a counter added later must be placed.
_REPLAY_NOT_COUNTED = {
    "evictions": "lru only (graphs are planned)",
    "prefetches_wasted": "lru only",
    "allocations": "lru only",
    "allocation_seconds": "lru only",
    "pool_trims": "lru only",
    "fragmentation_evictions": "lru only",
    "stall_seconds": "not timed inside a graph",
    "peak_weight_bytes": "a high-water mark, unchanged by a replay of the same plan",
}


# The weight pool of each policy (runtime/pool.py has the interface they share).
POOLS = {"planned": PlannedPool, "lru": LruPool}


def _kernel_launched(pool, kernel_of_instruction: dict[int, int], index: int) -> None:
    # the pool, not the Module: a closure over the Module would make a reference cycle
    pool.kernel_launched(kernel_of_instruction[index])


def check_device_argument(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must name a device such as 'cuda', 'cuda:1' or 'cpu', got {device!r}: {e}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device or the CPU, got {str(device)!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise PoolCreationError("device='cuda' was asked for but torch.cuda.is_available() is False")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


class ConcurrentExecutionError(RuntimeError):
    """Two threads tried to run one loaded Module at the same time."""


class ModuleClosedError(RuntimeError):
    """A Module (or Generator) was used after ``close()``."""


def _release(ptd: PtdFile, pool, device: torch.device, host_experts=None) -> None:
    """Free the pool's device memory, undo the host registration and unmap the ``.ptd``: run
    by ``Module.close()``, or when the last reference to the Module goes. ``host_experts``:
    (reader, host caches) of experts read from the disk."""
    if device.type == "cuda" and (pool is not None or host_experts):
        torch.cuda.synchronize(device)
    if pool is not None:
        pool.close()
    if host_experts:
        close_host_experts(*host_experts)
    ptd.close()


def _instruction_kernels(executor: MethodExecutor) -> list[tuple[int, set[int]]]:
    """(instruction index, probe ids it reads) of every non-view kernel that reads a probe's output."""
    derived: dict[int, set[int]] = {}
    kernels = []
    for ins in executor.instructions:
        if ins.tag == "probe":
            derived[ins.ret_id] = {ins.probe_id}
        elif ins.tag == "kernel":
            _, op, positional, keyword, ret_ids, view_op, index, _scratch, _constants = ins
            read: set[int] = set()
            for value_id in list(positional) + list(keyword.values()):
                v = executor.values[value_id]
                ids = v.indices if isinstance(v, ListRef) else [value_id]
                for j in ids:
                    read |= derived.get(j, set())
            if not read:
                continue
            if view_op is not None:
                derived[ret_ids[0]] = read
            else:
                kernels.append((index, read))
    return kernels


def _owned(outputs: list) -> list:
    """The caller's own copies of a method's outputs.

    Outputs live in the method's activation arena (or a CUDA graph's static buffers), which
    the next call reuses: handed out as they are, a later call would overwrite a result the
    caller still holds. One device copy per output tensor.
    """
    return [o.clone() if isinstance(o, torch.Tensor) else _owned(o) if isinstance(o, list) else o for o in outputs]


class Module:
    """A hostswap program loaded for execution with its weights streamed from a ``.ptd``.

    ``policy``: ``planned`` (default) or ``lru``. ``cuda_graph=True`` (planned, CUDA, static
    input shapes) captures the whole forward, copies included, at the first call; each replay
    copies the next one's first fills in its own idle tail, as eager forwards do. A program
    with several methods that read weights (``prefill`` and ``decode``) has one pool for all;
    ``cuda_graph`` may then name the methods to capture, e.g. ``cuda_graph=("decode",)``.
    ``prefetch_depth`` overrides the depth recorded by the pass; the floor is recomputed
    for it (a deeper prefetch needs more headroom), so the budget check stays exact.
    ``weight_offload_budget_mb="auto"`` takes the device's free memory less the program's
    state (a KV cache), its activations and a margin (``runtime/budget.py``), capped at the
    weights' total; ``auto_budget`` tells what it chose and why.

    ``host_memory_budget_mb`` (default ``"auto"``: a share of the RAM available at load,
    ``runtime/host_tier.py``) caps the streamed weight bytes kept in pinned host memory; the
    planned policy reads the others from the ``.ptd`` on disk ahead of their copies
    (``tiers`` tells which weight is where; a forward with disk reads runs eagerly, so
    ``cuda_graph`` then fails unless ``cuda_graph_where_possible``). The lru policy keeps every
    streamed weight pinned.

    ``expert_prefetch=N`` (``True``: 1) has each MoE block with a device cache prefetch the
    top-k the block before it predicts, at most N of them missing, a layer early, while the
    attention between them runs (runtime/expert_cache.py). Off by default: it pays where an
    expert moves over the bus in about an attention's time (many small experts) and the guess
    is mostly right; a big expert (Mixtral's) moved on a wrong guess costs more than it saves.
    ``expert_cache_policy``: which expert a device cache, and a host cache of experts on disk
    (below), evicts: ``"lfu"`` (default: the one picked least often lately, or for a host cache
    asked for least often, the least recently used among equals) or ``"lru"``.

    ``expert_host_cache_mb`` (default ``"auto"``): where an MoE model's expert tables do not
    fit in the host memory available at load besides its other pinned weights, they stay in
    the ``.ptd`` on disk and each block gets a cache of experts in pinned host memory, filled
    from the file as the router picks them (runtime/expert_store.py); a number of MB sizes
    that cache (experts then on disk unless it holds every table). Forwards then run eagerly.

    ``compiled=True`` (or the names of methods) runs each method as one graph compiled by
    TorchInductor instead of a kernel per instruction (runtime/compiled_method.py): for a
    program whose steps are bound by their kernel launches, such as a speculative draft held
    whole, or an MoE model whose weights but its routed experts fit. It needs every weight the
    pool would stream resident (routed experts may be read in place or through a cache, by
    their op inside the graph); the first call compiles.
    ``compiled_where_possible``: a method that cannot be compiled runs as the executor runs it,
    with a warning, instead of failing.

    At load the ``.ptd`` index is validated and both files are checked to be the pair
    ``hostswap.save`` wrote, without reading a weight (docs/weight-offload.md, "Trusting the
    files"); ``verify=True`` also hashes every weight byte against its checksum. A bad file
    raises ``ArtifactError`` naming it and the field. ``close()`` (or leaving a ``with``
    block, or dropping the last reference) frees the device memory, undoes the host
    registration and unmaps the file.
    """

    def __init__(self, pte_path, data_path=None, *, weight_offload_budget_mb: float | str, device="cuda", policy: str = "planned", cuda_graph: bool | tuple[str, ...] = False, prefault: bool = False, lock: bool = False, warm_pool: bool = True, prefetch_depth: int | None = None, verify: bool = False,
                 host_memory_budget_mb: float | str = "auto", cuda_graph_where_possible: bool = False, expert_prefetch: bool | int = False,
                 compiled: bool | tuple[str, ...] = False, compiled_where_possible: bool = False, expert_host_cache_mb: float | str = AUTO,
                 expert_cache_policy: str = DEFAULT_POLICY):
        t0 = time.perf_counter()
        self._closed = True  # until loaded
        check_budget_argument(weight_offload_budget_mb)
        check_host_budget_argument(host_memory_budget_mb)
        check_expert_host_cache_argument(expert_host_cache_mb)
        self._host_budget_mb = host_memory_budget_mb
        self._expert_host_cache_mb = expert_host_cache_mb
        self._graph_where_possible = cuda_graph_where_possible
        self.device = check_device_argument(device)
        if policy not in POOLS:
            raise ValueError(f"policy must be one of {tuple(POOLS)}, got {policy!r}")
        if cuda_graph and not POOLS[policy].capturable:
            raise ValueError("cuda_graph=True needs policy='planned' on a CUDA device")
        if not isinstance(verify, bool):
            raise ValueError(f"verify must be True or False, got {verify!r}")
        if not isinstance(expert_prefetch, int) or expert_prefetch < 0:
            raise ValueError(f"expert_prefetch must be True, False or a number of experts (0 or more), got {expert_prefetch!r}")
        self._expert_prefetch = int(expert_prefetch)
        check_policy(expert_cache_policy)
        self.expert_cache_policy = expert_cache_policy  # the device caches' and the host caches' of experts on disk
        _check_method_names_argument("cuda_graph", cuda_graph)
        _check_method_names_argument("compiled", compiled)
        self.pte_path = os.fspath(pte_path)
        if data_path is None:
            data_path = os.path.splitext(self.pte_path)[0] + ".ptd"
        pte_bytes = read_program_bytes(self.pte_path)
        # the program first: a file that is no hostswap program is named as such before its
        # weights file is looked for
        self.program = read_program(pte_bytes, self.pte_path)
        self.schedules = decode_program(self.program, self.pte_path)
        if prefetch_depth is not None:
            check_prefetch_depth(prefetch_depth, ValueError)
            self.schedules = {name: dataclasses.replace(s, prefetch_depth=prefetch_depth) for name, s in self.schedules.items()}
        self.method_name = next(iter(self.schedules))  # what __call__ runs
        self.schedule = _one_weight_order(self.schedules, self.pte_path)
        # before the .ptd is opened: a bad count is named without the load's work
        check_prefetch(self._expert_prefetch, ((b.block, b.top_k) for b in self.schedule.expert_blocks))
        graphed = self._method_names("cuda_graph", cuda_graph)
        self._compiled_names = self._method_names("compiled", compiled)
        self._compiled_where_possible = bool(compiled_where_possible)
        if self._compiled_names and policy != "planned":
            raise ValueError("compiled needs policy='planned': it runs a method with every weight but routed experts resident")
        if graphed and self.device.type != "cuda":
            raise ValueError("cuda_graph=True needs policy='planned' on a CUDA device")
        # the floor at load is the largest of the methods' floors, plus the device scratch a
        # routed-experts call gathers its picked experts into (outside the pool), where this
        # device gathers them: on CUDA with Triton the products read them in place
        floor_schedule = max(self.schedules.values(), key=lambda s: s.floor_bytes)
        self.expert_scratch_bytes = expert_scratch_on(self.schedules, self.device)
        # grouped KV heads repeated by attention where this device does not read them in place:
        # a temporary beside the activations, outside the weight budget
        self.attention_scratch_bytes = grouped_attention_scratch_on(self.program, self.device)
        self.auto_budget = None  # what "auto" chose, and from what
        if weight_offload_budget_mb == AUTO:
            state_sizes, activations = self._arena_sizes()
            self.auto_budget = auto_budget(free_bytes=free_memory(self.device), total_bytes=total_memory(self.device),
                                           state_bytes=sum(state_sizes.values()), activation_bytes=activations + self.expert_scratch_bytes + self.attention_scratch_bytes,
                                           weight_bytes=self.schedule.resident_bytes + self._expert_table_bytes(),
                                           floor_bytes=floor_schedule.floor_bytes, device=self.device)
            given = self.auto_budget.budget_bytes + self.expert_scratch_bytes
        else:
            given = round(weight_offload_budget_mb * 2**20)
        check_budget(floor_schedule, given, self.expert_scratch_bytes)
        self.budget_bytes = given - self.expert_scratch_bytes  # the pool's, and the resident experts'
        self.ptd = open_pair(self.pte_path, pte_bytes, self.program, data_path)
        self.expert_reads: dict[str, ExpertReads] = {}  # routed experts read, per MoE block
        self._host_experts = (None, {})  # (reader, host cache per block) of experts read from the disk
        try:
            self._load(policy, graphed, prefault, lock, warm_pool, verify)
        except BaseException:
            _release(self.ptd, getattr(self, "pool", None), self.device, self._host_experts)
            raise
        self._closed = False
        # Released when the last reference goes, if close() was not called: nothing the
        # finalizer holds refers back to the Module.
        self._finalizer = weakref.finalize(self, _release, self.ptd, self.pool, self.device, self._host_experts)
        self._lock = threading.Lock()
        self.load_seconds = time.perf_counter() - t0

    def _load(self, policy: str, graphed: set[str], prefault: bool, lock: bool, warm_pool: bool, verify: bool) -> None:
        self._check_weights()
        self.verified_bytes, self.verify_seconds = verify_showing_progress(self.ptd) if verify else (0, 0.0)
        layout, self.host_budget, self.tiers, self.expert_host_plan = plan_placement(self.schedule, self.budget_bytes, policy == "planned",
                                                                                    self._host_budget_mb, self._expert_host_cache_mb)
        if self.tiers.disk and graphed:
            if not self._graph_where_possible:
                raise ValueError(f"cuda_graph needs every streamed weight in pinned host memory; host_memory_budget_mb={self.host_budget.budget_bytes / 2**20:.1f} "
                                 f"leaves {len(self.tiers.disk)} weights on disk, read eagerly. Raise the host budget or load without cuda_graph")
            graphed.clear()
        if self.expert_host_plan.on_disk:
            # a call learns its picks on the host to read them from the file: no graph holds that
            for option, asked, where_possible in (("cuda_graph", graphed, self._graph_where_possible), ("compiled", self._compiled_names, self._compiled_where_possible)):
                if asked and not where_possible:
                    raise ValueError(f"{option} needs the routed experts in pinned host memory; {self.expert_host_plan.explain()}, read eagerly. "
                                     f"Load without {option}, or where the host memory holds the expert tables")
            graphed.clear()
            self._compiled_names = set()
        on_disk = self.expert_host_plan.disk_tables
        # only what is copied after load (resident weights are copied once, at load) and the
        # tables row gathers read in place: the pages the host tier keeps
        host_tier = [self.schedule.fqns[w] for w in sorted(self.tiers.pinned)] + [f for f in self.schedule.host_read if f not in on_disk]
        some = self.tiers.disk or on_disk  # the whole mapping stays in RAM only where no weight is on disk
        if prefault:
            self.ptd.prefault(host_tier if some else None)
        if lock:
            self.ptd.lock(host_tier if some else None)
        # MoE experts take the budget left once every streamed weight is resident: whole
        # tables where they fit, else a device cache per block; the rest are read in place
        self.resident_experts, self.expert_caches = place_experts(self.schedule.expert_blocks, self.budget_bytes - self.schedule.resident_bytes, self.device,
                                                                    prefetch=self._expert_prefetch, unguessed=frozenset(self.expert_host_plan.slots),
                                                                    policy=self.expert_cache_policy)
        on_device = {t for b in self.schedule.expert_blocks if b.block in self.resident_experts for t in b.tables}
        state_sizes, activations = self._arena_sizes()
        weights_on_device = (min(self.budget_bytes, self.schedule.resident_bytes) + sum(c.nbytes for c in self.expert_caches.values())
                             + sum(b.table_bytes for b in self.schedule.expert_blocks if b.block in self.resident_experts))
        check_device_memory(self.device, weights_on_device, sum(state_sizes.values()), activations + self.expert_scratch_bytes + self.attention_scratch_bytes,
                            free_memory(self.device))
        host = {fqn: self.ptd.host_tensor(fqn) for fqn in self.schedule.fqns}
        if layout is None:
            self.pool = POOLS[policy](self.schedule, host, self.budget_bytes, self.device, warm=warm_pool)
        else:
            reader = open_disk_reader(self.ptd, self.schedule, self.tiers, self.device)
            try:
                self.pool = PlannedPool(self.schedule, host, self.budget_bytes, self.device, layout=layout, disk_reader=reader, disk_fills=self.tiers.disk_fills)
            except BaseException:
                if reader is not None:
                    reader.close()
                raise
        del host
        if self.device.type == "cuda":
            self.ptd.register_with_cuda(host_tier)
        # experts on disk: their host caches; the tables' mapped views bound to the program are
        # never read (a call reads the experts it picks through its block's host cache)
        self._host_experts = open_host_experts(self.expert_host_plan, tuple(b for b in self.schedule.expert_blocks if b.block in self.expert_host_plan.slots), self.ptd, self.device,
                                                self.expert_cache_policy)
        self._host_read = {fqn: self.ptd.host_tensor(fqn).to(self.device, copy=True) if fqn in on_device
                           else self.ptd.device_view(fqn, self.device) if self.device.type == "cuda" and fqn not in on_disk else self.ptd.host_tensor(fqn)
                           for fqn in self.schedule.host_read}
        # routed experts are read by their op (in place from host memory, or through a device
        # cache): an opaque call in a compiled graph; a weight the pool streams is not
        if self._compiled_names and self.pool.streamed_weights():
            # the pool holds every weight from its aligned bytes on (and the floor in any case); the scratch is beside it
            need = max(max(s.resident_bytes for s in self.schedules.values()), max(s.floor_bytes for s in self.schedules.values())) + self.expert_scratch_bytes
            raise ValueError(f"compiled needs every weight but routed experts resident on the device: weight_offload_budget_mb="
                             f"{(self.budget_bytes + self.expert_scratch_bytes) / 2**20:.1f} streams some; {self.pte_path} needs "
                             f"{math.ceil(need / 2**20 * 10) / 10:.1f} MiB to hold them")
        self._executors: dict[str, MethodExecutor] = {}
        self._probed: dict[str, _ProbedMethod] = {}
        # Program state (buffers the methods mutate, a KV cache): one zeroed device tensor
        # per memory id, shared by every method and kept across calls.
        self.state = {memory_id: torch.zeros(nbytes, dtype=torch.uint8, device=self.device) for memory_id, nbytes in state_sizes.items()}
        for name in self.schedules:
            try:
                executor = self._load_executor(plan_by_name(self.program, name))
                kernels = self._map_kernels(name, executor)
            except ProgramError as e:
                raise ArtifactError(self.pte_path, f"method '{name}'", str(e)) from e
            method = _ProbedMethod(executor, kernels, name in graphed, compiled=isinstance(executor, CompiledExecutor))
            method.on_kernel = functools.partial(_kernel_launched, self.pool, method.kernel_of_instruction)
            self._probed[name] = method
        if len(self._probed) > 1:
            # Fills carried from one forward into the next assume the next is the same
            # graph or eager path; with several methods the next call may be either.
            self.pool.disable_carry()
        self.policy = policy
        self.cuda_graph = bool(graphed)

    # --- load-time checks --------------------------------------------------------------------
    def _check_weights(self) -> None:
        for name in self.schedules:
            expected = external_weights(plan_by_name(self.program, name))
            for fqn in self.schedules[name].fqns + self.schedules[name].host_read:
                if fqn not in expected:
                    raise ArtifactError(self.pte_path, f"method '{name}'", f"schedules weight '{fqn}', which it does not read from the .ptd")
            for fqn, t in expected.items():
                entry = self.ptd.entries.get(fqn)
                if entry is None:
                    raise ArtifactError(self.ptd.path, f"weight '{fqn}'", f"is missing; {self.pte_path} reads it")
                try:
                    want = (tuple(t.sizes), torch_dtype(t.scalar_type))
                except ValueError as e:
                    raise ArtifactError(self.pte_path, f"weight '{fqn}'", str(e)) from None
                have = (entry.shape, entry.dtype)
                if want != have:
                    raise ArtifactError(self.ptd.path, f"weight '{fqn}'", f"has shape {list(have[0])} {have[1]}; {self.pte_path} expects {list(want[0])} {want[1]}")

    def _unprobed_weight(self, fqn: str):
        # A table that row gathers read in place: its device view of the host pages. External
        # tensors that are probed are bound per call by the pool; the placeholder value
        # itself is never read by a kernel. Keep the host view for completeness.
        if fqn in self._host_read:
            return self._host_read[fqn]
        return self.ptd.host_tensor(fqn)

    def _method_names(self, option: str, value: bool | tuple[str, ...]) -> set[str]:
        """The methods an option given as True (all) or as method names applies to; a name that
        is not a method reading weights is refused."""
        names = set(self.schedules) if value is True else set(value or ())
        unknown = names - set(self.schedules)
        if unknown:
            raise ValueError(f"{option} names {sorted(unknown)}, which are not methods of {self.pte_path} that read weights ({list(self.schedules)})")
        return names

    def _load_executor(self, plan) -> MethodExecutor:
        executor = None
        if plan.name in self._compiled_names:
            executor = compiled_or_none(lambda: CompiledExecutor.load_compiled(self.program, plan, self.device, self._unprobed_weight, self.pool.resident_tensor,
                                                                               state=self.state, where_possible=self._compiled_where_possible),
                                        self._compiled_where_possible, f"{self.pte_path}: method '{plan.name}'")
        if executor is None:
            executor = MethodExecutor.load(self.program, plan, self.device, weights=self._unprobed_weight, probe_handler=self.pool.acquire, state=self.state)
        self._executors[plan.name] = executor
        return executor

    def _arena_sizes(self) -> tuple[dict[int, int], int]:
        """(memory id -> bytes of program state, the methods' other arena bytes together), from
        the program's plans: each method that reads weights is loaded with arenas of its own."""
        state: dict[int, int] = {}
        activations = 0
        for plan in self.program.execution_plan:
            ids = state_memory_ids(plan)
            for memory_id, nbytes in ids.items():
                state[memory_id] = max(state.get(memory_id, 0), nbytes)
            if plan.name in self.schedules:
                activations += sum(size for i, size in enumerate(plan.non_const_buffer_sizes) if i not in ids)
        return state, activations

    def reset_state(self) -> None:
        """Zero the program's state (a KV cache) as at load; the next call starts from it."""
        self.ensure_open()
        for t in self.state.values():
            t.zero_()

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() for t in self.state.values())

    def _map_kernels(self, name: str, executor: MethodExecutor) -> dict[int, int]:
        kernels = _instruction_kernels(executor)
        if len(kernels) != self.schedule.num_kernels:
            raise ProgramError(f"{self.pte_path}: method '{name}' has {len(kernels)} kernels reading probes, its schedule {self.schedule.num_kernels}")
        mapping = {}
        for j, (index, probes) in enumerate(kernels):
            if any(self.schedule.probe_kernel[p] != j for p in probes):
                raise ProgramError(f"{self.pte_path}: method '{name}': instruction {index} reads probes {sorted(probes)}, which the schedule gives to other kernels")
            mapping[index] = j
        return mapping

    # --- running -------------------------------------------------------------------------------
    def _kernels_context(self, method: "_ProbedMethod") -> contextlib.ExitStack:
        """What the kernels of a forward are given: where to count reads, the expert caches, and
        the rows of the batch that are read."""
        stack = contextlib.ExitStack()
        for context in (recording_reads(self.expert_reads), using_caches(self.expert_caches), using_host_experts(self.host_experts),
                        reading_rows(method.live_rows)):
            stack.enter_context(context)
        return stack

    def _run_forward(self, method: "_ProbedMethod", inputs=None, captured: bool = False) -> None:
        """One forward; ``inputs`` are bound after the pool has started its first copies. A
        forward run (not ``captured``) adds the reads its calls counted per live row in."""
        if method.compiled:  # every weight resident: nothing for the pool to copy or count
            if inputs is not None:
                method.executor.bind_inputs(inputs)
            with self._kernels_context(method):
                method.executor.run()
        else:
            self.pool.begin_forward()
            if inputs is not None:
                method.executor.bind_inputs(inputs)
            with self._kernels_context(method):
                method.executor.run(method.on_kernel, hooked=method.hooked)
            self.pool.end_forward()
        if not captured:
            for reads in self.expert_reads.values():
                reads.fold(method.live_count)

    def ensure_open(self) -> None:
        """Raise unless the Module can run: not closed, its ``.ptd`` unchanged since load."""
        if self._closed:
            raise ModuleClosedError(f"this hostswap Module ({self.pte_path}) was closed; load it again to run it")
        self.ptd.check_unchanged()

    def run_method(self, name: str = "forward", inputs=(), live_rows=None):
        """Run method ``name`` on ``inputs``; its outputs. ``live_rows`` (one bool per row, for
        a method whose inputs are a batch: a batched decode step) names the rows whose outputs
        the caller reads: the routed experts of the others are not read (no bytes over the bus,
        no expert cache slots), and their outputs are not the model's. Once given for a method,
        a call without it reads every row; a CUDA graph captured before the method's first call
        with it reads every row at each replay."""
        self.ensure_open()
        if not self._lock.acquire(blocking=False):
            raise ConcurrentExecutionError("this hostswap Module is already executing on another thread; one loaded Module runs one call at a time (load one per thread)")
        try:
            with torch.no_grad():
                return _owned(self._run_method(name, list(inputs), live_rows))
        finally:
            self._lock.release()

    def _run_method(self, name, inputs, live_rows=None):
        method = self._probed.get(name)
        if method is None:
            if name not in self._executors:
                plan = plan_by_name(self.program, name)
                if plan is None:
                    raise ProgramError(f"{self.pte_path} has no method '{name}' (methods: {[p.name for p in self.program.execution_plan]})")
                if not plan.inputs and not any(chain.instructions for chain in plan.chains):
                    return constant_method_outputs(self.program, name)  # a constant method
                self._load_executor(plan)
            executor = self._executors[name]
            executor.bind_inputs(inputs)
            executor.run()
            return executor.outputs()
        live = _live_row_flags(name, method, live_rows, inputs)
        if method.graphed:
            return self._run_graphed(name, method, inputs, live)
        method.executor.check_inputs(inputs)  # a refused input must not leave a forward half begun
        self._write_live_rows(method, live)
        self._run_forward(method, inputs)
        return method.executor.outputs()

    def _write_live_rows(self, method: "_ProbedMethod", live: torch.Tensor | None) -> None:
        """Set the rows the method's next forward reads: ``live`` (host bools), or every row
        where the method was given live rows before (a captured graph reads the same tensor)."""
        if live is None and method.live_rows is None:
            return
        if method.live_rows is None:
            method.live_rows = torch.empty(live.shape, dtype=torch.bool, device=self.device)
        if live is None:
            method.live_rows.fill_(True)
            method.live_count = method.live_rows.numel()
        else:
            method.live_rows.copy_(live)
            method.live_count = int(live.sum())

    def _run_graphed(self, name: str, method: "_ProbedMethod", inputs, live: torch.Tensor | None = None):
        if method.capture_error is not None:
            raise method.capture_error
        executor = method.executor
        if method.graph is None:
            device_inputs = [i.to(self.device) if isinstance(i, torch.Tensor) else i for i in inputs]
            executor.check_inputs(device_inputs)  # before the first forward starts any copy
            self._write_live_rows(method, live)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            # Warm-up outside the graph (lazy inits, cuBLAS handles); the second forward's
            # measured tail decides how many fills each replay carries into the next. Inputs
            # are bound for each: a forward may reuse an input's arena slot once it is read.
            for _ in range(2):
                with torch.cuda.stream(side), warming_a_graph():  # the capture's paths, launched once
                    self._run_forward(method, device_inputs)
                torch.cuda.synchronize(self.device)
            method.static_inputs = [executor.values[v] for v in executor.plan.inputs]
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.pool.prepare_capture()
            before = dataclasses.replace(self.pool.stats)
            experts_before = {b: dataclasses.replace(r) for b, r in self.expert_reads.items()}
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self._run_forward(method, captured=True)
            except (RuntimeError, torch.AcceleratorError) as e:
                if "captur" not in str(e).lower():
                    raise
                self.pool.stats = before
                self.expert_reads = experts_before
                # The pool is left mid-forward by the invalidated capture: this method stays
                # refused, and the same error is raised at every later call.
                method.capture_error = ProgramError(
                    f"cuda_graph=True: method '{name}' of {self.pte_path} cannot be captured as a CUDA graph ({type(e).__name__}: {str(e).splitlines()[0]}). "
                    "Most likely a kernel of the program synchronizes with the host (a data-dependent shape or a .tolist(), "
                    "as MoE routing does); load it again with cuda_graph=False"
                )
                raise method.capture_error from e
            method.graph = graph
            method.graph_outputs = executor.outputs()
            # Capturing copies nothing; every replay does what the captured forward counted.
            after, self.pool.stats = self.pool.stats, before
            method.replay_counts = {f: getattr(after, f) - getattr(before, f) for f in _REPLAY_COUNTED}
            # likewise the experts each replay reads (a captured call takes the path without host syncs, whose reads its shapes fix)
            method.replay_expert_reads = {b: ExpertReads(**{f: getattr(r, f) - getattr(experts_before.get(b, ExpertReads()), f) for f in REPLAYED_COUNTS})
                                          for b, r in self.expert_reads.items()}
            self.expert_reads = experts_before
            method.replayed = torch.cuda.Event()
            method.replayed.record()
        for static, given in zip(method.static_inputs, inputs):
            if isinstance(static, torch.Tensor) and static.shape != given.shape:
                raise ProgramError(f"cuda_graph=True needs static input shapes: method '{name}' was captured with {tuple(static.shape)}, got {tuple(given.shape)}")
        # A replay reads the fills the previous one carried, and its inputs overwrite what the
        # previous one read: order it after that one even when the caller launches from
        # another stream.
        torch.cuda.current_stream(self.device).wait_event(method.replayed)
        for static, given in zip(method.static_inputs, inputs):
            if isinstance(static, torch.Tensor):
                static.copy_(given)
        self._write_live_rows(method, live)
        method.graph.replay()
        method.replayed.record()
        for f, n in method.replay_counts.items():
            setattr(self.pool.stats, f, getattr(self.pool.stats, f) + n)
        for block, r in method.replay_expert_reads.items():
            self.expert_reads.setdefault(block, ExpertReads()).add(r, method.live_count)
        return method.graph_outputs

    def graph_method(self, name: str) -> None:
        """Capture method ``name`` as a CUDA graph at its next call, as ``cuda_graph`` naming
        it at load would have: for a caller that learns from the program which methods it
        will run often (a generator's verify method, once a draft is given)."""
        self.ensure_open()
        if name not in self._probed:
            raise ValueError(f"graph_method names '{name}', which is not a method of {self.pte_path} that reads weights ({list(self._probed)})")
        if not self.cuda_graph:
            raise ValueError(f"graph_method('{name}') needs a Module loaded with cuda_graph on a CUDA device (policy='planned', no weights on disk)")
        self._probed[name].graphed = True

    def __call__(self, *inputs):
        outputs = self.run_method(self.method_name, inputs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    @property
    def stats(self) -> dict:
        s = self.pool.collect_stats().as_dict()
        s["activation_arena_bytes"] = sum(m.executor.arena_bytes for m in self._probed.values())
        s["state_bytes"] = self.state_bytes
        s["budget_bytes"] = self.budget_bytes
        reader = self.pool.disk_reader
        s["pinned_host_bytes"] = (self.ptd.pinned_bytes + (reader.staging_bytes if reader is not None else 0)
                                  + (self.expert_host_plan.cache_bytes if self.device.type == "cuda" else 0))
        s["host_budget_bytes"] = self.host_budget.budget_bytes
        s["disk_bytes_per_forward"] = self.tiers.disk_bytes_per_forward
        s["disk_bytes_read"] = self.disk_bytes_read
        s["disk_wait_seconds"] = reader.wait_seconds if reader is not None else 0.0
        s["disk_reads"] = reader.mode if reader is not None else None
        s["host_read_bytes"] = sum(self.schedule.host_read_bytes)  # gathered in place, never copied
        # per MoE block: experts read from the device (resident tables, cache hits) are hits, over the bus misses
        blocks = {b.block: b for b in self.schedule.expert_blocks}
        s["expert_reads"] = {block: expert_read_stats(blocks[block], r, block in self.resident_experts, self.expert_caches.get(block))
                             for block, r in self._settled_expert_reads().items() if block in blocks}
        s["expert_bytes_read"] = sum(r["bytes"] for r in s["expert_reads"].values())  # as expert_bytes_read, from the counts just read
        s["expert_scratch_bytes"] = self.expert_scratch_bytes
        # experts read from the disk: each block's host cache, and the bytes read from the file
        s["expert_host_cache"] = {block: cache.stats() for block, cache in self.host_experts.items()}
        experts_reader = self._host_experts[0]
        s["expert_disk_bytes_read"] = experts_reader.bytes_read if experts_reader is not None else 0
        s["expert_disk_seconds"] = experts_reader.seconds if experts_reader is not None else 0.0
        s["expert_disk_reads"] = experts_reader.mode if experts_reader is not None else None
        s["policy"] = self.policy
        return s

    @property
    def host_experts(self) -> dict:
        """The host cache of each MoE block whose expert tables are read from the disk."""
        return self._host_experts[1]

    @property
    def expert_bytes_read(self) -> int:
        """Bytes of routed experts the kernels have read over the bus since load (each picked
        expert's rows, resident blocks and cache hits aside)."""
        blocks = {b.block: b for b in self.schedule.expert_blocks}  # a block streamed whole reads its copy
        return sum(expert_read_stats(blocks[block], r, block in self.resident_experts, self.expert_caches.get(block))["bytes"]
                   for block, r in self._settled_expert_reads().items() if block in blocks)

    def _settled_expert_reads(self) -> dict[str, ExpertReads]:
        """The experts each block has read, what replayed graphs counted on the device included."""
        for method in self._probed.values():  # a replay launched from another stream is read once it ends
            if method.replayed is not None:
                torch.cuda.current_stream(self.device).wait_event(method.replayed)
        for reads in self.expert_reads.values():
            reads.settle()
        return self.expert_reads

    def _expert_table_bytes(self) -> int:
        return sum(b.table_bytes for b in self.schedule.expert_blocks)

    @property
    def disk_bytes_read(self) -> int:
        """Weight bytes read from the disk since load: the disk tier's, and routed experts'."""
        experts = self._host_experts[0].bytes_read if self._host_experts[0] is not None else 0
        return experts + (self.pool.disk_reader.bytes_read if self.pool.disk_reader is not None else 0)

    def method_names(self) -> list[str]:
        return [p.name for p in self.program.execution_plan]

    def __enter__(self) -> "Module":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the device memory (weights, state, activations), undo the host registration and
        unmap the ``.ptd``; idempotent. Outputs already returned stay valid (they are copies)."""
        if self._closed:
            return
        self._closed = True
        # the executors' arenas and the state first: the last views into the mapping go with them
        self._executors = {}
        self._probed = {}
        self.state = {}
        self._host_read = {}
        self._finalizer()


def _check_method_names_argument(option: str, value) -> None:
    """Refuse an option that takes True, False or method names given as anything else (a bare
    string would otherwise be read as its letters)."""
    if not (isinstance(value, bool) or (isinstance(value, (tuple, list)) and all(isinstance(n, str) for n in value))):
        raise ValueError(f"{option} must be True, False or a tuple of method names, got {value!r}")


class _ProbedMethod:
    """A method that reads streamed weights: its executor, the scheduled kernel of each of its
    instructions that reads a weight, and its CUDA graph once captured."""

    def __init__(self, executor: MethodExecutor, kernel_of_instruction: dict[int, int], graphed: bool, compiled: bool = False):
        self.executor = executor
        self.kernel_of_instruction = kernel_of_instruction
        self.hooked = frozenset(kernel_of_instruction)
        self.graphed = graphed
        self.compiled = compiled  # run as one graph compiled by inductor (runtime/compiled_method.py)
        self.on_kernel = None  # set by the Module: tells the pool which kernel was launched
        self.graph = None
        self.capture_error: ProgramError | None = None
        self.static_inputs: list = []
        self.graph_outputs: list = []
        self.replay_counts: dict[str, int] = {}
        self.replay_expert_reads: dict[str, ExpertReads] = {}
        self.replayed = None
        # the rows of a batch its forwards read (Module.run_method's live_rows), on the device,
        # and how many are set: None until a call gives them
        self.live_rows: torch.Tensor | None = None
        self.live_count = 0


def _live_row_flags(name: str, method: _ProbedMethod, live_rows, inputs: list) -> torch.Tensor | None:
    """``live_rows`` as host bools, refused unless one flag per row of the batch: the first
    input's first dimension."""
    if live_rows is None:
        return None
    flags = torch.as_tensor(live_rows)
    rows = inputs[0].shape[0] if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() else None
    if flags.dtype != torch.bool or flags.dim() != 1 or flags.numel() != rows:
        raise ValueError(f"live_rows of method '{name}' must be one bool per row of the batch ({rows} rows: the first input's first dimension), "
                         f"got {tuple(flags.shape)} {flags.dtype}")
    if method.live_rows is not None and method.live_rows.shape != flags.shape:
        raise ValueError(f"live_rows of method '{name}' gives {flags.numel()} rows; its calls take {method.live_rows.numel()}")
    return flags.cpu()


def _one_weight_order(schedules: dict, source: str):
    """The schedule all probed methods share: one pool serves them, so they must read the
    same weights in the same order (a program's prefill and decode do)."""
    names = list(schedules)
    first = schedules[names[0]]
    for name in names[1:]:
        other = schedules[name]
        if not (other.same_order(first) and other.fqns == first.fqns and other.weight_bytes == first.weight_bytes):
            raise ProgramError(
                f"{source}: methods '{names[0]}' and '{name}' read their weights in different orders; "
                "one weight pool serves methods that share one order"
            )
    return first
