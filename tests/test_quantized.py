"""torchao weight-only quantized models streamed through hostswap: each quantized linear is one
kernel (``hostswap::quantized_linear``) reading the weight's packed data, scales and zero
points, so they are one probe group; they are counted in their own dtypes, and outputs equal
the quantized eager model's (CPU: torchao's int8 path; int4 is CUDA-only in torchao)."""

from __future__ import annotations

import copy

import pytest
import torch

import hostswap
import hostswap.llm as llm
from hostswap.runtime import Module

from real_models import BY_NAME, build

MB = 2**20


def _int8_mlp():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).eval()
    quantize_(model, Int8WeightOnlyConfig())
    return model, torch.randn(4, 256)


def test_int8_program_is_bitwise_the_quantized_model_and_counts_int8_bytes(tmp_path):
    model, x = _int8_mlp()
    expected = model(x)
    assert hostswap.prepare_quantized(model) == 2
    assert torch.equal(model(x), expected)
    ep = hostswap.apply_weight_offload(torch.export.export(model, (x,)))
    pte, ptd = hostswap.save(ep, tmp_path / "q")
    schedule = hostswap.schedules.load_weight_schedule(pte)
    # one unit: the one kernel of each linear reads its data, scale, zero point (and bias)
    assert schedule.kernel_ops == ("hostswap::quantized_linear.default",) * 2
    kernel_of = {schedule.fqns[w]: k for w, k in zip(schedule.probe_weight, schedule.probe_kernel)}
    for layer, k in (("0", 0), ("2", 1)):
        assert {kernel_of[f"{layer}.weight_{n}"] for n in ("qdata", "scale", "zero_point")} == {k}
    by_dtype = schedule.bytes_by_dtype()
    assert by_dtype["int8"] == (512 * 256 + 64 * 512) + (512 + 64)  # the packed weights and the zero points, one byte each
    assert schedule.total_bytes < 0.3 * 4 * (512 * 256 + 64 * 512)
    table = schedule.table()
    assert "int8" in table and "by dtype" in table
    for budget in (schedule.floor_bytes, schedule.total_bytes + MB):
        for policy in ("planned", "lru"):
            with Module(pte, ptd, weight_offload_budget_mb=budget / MB, device="cpu", policy=policy, verify=True) as m:
                assert torch.equal(m(x), expected), (budget, policy)


def test_a_quantized_weight_left_wrapped_is_refused_with_the_fix():
    model, x = _int8_mlp()
    with pytest.raises(hostswap.WeightOffloadError, match=r"weight '0.weight' is a Int8Tensor.*hostswap.prepare_quantized\(model\) before torch.export"):
        hostswap.apply_weight_offload(torch.export.export(model, (x,)))


def test_a_layout_naming_a_class_outside_torchao_is_refused():
    from hostswap.passes.quantized_linear import rebuild

    with pytest.raises(hostswap.QuantizedLayoutError, match="class os:system is not torchao's; refused"):
        rebuild([torch.zeros(1)], '{"class": "os:system", "names": ["x"], "attributes": {}, "size": [1], "stride": [1]}')


@pytest.mark.parametrize("name", ["Llama", "Qwen2"])
def test_int8_generation_gives_the_quantized_models_tokens(name, tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    build(BY_NAME[name])[0].save_pretrained(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    llm.quantize(model, "int8")
    reference = copy.deepcopy(model)
    pte, ptd = llm.export(model, tmp_path / "q", max_seq_len=24, prefill_chunk=4)
    schedule = hostswap.schedules.load_weight_schedule(pte, "decode")
    assert schedule.bytes_by_dtype().get("int8", 0) > 0
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    reference.generation_config = GenerationConfig(cache_implementation="static", cache_config={"batch_size": 1, "max_cache_len": 24},
                                                   do_sample=False, max_new_tokens=12, min_new_tokens=12, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        expected = reference.generate(prompt)
    floor = max(s.floor_bytes for s in hostswap.schedules.load_weight_schedules(pte).values())
    with llm.Generator(pte, ptd, weight_offload_budget_mb=floor / MB, device="cpu") as g:
        out = g.generate(prompt, 12)
        assert g.stats["bytes_streamed_per_token"] > 0
    assert torch.equal(out, expected), (out[0, 6:].tolist(), expected[0, 6:].tolist())


def test_quantize_argument_errors():
    model = build(BY_NAME["Llama"])[0]
    with pytest.raises(llm.GenerationError, match=r"quantization must be one of \['int4', 'int8'\], got 'int3'"):
        llm.quantize(model, "int3")
    if not torch.cuda.is_available():
        with pytest.raises(llm.GenerationError, match="torchao cannot quantize this model to int4 here"):
            llm.quantize(model, "int4")
