"""What the schedule of a quantized program should count, read from the prepared model
(shared by tests/test_quantized.py and tests/test_gpu.py)."""

from __future__ import annotations

import dataclasses

from hostswap.passes.quantized_linear import QuantizedLinear


def own_bytes(model, prefix: str = "") -> dict[str, int]:
    """Bytes of each parameter and buffer of a prepared model, under the names its program
    gives them (``prefix``: ``"model."`` for ``hostswap.llm.export``'s wrapper)."""
    return {prefix + n: t.numel() * t.element_size() for n, t in (*model.named_parameters(), *model.named_buffers())}


def quantized_linears(model) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def bf16_equivalent(schedule, model, prefix: str = ""):
    """``schedule`` with each quantized linear counted as its weight in bf16 (on its packed
    data; its scales at none): the same access order, so the floor and total the unquantized
    model would have."""
    index = {fqn: i for i, fqn in enumerate(schedule.fqns)}
    sizes = list(schedule.weight_bytes)
    for name, linear in quantized_linears(model).items():
        for inner in linear.inner_names:
            sizes[index[f"{prefix}{name}.{inner}"]] = 0
        sizes[index[f"{prefix}{name}.{linear.inner_names[0]}"]] = linear.out_features * linear.in_features * 2
    return dataclasses.replace(schedule, weight_bytes=tuple(sizes))
