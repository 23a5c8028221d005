"""``hostswap::all_reduce`` and ``hostswap::all_gather``: the collectives of a tensor-parallel
program, as operators of the program (hostswap/tensor_parallel.py puts them there).

Each runs through ``torch.distributed`` on the default process group: NCCL on GPUs, gloo on
the CPU. Each carries the world size the program was exported for and refuses another, naming
both. A collective that fails (a peer that died, a timeout of the process group) raises
``CollectiveError`` naming the operator and this rank, never a partial sum used as a result.
"""

from __future__ import annotations

import torch
from torch.library import Library

from hostswap.passes.probe_op import NAMESPACE


class CollectiveError(RuntimeError):
    """A collective of a tensor-parallel program that cannot run, or failed, on this process."""


def _check_group(op: str, world: int) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveError(f"{NAMESPACE}::{op} needs torch.distributed initialized with {world} processes (run under torchrun "
                              f"--nproc-per-node {world}); it is not initialized in this process")
    size = dist.get_world_size()
    if size != world:
        raise CollectiveError(f"{NAMESPACE}::{op}: the program was exported for {world} tensor-parallel ranks; this process group has {size}")


def _run(op: str, collective) -> None:
    import torch.distributed as dist

    try:
        collective()
    except (RuntimeError, dist.DistError) as e:  # DistBackendError, a closed connection, a timeout
        raise CollectiveError(f"{NAMESPACE}::{op} failed on rank {dist.get_rank()} of {dist.get_world_size()} (a peer that stopped or "
                              f"timed out): {type(e).__name__}: {e}") from e


def _all_reduce_out(x: torch.Tensor, world: int, *, out: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    _check_group("all_reduce", world)
    if out.data_ptr() != x.data_ptr():
        out.copy_(x)
    _run("all_reduce", lambda: dist.all_reduce(out))
    return out


def _all_reduce(x: torch.Tensor, world: int) -> torch.Tensor:
    return _all_reduce_out(x, world, out=torch.empty_like(x))


def _gathered_shape(x: torch.Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] *= world
    return shape


def _all_gather_out(x: torch.Tensor, dim: int, world: int, *, out: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    _check_group("all_gather", world)
    pieces = [torch.empty_like(x) for _ in range(world)]
    _run("all_gather", lambda: dist.all_gather(pieces, x.contiguous()))
    torch.cat(pieces, dim=dim, out=out)
    return out


def _all_gather(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    return _all_gather_out(x, dim, world, out=x.new_empty(_gathered_shape(x, dim, world)))


_lib = Library(NAMESPACE, "FRAGMENT")
_lib.define("all_reduce(Tensor x, int world) -> Tensor")
_lib.define("all_reduce.out(Tensor x, int world, *, Tensor(a!) out) -> Tensor(a!)")
_lib.define("all_gather(Tensor x, int dim, int world) -> Tensor")
_lib.define("all_gather.out(Tensor x, int dim, int world, *, Tensor(a!) out) -> Tensor(a!)")
_lib.impl("all_reduce", _all_reduce, "CompositeExplicitAutograd")
_lib.impl("all_reduce.out", _all_reduce_out, "CompositeExplicitAutograd")
_lib.impl("all_gather", _all_gather, "CompositeExplicitAutograd")
_lib.impl("all_gather.out", _all_gather_out, "CompositeExplicitAutograd")
_lib._register_fake("all_reduce", lambda x, world: torch.empty_like(x))
_lib._register_fake("all_reduce.out", lambda x, world, *, out: out)
_lib._register_fake("all_gather", lambda x, dim, world: x.new_empty(_gathered_shape(x, dim, world)))
_lib._register_fake("all_gather.out", lambda x, dim, world, *, out: out)

all_reduce = torch.ops.hostswap.all_reduce.default
all_gather = torch.ops.hostswap.all_gather.default
