"""The ``hostswap::probe`` custom op that every weight use is read through.

Eager and fake kernels make it an identity (a clone in eager: a custom op may not return an
alias of its input). The ``.out`` overload is what ExecuTorch's out-variant pass looks for;
without it lowering fails with "Missing out variants". The runtime never runs these kernels
for a probe instruction: it binds the probe's output to the pool's device tensor.
"""

import torch
from torch.library import Library

NAMESPACE = "hostswap"
PROBE_SCHEMA = "probe(Tensor weight, int probe_id) -> Tensor"
PROBE_OUT_SCHEMA = "probe.out(Tensor weight, int probe_id, *, Tensor(a!) out) -> Tensor(a!)"

_lib = Library(NAMESPACE, "FRAGMENT")
_lib.define(PROBE_SCHEMA)
_lib.define(PROBE_OUT_SCHEMA)


def _probe(weight: torch.Tensor, probe_id: int) -> torch.Tensor:
    return weight.clone()


def _probe_out(weight: torch.Tensor, probe_id: int, *, out: torch.Tensor) -> torch.Tensor:
    out.copy_(weight)
    return out


def _probe_fake(weight: torch.Tensor, probe_id: int) -> torch.Tensor:
    return torch.empty_like(weight)


def _probe_out_fake(weight: torch.Tensor, probe_id: int, *, out: torch.Tensor) -> torch.Tensor:
    return out


_lib.impl("probe", _probe, "CompositeExplicitAutograd")
_lib.impl("probe.out", _probe_out, "CompositeExplicitAutograd")
_lib._register_fake("probe", _probe_fake)
_lib._register_fake("probe.out", _probe_out_fake)

probe = torch.ops.hostswap.probe.default
probe_out = torch.ops.hostswap.probe.out
