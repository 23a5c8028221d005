"""The KV cache sized from what each layer's attention writes (hostswap/kv_shapes.py), and a
view of a cache write's result lowered as a view of the cache (passes/lowering.py)."""

from __future__ import annotations

import pytest
import torch

import hostswap
from hostswap import kv_shapes, llm
from hostswap.kv_shapes import LayerCacheShape
from real_models import BY_NAME, VOCAB, _decoder_common, build

MB = 2**20


def _deepseek_v3():
    import transformers as T

    torch.manual_seed(0)
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**_decoder_common(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16))).eval()


def _config_shaped(model, max_len: int = 12):
    """transformers' exportable module of ``model``, its cache as the config sizes it."""
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    llm.prepare_for_export(model)
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=max_len,
                                               cache_config={"batch_size": 1, "max_cache_len": max_len})
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_len).model


def test_multi_query_attention_caches_one_head():
    """Falcon's config counts a KV head per query head; its multi-query attention writes one."""
    exportable = _config_shaped(build(BY_NAME["Falcon"])[0])
    assert exportable.static_cache.layers[0].keys.shape[1] == 4  # what the config says
    assert kv_shapes.measure(exportable, torch.device("cpu")) == [LayerCacheShape(1, 16, 1, 16)] * 2
    assert kv_shapes.fit(exportable, torch.device("cpu")) == [0, 1]
    assert kv_shapes.layer_shapes(exportable) == [LayerCacheShape(1, 16, 1, 16)] * 2
    for i, layer in enumerate(exportable.static_cache.layers):
        # the buffers the export reads are the resized tensors
        assert getattr(exportable, f"key_cache_{i}") is layer.keys and getattr(exportable, f"value_cache_{i}") is layer.values
        assert tuple(layer.keys.shape) == (1, 1, 12, 16) and not layer.keys.any()


def test_latent_attention_caches_its_latent_and_rotary_key():
    """DeepSeek-V3 caches its compressed latent (kv_lora_rank wide) and its rotary key
    (qk_rope_head_dim wide), one head each: neither is the config's head_dim."""
    exportable = _config_shaped(_deepseek_v3())
    assert kv_shapes.fit(exportable, torch.device("cpu")) == [0, 1]
    assert kv_shapes.layer_shapes(exportable) == [LayerCacheShape(1, 16, 1, 8)] * 2


def test_a_cache_the_config_sizes_right_is_left_alone():
    exportable = _config_shaped(build(BY_NAME["Llama"])[0])
    before = [(layer.keys, layer.values) for layer in exportable.static_cache.layers]
    assert kv_shapes.fit(exportable, torch.device("cpu")) == []
    assert [(layer.keys, layer.values) for layer in exportable.static_cache.layers] == before


def test_a_trace_that_fails_leaves_the_cache_to_the_export(monkeypatch):
    exportable = _config_shaped(build(BY_NAME["Falcon"])[0])
    before = [layer.keys for layer in exportable.static_cache.layers]

    def fails(*args, **kwargs):
        raise RuntimeError("not traceable here")

    monkeypatch.setattr(exportable, "forward", fails)
    assert kv_shapes.fit(exportable, torch.device("cpu")) == []
    assert [layer.keys for layer in exportable.static_cache.layers] == before
    assert all("update" not in vars(layer) for layer in exportable.static_cache.layers)  # the recording update is gone


def test_a_recorder_never_outlives_the_trace():
    """A layer the recorder cannot be made for stops the trace; no layer keeps a recorder,
    which would write nothing to the cache in the export that follows."""
    exportable = _config_shaped(build(BY_NAME["Falcon"])[0])
    del exportable.static_cache.layers[1].max_cache_len
    with pytest.raises(AttributeError):
        kv_shapes.measure(exportable, torch.device("cpu"))
    assert all("update" not in vars(layer) for layer in exportable.static_cache.layers)


def test_keys_and_values_of_their_own_head_counts():
    exportable = _config_shaped(build(BY_NAME["Falcon"])[0])
    assert kv_shapes.resize(exportable, [LayerCacheShape(1, 16, 2, 8)] * 2) == [0, 1]
    assert kv_shapes.layer_shapes(exportable) == [LayerCacheShape(1, 16, 2, 8)] * 2
    assert tuple(exportable.value_cache_1.shape) == (1, 2, 12, 8)


def test_the_export_leaves_the_models_generation_config(tmp_path):
    from transformers import GenerationConfig

    from hostswap import batching

    model = build(BY_NAME["Falcon"])[0]
    mine = GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=5)
    model.generation_config = mine
    llm.export_programs(model, max_seq_len=16, prefill_chunk=4)
    assert model.generation_config is mine
    batching.export_programs(model, max_seq_len=16, max_batch_size=2, prefill_chunk=4)
    assert model.generation_config is mine


@pytest.mark.parametrize("name", ["Falcon", "DeepSeek-V3"])
def test_tokens_equal_transformers_alone_and_batched(name, tmp_path):
    """Both export and generate as transformers does, one sequence or several in slots."""
    from hostswap import batching
    from test_generation import transformers_greedy

    model = build(BY_NAME["Falcon"])[0] if name == "Falcon" else _deepseek_v3()
    prompts = [torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    expected = [transformers_greedy(model, p, 8, 30) for p in prompts]
    pte, ptd = llm.export(model, tmp_path / "one", max_seq_len=30, prefill_chunk=4)
    with llm.Generator(pte, ptd, weight_offload_budget_mb="auto", device="cpu") as g:
        for p, want in zip(prompts, expected):
            assert torch.equal(g.generate(p, 8, eos_token_id=[]), want)
    pte, ptd = batching.export(model, tmp_path / "slots", max_seq_len=30, max_batch_size=2, prefill_chunk=4)
    with batching.BatchGenerator(pte, ptd, weight_offload_budget_mb="auto", device="cpu") as g:
        got = g.generate([p[0] for p in prompts], 8, eos_token_id=[])
    assert got == [want[0, 7:].tolist() for want in expected]


class ViewsItsCacheWrite(torch.nn.Module):
    """A cache written in place, then read through a view of the write's result (as DeepSeek-V3
    reads its latent through a linear)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 3, bias=False)
        self.register_buffer("cache", torch.zeros(1, 1, 6, 4), persistent=False)

    def forward(self, x, position):
        written = self.cache.index_copy_(2, position, x)
        return self.proj(written.view(6, 4))


def test_a_view_of_an_in_place_write_reads_the_written_tensor(tmp_path):
    model = ViewsItsCacheWrite().eval()
    steps = [(torch.randn(1, 1, 1, 4), torch.tensor([i])) for i in range(3)]
    with torch.no_grad():
        exported = torch.export.export(model, steps[0], strict=False)
        model.cache.zero_()
        expected = [model(*s) for s in steps]
        model.cache.zero_()  # program state starts at zero
    ep = hostswap.apply_weight_offload(exported)
    pte, ptd = hostswap.save(ep, tmp_path / "m")
    schedule = hostswap.schedules.load_weight_schedule(pte)
    with hostswap.runtime.Module(pte, ptd, weight_offload_budget_mb=max(schedule.total_bytes, schedule.floor_bytes) / MB, device="cpu") as m:
        # the activation arena is filled with NaN first: a view planned apart from the cache would read it
        method = m._executors["forward"].method
        for memory_id, arena in method.arenas.items():
            if memory_id not in method.state_ids:
                arena.fill_(255)
        for s, want in zip(steps, expected):
            assert torch.equal(m(*s), want)
