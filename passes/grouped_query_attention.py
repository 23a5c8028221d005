"""Let attention read a grouped-query KV cache as it lies, not with its heads repeated.

transformers' ``repeat_kv`` gives each query head its own copy of its group's key and value
heads (an unsqueeze, an expand and a reshape, which copies) before it calls
``scaled_dot_product_attention``. With a static cache that copy is the whole cache, every
layer, every step: a decode step of a model with 32 query heads and 4 KV heads writes 8x the
cache's bytes to read them once, and the activation arena holds the repeated cache. SDPA's
``enable_gqa=True`` reads the grouped heads in place instead, with the same grouping (query
head ``h`` reads KV head ``h // group``).

The pass finds ``hostswap::sdpa`` calls (passes/fused_attention.py) whose key and value are
both that expression, with the same grouping, and passes the cache itself with
``enable_gqa=True``; the repeat's nodes go where nothing else reads them. Nothing is
rewritten across an in-place write (the repeat copied the cache before it). The op decides
where the grouped read runs (``schedules.op_facts.grouped_in_place``): in place on CUDA for 16-bit
tensors where SDPA picks a fused kernel for grouped heads; elsewhere it repeats the heads
itself, as ``repeat_kv`` did, so those results are bitwise what they were.
"""

from __future__ import annotations

import torch

from hostswap.passes.fused_attention import sdpa
from hostswap.passes.graph_facts import written_between

aten = torch.ops.aten
RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
ENABLE_GQA = 7  # sdpa's argument position (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _val(node):
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def repeated_heads(node: torch.fx.Node) -> tuple[torch.fx.Node, int, list[torch.fx.Node]] | None:
    """``(cache, group, chain)`` where ``node`` is ``repeat_kv(cache, group)``: [b, kv, s, d]
    unsqueezed at 2, expanded to [b, kv, group, s, d] and reshaped to [b, kv x group, s, d]
    (``chain``: those three nodes, last first); else None."""
    if not _is(node, RESHAPES):
        return None
    expand = node.args[0]
    if not _is(expand, (aten.expand.default,)):
        return None
    unsqueeze = expand.args[0]
    if not _is(unsqueeze, (aten.unsqueeze.default,)) or unsqueeze.args[1] not in (2, -3):
        return None
    cache = unsqueeze.args[0]
    values = [_val(n) for n in (cache, unsqueeze, expand, node)]
    if any(v is None for v in values):
        return None
    kv, inserted, expanded, reshaped = values
    if kv.dim() != 4 or inserted.dim() != 5 or expanded.dim() != 5:
        return None
    b, heads, s, d = kv.shape
    group = expanded.shape[2]
    if tuple(expanded.shape) != (b, heads, group, s, d) or tuple(reshaped.shape) != (b, heads * group, s, d):
        return None
    return cache, int(group), [node, expand, unsqueeze]


def match(node: torch.fx.Node) -> dict | None:
    """An ``hostswap::sdpa`` call whose key and value are both repeated KV heads of the same
    grouping (plain data: the caches, the group, the nodes the rewrite may leave unread), or
    None."""
    if not _is(node, (sdpa,)) or len(node.args) < 3:
        return None
    if (node.args[ENABLE_GQA] if len(node.args) > ENABLE_GQA else node.kwargs.get("enable_gqa", False)):
        return None  # already grouped
    key, value = repeated_heads(node.args[1]), repeated_heads(node.args[2])
    query = _val(node.args[0])
    if key is None or value is None or query is None or key[1] != value[1] or key[1] < 2:
        return None
    key_cache, value_cache = _val(key[0]), _val(value[0])
    if query.dim() != 4 or key_cache.shape[:2] != value_cache.shape[:2] or query.shape[1] != key_cache.shape[1] * key[1]:
        return None
    chains = key[2] + value[2]
    if written_between(chains + [node], node):
        return None  # the repeat copied the cache before a write that attention would now see
    return {"key": key[0], "value": value[0], "group": key[1], "chains": chains}


class GroupedQueryAttentionPass:
    """Pass a grouped-query KV cache to ``hostswap::sdpa`` with ``enable_gqa`` instead of repeating its heads."""

    def call(self, graph_module: torch.fx.GraphModule) -> int:
        """Rewrites the graph in place; returns the number of attention calls changed."""
        graph, changed = graph_module.graph, 0
        for node in list(graph.nodes):
            if (m := match(node)) is None:
                continue
            args = list(node.args)
            args[1], args[2] = m["key"], m["value"]
            if len(args) > ENABLE_GQA:
                args[ENABLE_GQA] = True
            else:
                node.kwargs = {**node.kwargs, "enable_gqa": True}
            node.args = tuple(args)
            for dead in m["chains"]:  # last first, each once (a chain may be shared by key and value)
                if not dead._erased and not dead.users:
                    graph.erase_node(dead)
            changed += 1
        if changed:
            graph_module.recompile()
        return changed
