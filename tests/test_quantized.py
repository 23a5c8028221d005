"""torchao weight-only quantized models streamed through hostswap: each quantized linear is one
kernel (``hostswap::quantized_linear``) reading the weight's packed data, scales and zero
points, so they are one probe group; they are counted in their own dtypes, and outputs equal
the quantized eager model's (CPU: torchao's int8 path). int4 (torchao's tile_packed_to_4d
layout, PyTorch's tinygemm kernel) packs and runs on CUDA only: here its tensors are built with
the shapes torchao's packing gives (traced on the meta device) and random contents, and checked
through layout, rebuild, export and the schedule's bytes; tests/test_gpu.py runs it."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import hostswap
import hostswap.llm as llm
from hostswap.runtime import Module

from quantized_schedules import bf16_equivalent, own_bytes, quantized_linears
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


def _int4(weight: torch.Tensor) -> torch.Tensor:
    """An Int4TilePackedTo4dTensor of ``weight``'s shape, random contents, with the inner shapes
    torchao's packing gives (output features padded to 8, input features to 1024: int32 words
    of 32 x 4 tiles, a bf16 scale and zero point per group of 128), as its from_hp on the meta
    device reports them for these shapes."""
    from torchao.quantization import Int4TilePackedTo4dTensor

    n, k = weight.shape
    n_pad, k_pad = -(-n // 8) * 8, -(-k // 1024) * 1024
    g = torch.Generator().manual_seed(n * 7 + k)
    qdata = torch.randint(-(2**31), 2**31 - 1, (n_pad // 8, k_pad // 128, 32, 4), dtype=torch.int32, generator=g)
    scale_and_zero = torch.rand((k_pad // 128, n_pad, 2), generator=g).to(torch.bfloat16)
    return Int4TilePackedTo4dTensor(qdata, scale_and_zero, [1, 128], weight.shape)


def _int4_bytes(out_features: int, in_features: int) -> dict[str, int]:
    """Packed int4 (int32 words, input features padded to 1024) and the bf16 scale and zero
    point per group of 128."""
    padded = -(-in_features // 1024) * 1024
    return {"int32": out_features * padded // 2, "bfloat16": out_features * padded // 128 * 2 * 2}


def test_int4_tinygemm_layout_rebuilds_and_exports_as_one_kernel_per_linear(tmp_path):
    from torchao.quantization import Int4TilePackedTo4dTensor

    from hostswap.passes.quantized_linear import QuantizedLinear, rebuild

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64, bias=False)).to(torch.bfloat16).eval()
    for layer in (model[0], model[2]):
        layer.weight = torch.nn.Parameter(_int4(layer.weight), requires_grad=False)
    w = model[0].weight
    assert w.qdata.shape == (256 // 8, 1024 // (8 * 16), 32, 4) and w.qdata.dtype == torch.int32
    assert w.scale_and_zero.shape == (1024 // 128, 256, 2) and w.scale_and_zero.dtype == torch.bfloat16
    assert hostswap.prepare_quantized(model) == 2
    first = model[0]
    assert isinstance(first, QuantizedLinear) and first.inner_names == ["weight_qdata", "weight_scale_and_zero"]
    layout = json.loads(first.layout)
    assert layout["class"] == "torchao.quantization:Int4TilePackedTo4dTensor"  # the name torchao gives the class
    assert layout["attributes"] == {"block_size": [1, 128], "shape": [256, 1024]} and layout["size"] == [256, 1024]
    back = rebuild([first.weight_qdata, first.weight_scale_and_zero], first.layout)
    assert type(back) is Int4TilePackedTo4dTensor and back.shape == w.shape and back.block_size == [1, 128] and back.act_pre_scale is None
    assert back.qdata is first.weight_qdata and back.scale_and_zero is first.weight_scale_and_zero

    x = torch.randn(4, 1024, dtype=torch.bfloat16)
    ep = hostswap.apply_weight_offload(torch.export.export(model, (x,)))  # traced with the op's fake kernel
    pte, _ = hostswap.save(ep, tmp_path / "q4")
    schedule = hostswap.schedules.load_weight_schedule(pte)
    assert schedule.kernel_ops == ("hostswap::quantized_linear.default",) * 2
    kernel_of = {schedule.fqns[w]: k for w, k in zip(schedule.probe_weight, schedule.probe_kernel)}
    assert {kernel_of[n] for n in ("0.weight_qdata", "0.weight_scale_and_zero", "0.bias")} == {0}
    assert {kernel_of[n] for n in ("2.weight_qdata", "2.weight_scale_and_zero")} == {1}
    first_bytes, second_bytes = _int4_bytes(256, 1024), _int4_bytes(64, 256)
    assert schedule.bytes_by_dtype() == {"int32": first_bytes["int32"] + second_bytes["int32"],
                                         "bfloat16": first_bytes["bfloat16"] + second_bytes["bfloat16"] + 256 * 2}
    assert sum(first_bytes.values()) < 0.3 * 256 * 1024 * 2  # a quarter of bf16, and the scales


def test_int4_llama_exports_and_counts_the_int4_bytes(tmp_path):
    """A transformers Llama whose linears (lm_head too) hold int4 tinygemm weights: both methods
    export, every weight of a schedule is a parameter or buffer of the prepared model at its own
    bytes (the int4 data and scales, not bf16), and floor and total are those bytes' (against
    the same order counted in bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(_int4(module.weight), requires_grad=False)
    pte, _ = llm.export(model, tmp_path / "q4", max_seq_len=32, prefill_chunk=8)
    linears = quantized_linears(model)
    assert len(linears) == 2 * 7 + 1 and "lm_head" in linears
    own = own_bytes(model, "model.")
    for method, schedule in hostswap.schedules.load_weight_schedules(pte).items():
        assert "hostswap::quantized_linear.default" in schedule.kernel_ops, method
        sizes = dict(zip(schedule.fqns, schedule.weight_bytes))
        assert sizes == {fqn: own[fqn] for fqn in sizes}, method
        int4 = {name: sum(_int4_bytes(m.out_features, m.in_features).values()) for name, m in linears.items()}
        assert sum(n for fqn, n in sizes.items() if ".weight_" in fqn) == sum(int4.values())
        assert schedule.bytes_by_dtype()["int32"] == sum(n for fqn, n in sizes.items() if fqn.endswith(".weight_qdata"))
        bf16 = bf16_equivalent(schedule, model, "model.")
        assert schedule.total_bytes < 0.3 * bf16.total_bytes and schedule.floor_bytes < 0.3 * bf16.floor_bytes, (method, schedule.total_bytes, bf16.total_bytes, schedule.floor_bytes, bf16.floor_bytes)


def test_a_quantized_layout_hostswap_cannot_store_is_refused_naming_the_layer_and_the_fix():
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).eval()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(hostswap.QuantizedLayoutError,
                       match=r"linear '0' \(torchao Int8Tensor\): attribute 'act_quant_kwargs' is of type QuantizeTensorToInt8Kwargs, which a program "
                             r"cannot store; quantize it with torchao weight-only Int8WeightOnlyConfig\(\) or Int4WeightOnlyConfig\(group_size=128, "
                             r"int4_packing_format='tile_packed_to_4d'\), as hostswap.llm.quantize\(model, 'int8' or 'int4'\) applies them, or "
                             r"leave the layer unquantized"):
        hostswap.prepare_quantized(model)


def test_a_torchao_subclass_defined_outside_torchao_is_refused_at_prepare():
    from torchao.quantization import Int8Tensor

    class Outside(Int8Tensor):
        pass

    model, _ = _int8_mlp()
    model[2].weight.__class__ = Outside
    with pytest.raises(hostswap.QuantizedLayoutError, match=r"linear '2' \(torchao Outside\) cannot be rebuilt from the layout a program stores "
                                                         r"\(QuantizedLayoutError: quantized_linear: class test_quantized:.*Outside is not torchao's; refused\); quantize it with"):
        hostswap.prepare_quantized(model)


def test_int4_quantization_takes_bf16_weights():
    """Refused for the model's dtype before anything about the machine is asked."""
    model = build(BY_NAME["Llama"])[0]  # float32, hidden 64: only the down projections (128 inputs) take groups of 128
    with pytest.raises(llm.GenerationError, match=r"int4 takes bfloat16 weights, and 2 linear layers are not \(model.layers.0.mlp.down_proj "
                                                  r"\(torch.float32\), model.layers.1.mlp.down_proj \(torch.float32\)\); convert the model first "
                                                  r"\(model.to\(torch.bfloat16\), or hostswap export-llm --dtype bfloat16\)"):
        llm.quantize(model, "int4")


def test_int4_quantization_hands_each_linear_to_torchao_on_the_device_and_puts_it_back():
    """int4 quantizes each linear whose inputs are whole groups of 128, one at a time, with the
    tinygemm layout, on the device given (llm.quantize gives the GPU), and leaves it where it
    was. (A stand-in for torchao's quantize_ records the calls: it packs int4 on CUDA only.)"""
    calls = []

    def quantize_on_the_device(module, config, filter_fn=None, device=None):
        calls.append((module, config, device))
        module.weight = torch.nn.Parameter(_int4(module.weight), requires_grad=False)

    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 100), torch.nn.ReLU(), torch.nn.Linear(100, 8))
    model = model.to(torch.bfloat16)
    linears, config = llm.int4_plan(model)
    assert [m for _, m in linears] == [model[0], model[2]]  # model[4] has 100 inputs: not whole groups, left as it is
    assert (config.int4_packing_format, config.group_size, config.version) == ("tile_packed_to_4d", 128, 2)
    device = torch.device("cpu")
    llm.quantize_each(linears, config, device, quantize_on_the_device)
    assert [(m, c, d) for m, c, d in calls] == [(model[0], config, device), (model[2], config, device)]
    assert all(m.weight.device.type == "cpu" for m in model if isinstance(m, torch.nn.Linear))
    assert type(model[4].weight) is torch.nn.Parameter and model[4].weight.dtype == torch.bfloat16

    def fails(module, config, filter_fn=None, device=None):
        raise RuntimeError("no kernel")

    with pytest.raises(llm.GenerationError, match=r"torchao cannot quantize this model: 0: RuntimeError: no kernel"):
        llm.quantize_each([("0", torch.nn.Linear(128, 8))], config, device, fails)


def test_quantize_argument_errors():
    model = build(BY_NAME["Llama"])[0]
    with pytest.raises(llm.GenerationError, match=r"quantization must be one of \['int4', 'int8'\], got 'int3'"):
        llm.quantize(model, "int3")
    if not torch.cuda.is_available():
        with pytest.raises(llm.GenerationError, match="torchao cannot quantize this model to int4 here"):
            llm.quantize(model, "int4")


def test_int8_decode_kernel_takes_only_weight_only_per_row_layouts_and_few_cuda_rows():
    """The int8 decode kernel (kernels/int8_weight_only.py) computes torchao's per-row weight-only
    linear; per-group scales, quantized activations, the CPU and prefill rows stay on torchao's
    own path (on the CPU: bitwise the quantized model, above)."""
    from torchao.quantization import Int8WeightOnlyConfig, PerGroup, quantize_

    from hostswap.kernels import int8_weight_only
    from hostswap.passes.quantized_linear import _is_int8_weight_only_per_row, describe

    def layout(config):
        linear = torch.nn.Linear(256, 64)
        quantize_(linear, config)
        return describe(linear.weight, "linear")[2], linear.weight

    per_row, weight = layout(Int8WeightOnlyConfig())
    assert _is_int8_weight_only_per_row(per_row)
    assert not _is_int8_weight_only_per_row(layout(Int8WeightOnlyConfig(granularity=PerGroup(128)))[0])
    spec = json.loads(per_row)  # quantized activations (which a program cannot store today) would not be weight-only
    spec["attributes"]["act_quant_kwargs"] = {"symmetric": True}
    assert not _is_int8_weight_only_per_row(json.dumps(spec))
    # the CPU never takes the kernel
    assert not int8_weight_only.applies(torch.randn(1, 256), weight.qdata, weight.scale, None)
    # on a (meta stand-in for a) CUDA device: up to MAX_ROWS rows, row-major int8, one scale per row
    meta = lambda t: t.to("meta")  # noqa: E731
    q, s = meta(weight.qdata), meta(weight.scale)
    cuda = pytest.MonkeyPatch.context()
    with cuda as mp:
        mp.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        mp.setattr(int8_weight_only, "triton_available", lambda: False)  # a CUDA build without Triton: torchao's path
        assert not int8_weight_only.applies(torch.empty(1, 256, device="meta"), q, s, None)
        mp.setattr(int8_weight_only, "triton_available", lambda: True)
        assert int8_weight_only.applies(torch.empty(1, 1, 256, device="meta"), q, s, None)
        assert int8_weight_only.applies(torch.empty(int8_weight_only.MAX_ROWS, 256, device="meta"), q, s, torch.empty(64, device="meta"))
        assert not int8_weight_only.applies(torch.empty(int8_weight_only.MAX_ROWS + 1, 256, device="meta"), q, s, None)
        assert not int8_weight_only.applies(torch.empty(1, 256, device="meta"), q.t().contiguous().t(), s, None)
        assert not int8_weight_only.applies(torch.empty(1, 256, device="meta"), q, s[:32], None)
        assert not int8_weight_only.applies(torch.empty(1, 256, device="meta", dtype=torch.int32), q, s, None)


@pytest.mark.parametrize("n, k", [(64, 256), (2048, 2048), (32000, 2048), (100, 300)])
def test_int8_decode_kernel_blocks_cover_the_weight(n, k):
    from hostswap.kernels.int8_weight_only import block_config

    block_n, block_k, warps = block_config(n, k)
    assert block_n & (block_n - 1) == 0 and block_k & (block_k - 1) == 0 and warps in (4, 8)
    assert 128 <= block_k <= 1024 and (block_k >= k or block_k == 1024 or (n > 8192 and block_k == 512))
