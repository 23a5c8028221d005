"""Grouped-query attention reads its KV cache in place: the pass finds transformers'
``repeat_kv`` in front of attention (and nothing else), the op repeats the heads itself off
CUDA (bitwise what the graph computed before), and on CUDA reads them grouped (within a
rounding of the repeated heads' result)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hostswap.passes.fused_attention import KeepFusedAttentionPass, sdpa
from hostswap.passes.grouped_query_attention import GroupedQueryAttentionPass

aten = torch.ops.aten


def _repeat_kv(x, group):
    from transformers.models.llama.modeling_llama import repeat_kv

    return repeat_kv(x, group)


class _Attention(torch.nn.Module):
    """Attention over a grouped cache, its heads repeated by transformers' own ``repeat_kv``."""

    def __init__(self, key_group=2, value_group=2, mask=True, read_repeat=False):
        super().__init__()
        self.key_group, self.value_group, self.mask, self.read_repeat = key_group, value_group, mask, read_repeat

    def forward(self, q, k, v):
        key, value = _repeat_kv(k, self.key_group), _repeat_kv(v, self.value_group)
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2]) if self.mask else None
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=0.3)
        return (out, key.sum()) if self.read_repeat else out


def _inputs(dtype, heads=4, kv_heads=2, length=3, cache=7):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, length, 16, generator=g).to(dtype)
    return q, torch.randn(2, kv_heads, cache, 16, generator=g).to(dtype), torch.randn(2, kv_heads, cache, 16, generator=g).to(dtype)


def _rewritten(module, *args):
    ep = torch.export.export(module, args)
    before = ep.module()(*args)
    KeepFusedAttentionPass().call(ep.graph_module)
    changed = GroupedQueryAttentionPass().call(ep.graph_module)
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and n.target is sdpa]
    return changed, calls, ep, before, ep.module()(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [True, False])
def test_repeated_heads_become_a_grouped_read_with_bitwise_values_off_cuda(dtype, mask):
    changed, calls, ep, before, after = _rewritten(_Attention(mask=mask), *_inputs(dtype))
    assert changed == 1 and len(calls) == 1
    call = calls[0]
    assert [a.target for a in call.args[1:3]] == ["k", "v"] or [a.op for a in call.args[1:3]] == ["placeholder", "placeholder"]
    assert call.kwargs.get("enable_gqa") is True
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert aten.expand.default not in targets  # the repeat is gone
    ep.validate()
    assert torch.equal(before, after)


def test_a_tiny_llamas_decode_and_prefill_read_the_cache_in_place():
    import transformers as T

    from hostswap import llm

    config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    programs, _ = llm.export_programs(T.LlamaForCausalLM(config).eval(), max_seq_len=16, prefill_chunk=4)
    for name, ep in programs.items():
        calls = [n for n in ep.graph.nodes if n.op == "call_function" and n.target is sdpa]
        assert len(calls) == 2, name
        for call in calls:
            assert call.kwargs.get("enable_gqa") is True, name
            assert call.args[1].meta["val"].shape[1] == 2 and call.args[2].meta["val"].shape[1] == 2, name
        assert not any(n.target is aten.expand.default and n.meta["val"].dim() == 5 for n in ep.graph.nodes if n.op == "call_function"), name


@pytest.mark.parametrize("case", ["one head a group", "key and value grouped apart", "only the key repeated"])
def test_what_is_not_a_grouped_cache_is_left_alone(case):
    module, args = {
        "one head a group": (_Attention(1, 1), _inputs(torch.float32, heads=4, kv_heads=4)),
        "key and value grouped apart": (_GroupedApart(), _inputs(torch.float32, heads=4, kv_heads=2)),
        "only the key repeated": (_KeyOnly(), _inputs(torch.float32, heads=4, kv_heads=2)),
    }[case]
    changed, calls, ep, before, after = _rewritten(module, *args)
    assert changed == 0 and not calls[0].kwargs.get("enable_gqa", False)
    assert torch.equal(before, after)


class _GroupedApart(torch.nn.Module):
    """Key heads repeated by transformers' grouping, value heads tiled (another order)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), v.repeat(1, 2, 1, 1))


class _KeyOnly(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), torch.cat([v, v], dim=1))


def test_a_repeat_read_elsewhere_stays_for_that_reader():
    changed, calls, ep, before, after = _rewritten(_Attention(read_repeat=True), *_inputs(torch.float32))
    assert changed == 1 and calls[0].kwargs.get("enable_gqa") is True
    assert sum(n.target is aten.expand.default for n in ep.graph.nodes) == 1  # the key's repeat, which the sum reads
    assert all(torch.equal(a, b) for a, b in zip(before, after))


class _WrittenAfterTheRepeat(torch.nn.Module):
    """The key cache written in place after its heads were repeated (copied) for attention."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.randn(2, 2, 7, 16, generator=torch.Generator().manual_seed(2)))

    def forward(self, q, k, v):
        key, value = _repeat_kv(self.cache, 2), _repeat_kv(v, 2)
        self.cache.add_(1.0)
        return F.scaled_dot_product_attention(q, key, value)


def test_a_cache_written_between_its_repeat_and_attention_is_left_alone():
    args = _inputs(torch.float32)
    ep = torch.export.export(_WrittenAfterTheRepeat(), args)
    assert any(n.target is aten.add_.Tensor for n in ep.graph.nodes)  # the write stays in place in the graph
    KeepFusedAttentionPass().call(ep.graph_module)
    assert GroupedQueryAttentionPass().call(ep.graph_module) == 0
    module = _WrittenAfterTheRepeat()
    expected = module(*args)
    module.cache.sub_(1.0)
    assert torch.equal(ep.module()(*args), expected)


def test_grouped_heads_are_read_in_place_only_on_cuda_in_16_bits_by_a_fused_kernel():
    from torch.nn.attention import SDPBackend

    from hostswap.schedules.op_facts import grouped_in_place, reads_grouped

    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        assert reads_grouped("cuda", torch.bfloat16, int(backend)) and reads_grouped("cuda", torch.float16, int(backend))
        assert not reads_grouped("cuda", torch.float32, int(backend)) and not reads_grouped("cpu", torch.bfloat16, int(backend))
    # where SDPA would run its math reference, the heads are repeated first
    assert not reads_grouped("cuda", torch.bfloat16, int(SDPBackend.MATH))
    assert not reads_grouped("cuda", torch.bfloat16, -1)
    assert not grouped_in_place(*_inputs(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_repeats_the_heads_itself_off_cuda(dtype):
    q, k, v = _inputs(dtype, heads=8, kv_heads=2, length=1, cache=9)
    mask = torch.rand(1, 1, 1, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    grouped = sdpa(q, k, v, mask, enable_gqa=True)
    assert torch.equal(grouped, F.scaled_dot_product_attention(q, _repeat_kv(k, 4), _repeat_kv(v, 4), attn_mask=mask))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_op_on_the_gpu(dtype):
    """Read grouped in 16-bit (within a rounding of the repeated heads: the fused kernels split
    a long cache by its own heads), repeated in float32 (bitwise)."""
    for length, cache in ((1, 64), (1, 4096), (32, 512)):
        q, k, v = (t.cuda() for t in _inputs(dtype, heads=32, kv_heads=4, length=length, cache=cache))
        mask = (torch.arange(cache, device="cuda")[None, :] <= cache // 2 + torch.arange(length, device="cuda")[:, None])[None, None]
        from hostswap.schedules.op_facts import grouped_in_place

        # on the GPUs the suite runs on (H100, H200) cuDNN takes grouped heads with a mask
        assert grouped_in_place(q, k, v, mask) == (dtype != torch.float32)
        grouped = sdpa(q, k, v, mask, enable_gqa=True)
        repeated = F.scaled_dot_product_attention(q, _repeat_kv(k, 8), _repeat_kv(v, 8), attn_mask=mask)
        if dtype == torch.float32:
            assert torch.equal(grouped, repeated)
        else:
            torch.testing.assert_close(grouped, repeated, atol=2e-3, rtol=2e-2)


def _saved_llama(path, dtype=torch.float32, heads=4, kv_heads=2, max_seq_len=16):
    """A tiny Llama's program (hidden 32, head width 8) of ``max_seq_len`` cache positions."""
    import transformers as T

    import hostswap
    from hostswap import llm

    config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, max_position_embeddings=64)
    torch.manual_seed(0)
    programs, constants = llm.export_programs(T.LlamaForCausalLM(config).to(dtype).eval(), max_seq_len=max_seq_len, prefill_chunk=4)
    return hostswap.save(programs, path / "m", constant_methods=constants)


def _repeat_bytes(heads=4, max_seq_len=16, width=8, itemsize=4):
    # key and value, each repeated to the query's heads, over the whole cache
    return 2 * heads * max_seq_len * width * itemsize


def test_the_load_counts_the_repeated_heads_where_they_are_repeated(tmp_path):
    """On the CPU the op repeats the grouped heads: the load counts one call's repeat beside
    the activations, in what "auto" leaves free and in what it checks."""
    from hostswap.runtime import Module
    from hostswap.runtime.budget import grouped_attention_scratch_on
    from hostswap.schedules.pte_program import read_program

    pte, ptd = _saved_llama(tmp_path)
    assert grouped_attention_scratch_on(read_program(pte), torch.device("cpu")) == _repeat_bytes()
    with Module(pte, ptd, weight_offload_budget_mb="auto", device="cpu") as m:
        assert m.attention_scratch_bytes == _repeat_bytes()
        _, activations = m._arena_sizes()
        assert m.auto_budget.activation_bytes == activations + _repeat_bytes()


def test_no_repeat_is_counted_for_attention_without_grouped_heads(tmp_path):
    from hostswap.runtime.budget import grouped_attention_scratch_on
    from hostswap.schedules.pte_program import read_program

    pte, _ = _saved_llama(tmp_path, kv_heads=4)  # one KV head per query head
    assert grouped_attention_scratch_on(read_program(pte), torch.device("cpu")) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_load_counts_no_repeat_where_the_gpu_reads_grouped_heads(tmp_path, dtype):
    """On the suite's GPUs (H100, H200) bf16 reads grouped heads in place: nothing to count;
    float32 repeats them."""
    from hostswap.runtime.budget import grouped_attention_scratch_on
    from hostswap.schedules.pte_program import read_program

    pte, _ = _saved_llama(tmp_path, dtype=dtype)
    want = 0 if dtype == torch.bfloat16 else _repeat_bytes()
    assert grouped_attention_scratch_on(read_program(pte), torch.device("cuda")) == want
