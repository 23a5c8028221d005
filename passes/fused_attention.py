"""Keep ``scaled_dot_product_attention`` whole through ExecuTorch lowering as ``hostswap::sdpa``.

ExecuTorch's edge dialect decomposes ``aten.scaled_dot_product_attention`` into its math
reference: a causal mask rebuilt in every layer (arange, comparisons, where), two bmm and a
softmax over a materialized score matrix. hostswap's runtime runs ATen kernels, so it can run
the fused kernel instead (flash or memory-efficient attention on CUDA, as eager PyTorch
does): fewer launches in decode, no score matrix in prefill, and the same kernel as the
plain PyTorch run it is compared with. A custom op is not decomposed; its ``.out`` overload
is what ExecuTorch's out-variant pass needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import Library

from hostswap.passes.probe_op import NAMESPACE
from hostswap.schedules.op_facts import grouped_in_place

_ARGS = "Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False"
SDPA_SCHEMA = f"sdpa({_ARGS}) -> Tensor"
SDPA_OUT_SCHEMA = f"sdpa.out({_ARGS}, *, Tensor(a!) out) -> Tensor(a!)"

_lib = Library(NAMESPACE, "FRAGMENT")
_lib.define(SDPA_SCHEMA)
_lib.define(SDPA_OUT_SCHEMA)


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if enable_gqa and key.shape[-3] != query.shape[-3] and not grouped_in_place(query, key, value, attn_mask, dropout_p, is_causal, scale):
        group = query.shape[-3] // key.shape[-3]
        key, value, enable_gqa = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3), False
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # contiguous: the fake kernel promises a contiguous result (flash returns (b, s, h, d) strides)
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa).contiguous()


def _sdpa_out(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, out):
    out.copy_(_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa))
    return out


def _output_shape(query, value):
    return (*query.shape[:-1], value.shape[-1])


def _sdpa_fake(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query.new_empty(_output_shape(query, value))


def _sdpa_out_fake(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, out):
    return out


_lib.impl("sdpa", _sdpa, "CompositeExplicitAutograd")
_lib.impl("sdpa.out", _sdpa_out, "CompositeExplicitAutograd")
_lib._register_fake("sdpa", _sdpa_fake)
_lib._register_fake("sdpa.out", _sdpa_out_fake)

sdpa = torch.ops.hostswap.sdpa.default
ATEN_SDPA = torch.ops.aten.scaled_dot_product_attention.default


class KeepFusedAttentionPass:
    """Replace deterministic (``dropout_p == 0``) aten SDPA nodes with ``hostswap::sdpa``."""

    def call(self, graph_module: torch.fx.GraphModule) -> int:
        """Rewrites the graph in place; returns the number of nodes replaced."""
        replaced = 0
        for node in list(graph_module.graph.nodes):
            if node.op != "call_function" or node.target is not ATEN_SDPA:
                continue
            dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
            if dropout != 0.0:
                continue  # random: left to the reference decomposition
            node.target = sdpa
            replaced += 1
        if replaced:
            graph_module.recompile()
        return replaced
