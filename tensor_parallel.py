"""Tensor-parallel streamed generation: one program and one ``.ptd`` per rank, each holding
only its rank's shard of every weight, so each GPU streams 1/N of the bytes over its own link.

``hostswap.llm.export(model, path, tensor_parallel=N)`` writes ``<path>.rank<r>.pte`` and
``<path>.rank<r>.ptd`` for r in 0..N-1. The shard follows the model's own tensor-parallel plan,
transformers' ``_tp_plan`` (the config's ``base_model_tp_plan`` under the base model's prefix):

- ``colwise``: a linear's output features are split (the heads of q/k/v, an MLP's gate and up);
- ``rowwise``: a linear's input features are split and its output summed over the ranks (an
  ``hostswap::all_reduce`` op in the program); its bias is added on rank 0 only;
- ``packed_colwise``: a stacked gate|up table, each half split alike;
- ``rowwise`` on an experts module's down table splits its input features, and
  ``moe_tp_experts`` sums the experts module's output;
- ``colwise_gather_output``: output features split and gathered back whole
  (``hostswap::all_gather``): the head's vocabulary, or Phi-3's and OLMoE's attention, whose
  heads then run whole on every rank;
- ``rowwise_split_input``: ``rowwise`` for a linear that gets its input whole: each rank takes
  its slice of the input first;
- ``replicated_with_grad_allreduce``, ``embedding_rowwise`` and every module the plan does not
  name: whole on each rank. The token table stays whole: it is read a row per token from host
  memory, never streamed, so splitting it would save no link bytes. A
plan style not listed, or a dimension the ranks cannot split evenly, is refused at export,
naming the module. Each rank's program records (rank, world); ``Generator`` refuses to load it
in a process group of another size, or on another rank, naming both numbers.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import re
from collections.abc import Callable

import torch

from hostswap.llm import PREFIX, GenerationError

TENSOR_PARALLEL = PREFIX + "tensor_parallel"  # constant method: [rank, world]

COLWISE, ROWWISE, PACKED_COLWISE = "colwise", "rowwise", "packed_colwise"
MOE_EXPERTS, GATHER_OUTPUT, SPLIT_INPUT = "moe_tp_experts", "colwise_gather_output", "rowwise_split_input"
# whole on every rank: norms, and the token table (read a row per token from host memory, never streamed)
KEPT_WHOLE = ("replicated_with_grad_allreduce", "embedding_rowwise")
SUPPORTED_STYLES = (COLWISE, ROWWISE, PACKED_COLWISE, MOE_EXPERTS, GATHER_OUTPUT, SPLIT_INPUT, *KEPT_WHOLE)
ATTENTION_MODULES = ("attn", "attention")  # a module path holding one of these: its colwise linears split the heads
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")  # config fields a rank sees divided by the world size


class TensorParallelError(GenerationError):
    """A model that cannot be split over the ranks asked, or a program loaded on the wrong ranks."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """How one parameter is split: along ``dim`` into ``world`` pieces, each of ``halves``
    packed halves alike (gate|up); ``dim`` None: whole on rank 0, zeros elsewhere (a bias added
    after the sum over ranks)."""

    name: str
    dim: int | None
    halves: int = 1

    def piece(self, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        if self.dim is None:
            return full.clone() if rank == 0 else torch.zeros_like(full)
        parts = full.chunk(self.halves, dim=self.dim)
        width = parts[0].shape[self.dim] // world
        return torch.cat([p.narrow(self.dim, rank * width, width) for p in parts], dim=self.dim).contiguous()


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """What each rank's model differs in: its parameters' pieces, the modules whose output is
    summed or gathered over the ranks, and the head counts its config gives."""

    world: int
    shards: tuple[Shard, ...]
    reduce_outputs: tuple[str, ...]
    gather_outputs: tuple[str, ...]
    config: dict[str, int]
    split_inputs: tuple[str, ...] = ()  # modules that take their rank's slice of a whole input


def rank_path(path: str | os.PathLike, rank: int) -> str:
    """The path prefix of ``rank``'s program and weights."""
    return f"{os.fspath(path)}.rank{rank}"


def model_plan(model) -> dict[str, str]:
    """transformers' tensor-parallel plan of ``model``: module or parameter pattern -> style."""
    plan = {}
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    plan.update({f"{prefix}.{pattern}" if prefix else pattern: style for pattern, style in base.items()})
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


def _pattern(text: str) -> re.Pattern:
    return re.compile("^" + re.escape(text).replace(r"\*", r"\d+") + "$")


def _split(what: str, size: int, parts: int, world: int) -> None:
    if size % (parts * world):
        raise TensorParallelError(f"{what} has {size} features, which {world} ranks cannot split evenly"
                                  + (f" in each of its {parts} packed halves" if parts > 1 else ""))


def plan_tensor_parallel(model, world: int) -> TensorParallelPlan:
    """The plan of ``model`` split over ``world`` ranks, from its own tensor-parallel plan."""
    from hostswap.passes.quantized_linear import QuantizedLinear

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise TensorParallelError(f"tensor_parallel must be a positive int, got {world!r}")
    plan = model_plan(model)
    if not plan:
        raise TensorParallelError(f"{type(model).__name__} has no tensor-parallel plan (its config's base_model_tp_plan is empty)")
    modules, params = dict(model.named_modules()), dict(model.named_parameters(remove_duplicate=False))
    shards, reduce_outputs, gather_outputs, down_tables, split_inputs = [], [], [], [], []
    splits_heads = False
    for pattern, style in plan.items():
        if style not in SUPPORTED_STYLES:
            raise TensorParallelError(f"{type(model).__name__}'s plan splits '{pattern}' as '{style}', which hostswap does not split "
                                      f"(it splits {', '.join(SUPPORTED_STYLES)})")
        regex = _pattern(pattern)
        for name in [n for n in modules if regex.match(n)] + [n for n in params if regex.match(n)]:
            target = modules.get(name, params.get(name))
            if style in KEPT_WHOLE:
                continue
            if style == MOE_EXPERTS:
                reduce_outputs.append(name)
                continue
            weight_data = getattr(getattr(target, "weight", None), "data", None)
            quantized = (type(weight_data).__name__ if weight_data is not None and type(weight_data) is not torch.Tensor  # torchao's
                         else type(target).__name__ if isinstance(target, QuantizedLinear) else None)  # hostswap's kernel for one
            if quantized is not None:
                raise TensorParallelError(f"'{name}' holds a quantized weight ({quantized}), which hostswap "
                                          "cannot split yet: export the full-precision model with tensor_parallel")
            if isinstance(target, torch.nn.Linear):
                weight, bias = f"{name}.weight", f"{name}.bias" if target.bias is not None else None
                if style in (ROWWISE, SPLIT_INPUT):
                    _split(name, target.in_features, 1, world)
                    shards.append(Shard(weight, 1))
                    shards += [Shard(bias, None)] if bias else []
                    reduce_outputs.append(name)
                    split_inputs += [name] if style == SPLIT_INPUT else []
                else:
                    halves = 2 if style == PACKED_COLWISE else 1
                    _split(name, target.out_features, halves, world)
                    shards += [Shard(weight, 0, halves)] + ([Shard(bias, 0, halves)] if bias else [])
                    if style == GATHER_OUTPUT:
                        gather_outputs.append(name)
                    elif any(part in name.rpartition(".")[0].rpartition(".")[2] for part in ATTENTION_MODULES):
                        splits_heads = True  # this rank runs its share of the heads
                continue
            if isinstance(target, torch.Tensor) and target.dim() == 3 and style in (ROWWISE, PACKED_COLWISE):
                owner, _, table = name.rpartition(".")
                experts = modules[owner]
                transposed = bool(getattr(experts, "is_transposed", False))
                if style == PACKED_COLWISE:  # [E, 2I, H] (or [E, H, 2I] transposed): gate and up halves split alike
                    dim = 2 if transposed else 1
                    halves = 1 if getattr(getattr(experts, "_hostswap_experts", None), "interleaved", False) else 2
                    _split(name, target.shape[dim], halves, world)
                    shards.append(Shard(name, dim, halves))
                    if bool(getattr(experts, "has_bias", False)) and f"{owner}.{table}_bias" in params:
                        shards.append(Shard(f"{owner}.{table}_bias", 1, halves))
                else:  # [E, H, I] (or [E, I, H]): the input features split, the experts' output summed
                    dim = 1 if transposed else 2
                    _split(name, target.shape[dim], 1, world)
                    shards.append(Shard(name, dim))
                    down_tables.append(owner)
                    if bool(getattr(experts, "has_bias", False)) and f"{owner}.{table}_bias" in params:
                        shards.append(Shard(f"{owner}.{table}_bias", None))
                continue
            raise TensorParallelError(f"{type(model).__name__}'s plan splits '{name}' ({type(target).__name__}) as '{style}', which hostswap "
                                      "splits only for linear layers and stacked expert tables")
    for owner in down_tables:
        if owner not in reduce_outputs:
            raise TensorParallelError(f"'{owner}' has its down table split, but the plan does not sum its output ('{MOE_EXPERTS}')")
    if not shards:
        raise TensorParallelError(f"{type(model).__name__}'s tensor-parallel plan matches none of its modules")
    config = {}
    if splits_heads:
        for field in HEAD_COUNTS:
            count = getattr(model.config, field, None)
            if count is None:
                continue
            if count % world:
                raise TensorParallelError(f"config.{field} = {count}: {world} ranks cannot split the attention heads evenly")
            config[field] = count // world
    return TensorParallelPlan(world, tuple(shards), tuple(reduce_outputs), tuple(gather_outputs), config, tuple(split_inputs))


def _reduce_hook(world: int) -> Callable:
    from hostswap.passes.collectives import all_reduce

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (all_reduce(output[0], world), *output[1:])
        return all_reduce(output, world)

    return hook


def _split_input_hook(rank: int, world: int) -> Callable:
    def hook(module, args):
        x = args[0]
        width = x.shape[-1] // world
        return (x.narrow(-1, rank * width, width), *args[1:])

    return hook


def _gather_hook(world: int) -> Callable:
    from hostswap.passes.collectives import all_gather

    def hook(module, args, output):
        return all_gather(output, -1, world)

    return hook


@contextlib.contextmanager
def sharded(model, plan: TensorParallelPlan, rank: int):
    """``model`` as rank ``rank`` of ``plan`` sees it, for the ``with`` block: its split
    parameters swapped for their pieces, sums and gathers hooked on, the config's head counts
    divided. Everything is put back on exit; the full weights are never copied."""
    if not 0 <= rank < plan.world:
        raise TensorParallelError(f"rank {rank} is not one of {plan.world} ranks")
    config = model.config
    saved_config = {field: vars(config)[field] for field in (*plan.config, "head_dim") if field in vars(config)}
    originals, hooks = {}, []
    try:
        if getattr(config, "head_dim", None) is None and plan.config:
            config.head_dim = config.hidden_size // config.num_attention_heads  # computed from the full head count, as the model did
        for shard in plan.shards:
            owner, _, attr = shard.name.rpartition(".")
            module = model.get_submodule(owner)
            full = getattr(module, attr)
            originals[shard.name] = (module, attr, full)
            setattr(module, attr, torch.nn.Parameter(shard.piece(full.detach(), rank, plan.world), requires_grad=False))
        hooks += [model.get_submodule(name).register_forward_hook(_reduce_hook(plan.world)) for name in plan.reduce_outputs]
        hooks += [model.get_submodule(name).register_forward_hook(_gather_hook(plan.world)) for name in plan.gather_outputs]
        hooks += [model.get_submodule(name).register_forward_pre_hook(_split_input_hook(rank, plan.world)) for name in plan.split_inputs]
        for field, value in plan.config.items():
            setattr(config, field, value)
        yield model
    finally:
        for hook in hooks:
            hook.remove()
        for module, attr, full in originals.values():
            setattr(module, attr, full)
        for field in (*plan.config, "head_dim"):
            if field in saved_config:
                setattr(config, field, saved_config[field])
            elif field in vars(config):
                delattr(config, field)


def export_ranks(model, path: str | os.PathLike, *, world: int, progress: Callable[[str], None] | None = None,
                 **options) -> tuple[list[str], list[str]]:
    """``hostswap.llm.export`` with ``tensor_parallel=world``: one program and ``.ptd`` per
    rank (``rank_path``); returns the lists of both."""
    from hostswap.llm import export_programs, prepare_for_export
    from hostswap.passes import save

    if options.get("speculate_k") is not None:
        raise TensorParallelError("tensor_parallel cannot be combined with speculate_k yet")
    prepare_for_export(model)  # experts routed first: their tables are what the plan splits
    plan = plan_tensor_parallel(model, world)
    say = progress or (lambda _msg: None)
    ptes, ptds = [], []
    for rank in range(world):
        say(f"rank {rank} of {world}")
        with sharded(model, plan, rank):
            programs, constants = export_programs(model, progress=progress, **options)
        constants[TENSOR_PARALLEL] = [rank, world]
        pte, ptd = save(programs, rank_path(path, rank), constant_methods=constants, progress=progress)
        ptes.append(pte)
        ptds.append(ptd)
    return ptes, ptds


def program_ranks(module) -> tuple[int, int] | None:
    """(rank, world) of a loaded tensor-parallel program, checked against this process group;
    None for a program of one process."""
    if TENSOR_PARALLEL not in module.method_names():
        return None
    exported = module.run_method(TENSOR_PARALLEL, [])
    check_ranks(exported, module.pte_path)
    return int(exported[0]), int(exported[1])


def check_ranks(exported: list[int], program: str) -> None:
    """Refuse a tensor-parallel program in a process that is not its rank of a group of its size."""
    import torch.distributed as dist

    rank, world = int(exported[0]), int(exported[1])
    if not dist.is_available() or not dist.is_initialized():
        raise TensorParallelError(f"{program} is rank {rank} of a program exported for {world} tensor-parallel ranks: run it under "
                                  f"torchrun --nproc-per-node {world} (torch.distributed is not initialized in this process)")
    if dist.get_world_size() != world:
        raise TensorParallelError(f"{program} was exported for {world} tensor-parallel ranks; this process group has {dist.get_world_size()}")
    if dist.get_rank() != rank:
        raise TensorParallelError(f"{program} is rank {rank}'s program; this process is rank {dist.get_rank()}")


def init_from_environment(device_type: str, timeout_s: float = 300.0) -> tuple[int, int]:
    """(rank, world) of a process started by torchrun, its process group initialized (NCCL for
    CUDA, gloo for the CPU) with a timeout, so a rank that stops makes the others fail instead
    of waiting forever; (0, 1) outside torchrun."""
    import datetime

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    rank = int(os.environ["RANK"])
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        # NCCL's communicator made now (device_id), not at the first collective: decode's CUDA graph captures collectives
        options = {"device_id": torch.device("cuda", torch.cuda.current_device())} if device_type == "cuda" else {}
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s), **options)
        # torn down while the interpreter is whole: gloo's worker threads still holding tensors
        # at interpreter exit abort the process (SIGABRT, "terminate called without an active exception")
        atexit.register(_destroy_process_group)
    return rank, world


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def rank_program(base: str, device: str | None) -> tuple[str, int, torch.device]:
    """(path prefix of this process's program, its rank, its device) for ``hostswap generate``:
    under torchrun, the process group is initialized and each rank takes its own program and
    GPU; otherwise the program at ``base``, which must not be one rank's of several."""
    import glob

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if world == 1:
        ranks = glob.glob(glob.escape(os.fspath(base)) + ".rank*.pte")
        if not os.path.exists(f"{base}.pte") and ranks:
            raise TensorParallelError(f"{base} is a tensor-parallel program of {len(ranks)} ranks: run it with torchrun --nproc-per-node "
                                      f"{len(ranks)} -m hostswap.cli generate {base} ...")
        return os.fspath(base), 0, device
    rank, world = init_from_environment(device.type)
    program = rank_path(base, rank)
    if not os.path.exists(program + ".pte"):
        raise TensorParallelError(f"{program}.pte does not exist: rank {rank} of {world} needs a program exported with --tensor-parallel {world}")
    return program, rank, torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device


# --- serving: rank 0 takes the requests, every rank generates -----------------------------------
class _Halted(Exception):
    """Rank 0 stopped the generation (a stop string, a cancelled request): the others stop at the same token."""


def control_group():
    """A gloo group beside the process group, for requests and stop decisions: on the host, and
    with a timeout long enough for a server that waits idle between requests."""
    import datetime

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))


def _agree_to_stop(stop: bool, group) -> bool:
    """Whether any rank stops after this token; every rank calls it once per token."""
    import torch.distributed as dist

    flag = torch.tensor([1 if stop else 0])
    dist.all_reduce(flag, group=group)
    return bool(flag.item())


class _Lead:
    """Rank 0's generator in a tensor-parallel server: it sends the other ranks what to run
    (``_send``; they read it with ``_commands``) and otherwise reads as the generator it wraps."""

    def __init__(self, generator, group):
        self._generator, self._group = generator, group

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def _send(self, command) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([command], src=0, group=self._group)

    def close(self) -> None:
        try:
            self._send(None)  # the others leave their loop
        except RuntimeError:
            pass  # they are gone already
        self._generator.close()


def _commands(group):
    """What rank 0 sends the other ranks (``_Lead._send``), one at a time, until it sends none."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is None:
            return
        yield box[0]


class LeadGenerator(_Lead):
    """Rank 0's ``Generator`` in a tensor-parallel server: each ``generate`` is first sent to
    the other ranks (``follow``), which run the same call on their programs. Tokens are the same
    on every rank (the logits are gathered), so the ranks stay in step; after each token they
    agree whether rank 0 stops (its ``on_token`` raised), so all stop at the same token. A
    sampled request without a seed gets one here, so every rank draws the same tokens."""

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, on_token=None, sampling=None, **options):
        if options:
            raise TensorParallelError(f"a tensor-parallel server passes only on_token and sampling to generate, not {sorted(options)}")
        sampling = _seeded(sampling)
        self._send((input_ids.tolist(), max_new_tokens, sampling))

        def on_each(token: int) -> None:
            error = None
            try:
                if on_token is not None:
                    on_token(token)
            except BaseException as e:  # noqa: BLE001 - raised again once the others know
                error = e
            if _agree_to_stop(error is not None, self._group) and error is not None:
                raise error

        return self._generator.generate(input_ids, max_new_tokens, on_token=on_each, sampling=sampling)


def _seeded(sampling):
    """``sampling`` with a seed where it samples without one, so that every rank draws alike."""
    import dataclasses
    import random

    if sampling is not None and getattr(sampling, "seed", None) is None and getattr(sampling, "temperature", 0) > 0:
        return dataclasses.replace(sampling, seed=random.randrange(2**31))
    return sampling


def follow(generator, group) -> None:
    """A rank other than 0 in a tensor-parallel server: run each request rank 0 sends, until it
    sends none."""

    def on_token(token: int) -> None:
        if _agree_to_stop(False, group):
            raise _Halted

    for ids, max_new_tokens, sampling in _commands(group):
        try:
            generator.generate(torch.tensor(ids), max_new_tokens, on_token=on_token, sampling=sampling)
        except _Halted:
            pass
        except ValueError:  # a request refused before any collective (GenerationError, SamplingError): rank 0 refuses it too
            pass


class LeadBatchGenerator(_Lead):
    """Rank 0's ``BatchGenerator`` in a tensor-parallel server with continuous batching: every
    call that changes the batch (``begin``, ``prefill_next``, ``step``, ``release``) is first
    sent to the other ranks (``follow_batch``), which make the same call on theirs, so the slots,
    positions and tokens agree on every rank. A sampled sequence without a seed gets one here."""

    def begin(self, prompt: list[int], max_new_tokens: int, *, eos_token_id=None, sampling=None):
        self._generator.check_prompt(prompt, max_new_tokens)  # a refused request stays on rank 0
        sampling = _seeded(sampling)
        self._send(("begin", list(prompt), max_new_tokens, eos_token_id, sampling))
        return self._generator.begin(prompt, max_new_tokens, eos_token_id=eos_token_id, sampling=sampling)

    def prefill_next(self, sequence) -> bool:
        self._send(("prefill_next", sequence.slot))
        return self._generator.prefill_next(sequence)

    def step(self):
        self._send(("step",))
        return self._generator.step()

    def release(self, sequence) -> None:
        self._send(("release", sequence.slot))
        self._generator.release(sequence)


def follow_batch(generator, group) -> None:
    """A rank other than 0 in a tensor-parallel server with continuous batching: make each call
    rank 0 sends on this rank's ``BatchGenerator``, until it sends none."""
    sequences = {}  # slot -> this rank's sequence in it
    for command in _commands(group):
        kind = command[0]
        if kind == "begin":
            _, prompt, max_new_tokens, eos_token_id, sampling = command
            try:
                sequence = generator.begin(prompt, max_new_tokens, eos_token_id=eos_token_id, sampling=sampling)
            except ValueError:  # refused before any collective (GenerationError, SamplingError): rank 0 refuses it too
                continue
            sequences[sequence.slot] = sequence
        elif kind == "prefill_next":
            generator.prefill_next(sequences[command[1]])
        elif kind == "step":
            generator.step()
        elif kind == "release":
            generator.release(sequences.pop(command[1]))
        else:
            raise TensorParallelError(f"rank 0 sent a command this rank does not know: {kind!r}")
