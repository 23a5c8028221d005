"""Route a transformers model's MoE experts through ``hostswap::routed_experts``.

transformers stores a block's experts as stacked tables (``gate_up_proj`` [E, 2I, H] or
``up_proj``, ``down_proj`` [E, H, I], optional biases) in a module that the router calls with
each token's top-k expert ids and weights. ``route_experts(model)`` makes each such module
call the routed-experts kernel (passes/routed_experts.py), so the exported program reads only
the experts the router picks; the weight pass then keeps the tables in host memory and a
kernel reads the picked rows in place.

A module is routed only when the kernel computes what it computes: its tables have the
shapes above, and its activation (or gate) gives bit for bit the results of one of the
kernel's, on a probe of values. Any other is left as it is, with ``UnroutedExpertsWarning``
naming it and why: its experts stay whole tables, streamed as every weight is.
"""

from __future__ import annotations

import dataclasses
import types
import warnings

import torch

from hostswap.kernels.routed_experts import ACTIVATIONS, CLAMPED_SWIGLU, gate
from hostswap.passes.routed_experts import routed_experts


class UnroutedExpertsWarning(UserWarning):
    """An MoE experts module the routed-experts kernel cannot stand in for."""


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """What the kernel needs to know about one experts module besides its tables."""

    block: str  # the module's name in the model
    num_experts: int
    activation: str
    gated: bool
    interleaved: bool
    transposed: bool
    alpha: float = 0.0
    limit: float = 0.0


@dataclasses.dataclass
class RoutedExperts:
    """What ``route_experts`` did: the modules it routed, and those it left with the reason."""

    routed: dict[str, ExpertsSpec]
    kept: dict[str, str]


def _probe(dtype: torch.dtype) -> torch.Tensor:
    # both signs, small and large, and enough columns to split into gate and up halves
    return torch.linspace(-9.0, 9.0, 2 * 512, dtype=torch.float32).reshape(2, 512).to(dtype)


def _activation_of(module, gated: bool, dtype: torch.dtype) -> tuple[str, bool, float, float] | None:
    """(activation, interleaved, alpha, limit) of the kernel's gates that reproduces the
    module's own, bit for bit on a probe; None if none does."""
    x = _probe(dtype)
    with torch.no_grad():
        try:
            expected = module._apply_gate(x) if gated else module.act_fn(x)
        except Exception:  # noqa: BLE001 - a gate the probe cannot run is one the kernel cannot match
            return None
    candidates = [(name, interleaved, 0.0, 0.0) for name in ACTIVATIONS for interleaved in ((False, True) if gated else (False,))]
    if gated and isinstance(getattr(module, "alpha", None), (int, float)) and isinstance(getattr(module, "limit", None), (int, float)):
        candidates += [(CLAMPED_SWIGLU, interleaved, float(module.alpha), float(module.limit)) for interleaved in (False, True)]
    for activation, interleaved, alpha, limit in candidates:
        got = gate(x, activation, gated, interleaved, alpha, limit)
        if got.shape == expected.shape and torch.equal(got, expected):
            return activation, interleaved, alpha, limit
    return None


def describe_experts(name: str, module: torch.nn.Module) -> ExpertsSpec | str:
    """The spec of an experts module the kernel can run, or why it cannot."""
    gated = isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
    first = module.gate_up_proj if gated else getattr(module, "up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(first, torch.Tensor) or not isinstance(down, torch.Tensor) or first.dim() != 3 or down.dim() != 3:
        return "its expert weights are not stacked [experts, ...] tables (gate_up_proj or up_proj, and down_proj)"
    experts = first.shape[0]
    if down.shape[0] != experts:
        return f"its tables disagree on the number of experts ({first.shape[0]} and {down.shape[0]})"
    transposed = bool(getattr(module, "is_transposed", False))
    hidden = first.shape[1] if transposed else first.shape[2]
    inner = first.shape[2] if transposed else first.shape[1]
    down_in, down_out = (down.shape[1], down.shape[2]) if transposed else (down.shape[2], down.shape[1])
    if down_out != hidden or down_in * (2 if gated else 1) != inner:
        return f"its tables' shapes {list(first.shape)} and {list(down.shape)} are not a {'gated ' if gated else ''}MLP per expert"
    for bias_name, width in (("gate_up_proj_bias" if gated else "up_proj_bias", inner), ("down_proj_bias", hidden)):
        bias = getattr(module, bias_name, None)
        if bool(getattr(module, "has_bias", False)) and not (isinstance(bias, torch.Tensor) and tuple(bias.shape) == (experts, width)):
            return f"its {bias_name} is not a [{experts}, {width}] table"
    dtype = first.dtype if first.dtype.is_floating_point else torch.float32
    found = _activation_of(module, gated, dtype)
    if found is None:
        return f"its {'gate' if gated else 'activation'} matches none of the kernel's ({', '.join([*ACTIVATIONS, CLAMPED_SWIGLU])}) on a probe"
    activation, interleaved, alpha, limit = found
    return ExpertsSpec(name, experts, activation, gated, interleaved, transposed, alpha, limit)


def _is_experts_module(module: torch.nn.Module) -> bool:
    # transformers' MoE experts: stacked tables behind the experts implementation switch
    return hasattr(module, "down_proj") and isinstance(getattr(module, "down_proj"), torch.Tensor) and getattr(module, "down_proj").dim() == 3


def _routed_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    spec: ExpertsSpec = self._hostswap_experts
    first = self.gate_up_proj if spec.gated else self.up_proj
    bias = "gate_up_proj_bias" if spec.gated else "up_proj_bias"
    has_bias = bool(getattr(self, "has_bias", False))
    return routed_experts(hidden_states, top_k_index, top_k_weights, first, self.down_proj,
                          getattr(self, bias) if has_bias else None, self.down_proj_bias if has_bias else None,
                          spec.activation, spec.gated, spec.interleaved, spec.transposed, spec.alpha, spec.limit, spec.block)


def route_experts(model: torch.nn.Module, *, warn: bool = True) -> RoutedExperts:
    """Make every MoE experts module of ``model`` that the routed-experts kernel can run call
    it (in place: the module's ``forward`` is replaced); warn for the others, naming each and
    why. Idempotent."""
    routed, kept = {}, {}
    for name, module in model.named_modules():
        if not _is_experts_module(module):
            continue
        spec = describe_experts(name, module)
        if isinstance(spec, str):
            kept[name] = spec
            if warn:
                warnings.warn(f"MoE experts '{name}' ({type(module).__name__}) keep the all-experts schedule: {spec}", UnroutedExpertsWarning, stacklevel=2)
            continue
        module._hostswap_experts = spec
        module.forward = types.MethodType(_routed_forward, module)
        routed[name] = spec
    return RoutedExperts(routed, kept)
