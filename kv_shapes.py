"""What each layer's attention writes to its KV cache: heads and widths, measured from a trace.

transformers' exportable static cache sizes every layer from the config (``num_key_value_heads``
and ``head_dim``). Not every attention writes that: Falcon's multi-query attention writes one
key and value head where its config counts one per query head, and DeepSeek-V3's latent
attention writes its compressed latent and its rotary key, each of its own width. A cache sized
from the config fails at the trace's first cache write (``index_copy_(): Source/destination
tensor must have same slice shapes``). Here the shapes are read from a trace of the model itself
(one token, non-strict, its tensors fake: nothing is computed or allocated), and the layers
whose cache the config sized otherwise are sized again from what their attention writes.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LayerCacheShape:
    """One layer's cache entry per position: heads and width of its keys and of its values."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor) -> "LayerCacheShape":
        """Of tensors laid out as transformers' caches lay them: [batch, heads, positions, width]."""
        return cls(keys.shape[1], keys.shape[-1], values.shape[1], values.shape[-1])


def _cache(exportable):
    """The static cache of transformers' ``TorchExportableModuleWithStaticCache`` (``static_cache``)
    or ``TorchExportableModuleWithHybridCache`` (``cache``)."""
    cache = getattr(exportable, "static_cache", None)
    return cache if cache is not None else exportable.cache


def measure(exportable, device: torch.device) -> list[LayerCacheShape | None]:
    """Per layer of the static cache of ``exportable`` (transformers' exportable module):
    the shape its attention writes, or None for a layer no attention wrote in the trace.

    Each layer's ``update`` is replaced for the trace by one that records what it is given and
    returns a cache of its full length (fake zeros), so that attention and its mask see the
    shapes they see in the real program."""
    seen: dict[int, LayerCacheShape] = {}
    layers = _cache(exportable).layers

    def recording(i: int, positions: int):
        def update(key_states, value_states, *args, **kwargs):
            seen[i] = LayerCacheShape.of(key_states, value_states)
            return (key_states.new_zeros(*key_states.shape[:2], positions, key_states.shape[-1]),
                    value_states.new_zeros(*value_states.shape[:2], positions, value_states.shape[-1]))
        return update

    try:
        for i, layer in enumerate(layers):
            layer.update = recording(i, layer.max_cache_len)
        ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        with torch.no_grad():
            torch.export.export(exportable, args=(), kwargs={"input_ids": ids, "cache_position": torch.arange(1, device=device)}, strict=False)
    finally:
        for layer in layers:
            vars(layer).pop("update", None)  # the class's own again: a recorder left would write nothing
    return [seen.get(i) for i in range(len(layers))]


def fit(exportable, device: torch.device) -> list[int]:
    """Size again each layer of ``exportable``'s static cache whose attention writes another
    shape than the config gave it, and register its new buffers; the layers resized.

    A trace that fails leaves the cache as the config sized it: the export that follows is then
    the judge, and its error names what failed."""
    try:
        shapes = measure(exportable, device)
    except Exception:  # noqa: BLE001 - see the docstring: the export itself reports the failure
        return []
    return resize(exportable, shapes)


def resize(exportable, shapes: list[LayerCacheShape | None]) -> list[int]:
    """Size each layer of ``exportable``'s static cache as ``shapes`` says (None: as it is) and
    register its new buffers; the layers resized."""
    resized = []
    for i, (layer, shape) in enumerate(zip(_cache(exportable).layers, shapes)):
        if shape is None or shape == LayerCacheShape.of(layer.keys, layer.values):
            continue
        # as the layer's own lazy initialization makes them, each of its own heads (that takes
        # the keys' count for both); its update reads no head count
        batch, positions = layer.keys.shape[0], layer.keys.shape[2]
        like = dict(dtype=layer.keys.dtype, device=layer.keys.device)
        layer.keys = torch.zeros(batch, shape.key_heads, positions, shape.key_dim, **like)
        layer.values = torch.zeros(batch, shape.value_heads, positions, shape.value_dim, **like)
        layer.num_heads, layer.k_head_dim, layer.v_head_dim = shape.key_heads, shape.key_dim, shape.value_dim
        exportable.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
        exportable.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
        resized.append(i)
    return resized


def layer_shapes(exportable) -> list[LayerCacheShape]:
    """Per layer of ``exportable``'s static cache (after ``fit``): what it holds per position."""
    return [LayerCacheShape.of(layer.keys, layer.values) for layer in _cache(exportable).layers]
