"""Route a transformers model's MoE experts through ``hostswap::routed_experts``.

transformers stores a block's experts as stacked tables (``gate_up_proj`` [E, 2I, H] or
``up_proj``, ``down_proj`` [E, H, I], optional biases) in a module that the router calls with
each token's top-k expert ids and weights. ``route_experts(model)`` makes each such module
call the routed-experts kernel (passes/routed_experts.py), so the exported program reads only
the experts the router picks; the weight pass then keeps the tables in host memory and a
kernel reads the picked rows in place.

Each routed block also scores the next routed block's experts a layer early, for the runtime to
prefetch them (runtime/expert_cache.py): the next block's router applied, through the next
block's own input norm, to this block's residual stream (the input of this layer's norm before
the experts, stashed as that norm runs). That is the next block's routing with this layer's
experts and the next attention left out. Where a block's router (the one child of its MoE
block scoring [experts, hidden]) or its input norm (``MOE_INPUT_NORMS`` of its decoder layer)
cannot be found, the block before it makes no guess (``RoutedExperts.unguessed`` says why).

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
import torch.nn.functional as F

from hostswap.kernels.routed_experts import ACTIVATIONS, CLAMPED_SWIGLU, gate
from hostswap.passes.routed_experts import routed_experts


# the norm a transformers decoder layer applies to its residual stream before the MoE block
MOE_INPUT_NORMS = ("post_attention_layernorm",)


class _Stash:
    """Where a layer's input norm leaves its input (the residual stream) for the layer's
    routed block to read: a plain object, whose attribute writes torch.export traces."""

    residual: torch.Tensor | None = None


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
    hidden: int  # the width of the tokens it takes
    alpha: float = 0.0
    limit: float = 0.0


@dataclasses.dataclass
class RoutedExperts:
    """What ``route_experts`` did: the modules it routed, and those it left with the reason."""

    routed: dict[str, ExpertsSpec]
    kept: dict[str, str]
    unguessed: dict[str, str] = dataclasses.field(default_factory=dict)  # routed blocks whose experts no block guesses, and why


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
    return ExpertsSpec(name, experts, activation, gated, interleaved, transposed, hidden, alpha, limit)


def _is_experts_module(module: torch.nn.Module) -> bool:
    # transformers' MoE experts: stacked tables behind the experts implementation switch
    return hasattr(module, "down_proj") and isinstance(getattr(module, "down_proj"), torch.Tensor) and getattr(module, "down_proj").dim() == 3


@dataclasses.dataclass(frozen=True)
class _Guess:
    """How a routed block scores the next routed block's experts: that block's input norm and
    router, applied to the residual stream this block's own input norm saw."""

    norm: torch.nn.Module  # this block's input norm, which stashes its input
    next_norm: torch.nn.Module
    next_router: torch.nn.Module
    next_block: str

    def logits(self, tokens: int) -> torch.Tensor | None:
        stash: _Stash = self.norm._hostswap_stash
        residual, stash.residual = stash.residual, None
        if residual is None or residual.numel() != tokens * residual.shape[-1]:
            return None
        x = type(self.next_norm).forward(self.next_norm, residual.reshape(tokens, -1))  # the class's: no stash
        return F.linear(x, self.next_router.weight, getattr(self.next_router, "bias", None))


def _stashing_forward(self, x: torch.Tensor) -> torch.Tensor:
    self._hostswap_stash.residual = x
    return type(self).forward(self, x)


def _routed_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    spec: ExpertsSpec = self._hostswap_experts
    first = self.gate_up_proj if spec.gated else self.up_proj
    bias = "gate_up_proj_bias" if spec.gated else "up_proj_bias"
    has_bias = bool(getattr(self, "has_bias", False))
    guess: _Guess | None = getattr(self, "_hostswap_guess", None)
    next_logits = guess.logits(hidden_states.shape[0]) if guess is not None else None
    return routed_experts(hidden_states, top_k_index, top_k_weights, first, self.down_proj,
                          getattr(self, bias) if has_bias else None, self.down_proj_bias if has_bias else None,
                          spec.activation, spec.gated, spec.interleaved, spec.transposed, spec.alpha, spec.limit, spec.block,
                          next_logits, guess.next_block if next_logits is not None else "")


def _input_norm(model: torch.nn.Module, block: str) -> torch.nn.Module | None:
    """The norm the decoder layer holding ``block`` applies before its MoE block."""
    parts = block.split(".")
    for end in range(len(parts) - 1, 0, -1):
        owner = model.get_submodule(".".join(parts[:end]))
        for name in MOE_INPUT_NORMS:
            if isinstance(getattr(owner, name, None), torch.nn.Module):
                return getattr(owner, name)
    return None


def _router(model: torch.nn.Module, spec: ExpertsSpec) -> torch.nn.Module | None:
    """The module beside the experts that scores them: the one child of the MoE block with a
    [experts, hidden] weight."""
    owner, _, name = spec.block.rpartition(".")
    parent = model.get_submodule(owner)
    found = [m for n, m in parent.named_children() if n != name
             and isinstance(getattr(m, "weight", None), torch.Tensor) and tuple(m.weight.shape) == (spec.num_experts, spec.hidden)]
    return found[0] if len(found) == 1 else None


def _link_guesses(model: torch.nn.Module, routed: dict[str, ExpertsSpec]) -> dict[str, str]:
    """Give each routed block but the last a guess at the next one's experts; the blocks no
    guess reaches, and why."""
    unguessed = {}
    names = list(routed)
    for block, following in zip(names, names[1:] + [None]):
        module = model.get_submodule(block)
        module._hostswap_guess = None  # not a module: nn.Module keeps it as a plain attribute
        if following is None:
            continue
        norm, next_norm = _input_norm(model, block), _input_norm(model, following)
        next_router = _router(model, routed[following])
        if norm is None or next_norm is None or norm is next_norm:
            unguessed[following] = f"no input norm ({' or '.join(MOE_INPUT_NORMS)}) found for its layer or the one before"
        elif next_router is None:
            unguessed[following] = f"no single module beside it scores its {routed[following].num_experts} experts"
        else:
            if not isinstance(getattr(norm, "_hostswap_stash", None), _Stash):
                norm._hostswap_stash = _Stash()  # a plain object: nn.Module keeps it as no buffer, no state
            norm.forward = types.MethodType(_stashing_forward, norm)
            module._hostswap_guess = _Guess(norm, next_norm, next_router, following)
    return unguessed


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
    return RoutedExperts(routed, kept, _link_guesses(model, routed))
