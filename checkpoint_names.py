"""Which checkpoint tensors make each tensor of a transformers model, by transformers' own
checkpoint conversion mapping.

A checkpoint often stores a model's tensors under other names or in other shapes than the
model class holds them: Mixtral's checkpoints keep ``block_sparse_moe.experts.<e>.w1/w2/w3``
linears per expert, where the model has one stacked ``mlp.experts.gate_up_proj`` table and one
``down_proj``. transformers converts them as it loads (``conversion_mapping``: renamings, and
converters that stack, concatenate or split). ``CheckpointNames`` applies the same mapping to
the checkpoint's names alone, and builds a converted tensor from its sources when asked: one
model tensor in memory at a time, as the streamed export needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch


class ConversionError(ValueError):
    """A model tensor transformers' conversion mapping cannot build from the checkpoint."""


@dataclasses.dataclass
class _Converted:
    converter: object  # transformers' WeightConverter
    sources: dict[str, list[str]]  # source pattern -> checkpoint names, in the order transformers loads them


class CheckpointNames:
    """Model tensor name -> the checkpoint tensors it comes from."""

    def __init__(self, model, checkpoint_names: Iterable[str]):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        model_names = dict(model.state_dict(keep_vars=True))
        self.renamed: dict[str, str] = {}  # model name -> the checkpoint name it is stored under
        self.converted: dict[str, _Converted] = {}
        self._config = getattr(model, "config", None)
        for name in sorted(checkpoint_names, key=dot_natural_key):  # transformers' loading order: experts 0, 1, ..., 10
            target, pattern = rename_source_key(name, renamings, converters, getattr(model, "base_model_prefix", None), model_names)
            if pattern is None:
                if target != name:
                    self.renamed.setdefault(target, name)
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            entry = self.converted.setdefault(target, _Converted(converter, {p: [] for p in converter.source_patterns}))
            entry.sources[pattern].append(name)

    def sources(self, name: str) -> list[str]:
        """The checkpoint tensors model tensor ``name`` is made of (its own name if stored as is)."""
        if name in self.converted:
            return [n for names in self.converted[name].sources.values() for n in names]
        return [self.renamed.get(name, name)]

    def is_converted(self, name: str) -> bool:
        return name in self.converted

    def build(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Model tensor ``name`` made from its checkpoint tensors (each from ``read(checkpoint
        name)``) by its converter's operations, as transformers does when it loads."""
        entry = self.converted[name]
        empty = [p for p, names in entry.sources.items() if not names]
        if empty:
            raise ConversionError(f"tensor '{name}' of the model is built from checkpoint tensors matching '{empty[0]}', and the checkpoint has none")
        collected: dict = {pattern: [read(n) for n in names] for pattern, names in entry.sources.items()}
        converter = entry.converter
        for op in converter.operations:
            collected = op.convert(collected, source_patterns=converter.source_patterns, target_patterns=converter.target_patterns,
                                   full_layer_name=name, config=self._config)
        tensors = list(collected.values())
        if len(tensors) != 1:
            match = [t for key, t in collected.items() if name.endswith(key.strip("."))]
            if len(match) != 1:
                raise ConversionError(f"converting the checkpoint tensors of '{name}' gave {list(collected)}, not one tensor")
            tensors = match
        return tensors[0]
