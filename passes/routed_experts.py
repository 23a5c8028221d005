"""``hostswap::routed_experts``: an MoE block's experts as one operator that reads only the
experts its router picked (the kernel and its two ways through: kernels/routed_experts.py).

Its table arguments (``ROUTED_EXPERTS_TABLES``) are stacked [experts, ...] tables read by
rows, so the weight pass treats them as row gathers: never copied to the device whole.
"""

from __future__ import annotations

import torch
from torch.library import Library

from hostswap.kernels.routed_experts import routed_experts as _kernel
from hostswap.passes.probe_op import NAMESPACE

# the stacked tables (schedules.custom_ops.ROUTED_EXPERTS_TABLES): an expert is one row (dim 0) of each
_ARGS = ("Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, Tensor? gate_up_bias, "
         "Tensor? down_bias, str activation, bool gated, bool interleaved, bool transposed, float alpha, float limit, str block, "
         "Tensor? next_logits=None, str next_block=\"\"")


def _routed_experts_out(*args, out):
    out.copy_(_kernel(*args))
    return out


def _routed_experts_fake(hidden, *args):
    return torch.empty_like(hidden)


def _routed_experts_out_fake(hidden, *args, out):
    return out


_lib = Library(NAMESPACE, "FRAGMENT")
_lib.define(f"routed_experts({_ARGS}) -> Tensor")
_lib.define(f"routed_experts.out({_ARGS}, *, Tensor(a!) out) -> Tensor(a!)")
_lib.impl("routed_experts", _kernel, "CompositeExplicitAutograd")
_lib.impl("routed_experts.out", _routed_experts_out, "CompositeExplicitAutograd")
_lib._register_fake("routed_experts", _routed_experts_fake)
_lib._register_fake("routed_experts.out", _routed_experts_out_fake)

routed_experts = torch.ops.hostswap.routed_experts.default
