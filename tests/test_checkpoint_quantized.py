"""Checkpoints published as block-scaled float8 (DeepSeek-V3, Qwen3's FP8 releases), exported
from their shards (checkpoint_quantized.py): the weights transformers' own dequantization of
the same checkpoint gives, bit for bit, and its tokens; every other quantization refused by
name before anything is written."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import hostswap.llm as llm
from hostswap.checkpoint import CheckpointError, SafetensorsCheckpoint, export_checkpoint
from hostswap.runtime.ptd import PtdFile
from hostswap.schedules.serialization import load_weight_schedules

from real_models import BY_NAME, VOCAB, build
from test_experts import MAX_SEQ_LEN, MOE
from test_generation import transformers_greedy

MB = 2**20
CHUNK = 4
# blocks that divide every tiny model's dimensions: transformers' dequantizing load, the reference
# here, infers a block from the weight's shape over its scales' (a partial block is tested apart)
BLOCK = [8, 8]


def _is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    """The linears a float8 release stores as codes: the decoder layers' projections and experts,
    not the router, norms, embeddings or head."""
    return tensor.dim() == 2 and ".layers." in name and name.endswith(("proj.weight", "proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def _float8_checkpoint(model, folder, block=BLOCK, config_update=None) -> str:
    """``model`` saved as a block-scaled float8 release: each quantized linear's weight as e4m3
    codes of its blocks over their largest magnitude / 448, and those scales beside it."""
    model.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    stored, out = load_file(path), {}
    rows, cols = block
    for name, w in stored.items():
        if not _is_quantized_linear(name, w):
            out[name] = w
            continue
        o, i = w.shape
        padded = torch.zeros(-(-o // rows) * rows, -(-i // cols) * cols)
        padded[:o, :i] = w.float()
        blocks = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        out[name] = (blocks / scale[:, None, :, None]).view_as(padded)[:o, :i].to(torch.float8_e4m3fn).contiguous()
        out[name + "_scale_inv"] = scale
    save_file(out, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    config.update(config_update or {})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


def _dequantized_by_transformers(folder):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32,
                                                device_map="cpu").eval()


MODELS = {"Llama": lambda: build(BY_NAME["Llama"])[0], "Qwen3-MoE": MOE["Qwen3-MoE"], "DeepSeek-V3": MOE["DeepSeek-V3"]}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_float8_release_exports_as_transformers_dequantizes_it(name, tmp_path):
    """Every weight of the streamed export is the one transformers' dequantizing load of the same
    release holds, bit for bit (exported from that loaded model), and the tokens are the same."""
    torch.manual_seed(0)
    model = MODELS[name]().float()
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = _float8_checkpoint(model, tmp_path / "fp8")
    checkpoint = SafetensorsCheckpoint(folder)
    assert checkpoint.scales and not any(n.endswith("_scale_inv") for n in checkpoint.tensors)  # scales are read beside their weights
    # codes x their block's scale: the original weight to within e4m3's rounding (3 mantissa bits), not the raw codes
    for stored in checkpoint.scales:
        weight, before = checkpoint.tensor(stored), original.get(stored)
        if before is not None:  # stored under the model's own name (experts are stacked in the model)
            assert weight.dtype == torch.float32 and (weight - before).abs().max() <= before.abs().max() / 16, stored
    loaded = _dequantized_by_transformers(folder)
    pte_a, ptd_a = llm.export(loaded, tmp_path / "loaded", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    pte_b, ptd_b = export_checkpoint(folder, tmp_path / "streamed", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    with PtdFile(ptd_a) as fa, PtdFile(ptd_b) as fb:
        assert fa.entries.keys() == fb.entries.keys()
        for fqn in fa.entries:
            assert torch.equal(fa.host_tensor(fqn).reshape(-1).view(torch.uint8), fb.host_tensor(fqn).reshape(-1).view(torch.uint8)), fqn
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    expected = transformers_greedy(loaded, prompt, 6, MAX_SEQ_LEN)
    floor = load_weight_schedules(pte_b)["decode"].floor_bytes
    with llm.Generator(pte_b, ptd_b, weight_offload_budget_mb=floor / MB + 1, device="cpu") as g:
        assert torch.equal(g.generate(prompt, 6, eos_token_id=[]), expected)


def test_a_partial_block_takes_its_blocks_scale(tmp_path):
    """A weight whose rows or columns are not a whole number of blocks (DeepSeek-V3's 576-row
    kv_a_proj_with_mqa in blocks of 128): its last blocks are partial, each element scaled by
    the block it lies in, as DeepSeek's own dequantization does."""
    torch.manual_seed(0)
    model = MOE["DeepSeek-V3"]().float()
    folder = _float8_checkpoint(model, tmp_path / "fp8", block=[16, 48])  # 24 x 64: blocks of 16 rows and 48 columns, the last ones partial
    checkpoint = SafetensorsCheckpoint(folder)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    codes, scale = load_file(os.path.join(folder, "model.safetensors"))[name].float(), checkpoint._read(name + "_scale_inv", checkpoint.scales[name])
    assert codes.shape == (24, 64) and scale.shape == (2, 2)
    expected = torch.empty_like(codes)
    for r in range(24):
        for c in range(64):
            expected[r, c] = codes[r, c] * scale[r // 16, c // 48]
    assert torch.equal(checkpoint.tensor(name), expected)
    # in the program's dtype: each float32 product rounded once
    assert torch.equal(checkpoint.tensor(name, torch.bfloat16), expected.to(torch.bfloat16))


def _expect(folder, match):
    with pytest.raises(CheckpointError, match=match):
        export_checkpoint(folder, os.path.join(folder, "out"), max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    assert not os.path.exists(os.path.join(folder, "out.pte")) and not os.path.exists(os.path.join(folder, "out.ptd"))


def test_what_cannot_be_read_as_its_weights_is_refused_by_name(tmp_path):
    model = build(BY_NAME["Llama"])[0].float()
    # another quantization method: its codes are not weights
    gptq = _float8_checkpoint(model, tmp_path / "gptq", config_update={"quantization_config": {"quant_method": "gptq", "bits": 4}})
    _expect(gptq, r"config\.json says the checkpoint is quantized \(quant_method 'gptq'\); hostswap reads unquantized checkpoints and block-scaled float8")
    # float8 with one scale per tensor
    per_tensor = _float8_checkpoint(model, tmp_path / "per-tensor", config_update={"quantization_config": {"quant_method": "fp8"}})
    _expect(per_tensor, r"quantized \(float8 without weight_block_size \(per-tensor scales\)\)")
    # a float8 weight whose scales are missing
    missing = _float8_checkpoint(model, tmp_path / "missing")
    path = os.path.join(missing, "model.safetensors")
    stored = load_file(path)
    name = next(n for n in stored if n.endswith("_scale_inv"))
    del stored[name]
    save_file(stored, path, metadata={"format": "pt"})
    weight = name[: -len("_scale_inv")]
    _expect(missing, rf"tensor '{weight}' in shard model\.safetensors of .* is torch\.float8_e4m3fn with no scales beside it \('{weight}_scale_inv'\)")
    # scales of the wrong grid
    wrong = _float8_checkpoint(model, tmp_path / "wrong")
    path = os.path.join(wrong, "model.safetensors")
    stored = load_file(path)
    stored[name] = stored[name][:1]
    save_file(stored, path, metadata={"format": "pt"})
    _expect(wrong, rf"tensor '{weight}' in shard model\.safetensors of .* is float8 \[\d+, \d+\] in blocks of 8 x 8, so its scales must be \[\d+, \d+\], not \[1, \d+\]")
    # scales of a byte each (UE8M0 exponents): not multipliers
    exponents = _float8_checkpoint(model, tmp_path / "exponents")
    path = os.path.join(exponents, "model.safetensors")
    stored = load_file(path)
    stored[name] = torch.full(stored[name].shape, 120, dtype=torch.uint8)
    save_file(stored, path, metadata={"format": "pt"})
    _expect(exponents, rf"tensor '{weight}' in shard model\.safetensors of .* has torch\.uint8 scales; hostswap reads block scales stored as float32, bfloat16, float16")
    # a weight that is not float8 codes, with scales beside it (a leftover scale would multiply a real weight)
    plain = _float8_checkpoint(model, tmp_path / "plain")
    path = os.path.join(plain, "model.safetensors")
    stored = load_file(path)
    stored[weight] = stored[weight].float()
    save_file(stored, path, metadata={"format": "pt"})
    _expect(plain, rf"tensor '{weight}' in shard model\.safetensors of .* is torch\.float32 with scales beside it; block-scaled float8 weights are torch\.float8_e4m3fn codes")
    # scales of a weight the checkpoint does not hold
    orphan = _float8_checkpoint(model, tmp_path / "orphan")
    path = os.path.join(orphan, "model.safetensors")
    stored = load_file(path)
    stored["model.layers.0.mlp.nothing.weight_scale_inv"] = torch.ones(1, 1)
    save_file(stored, path, metadata={"format": "pt"})
    _expect(orphan, r"tensor 'model\.layers\.0\.mlp\.nothing\.weight_scale_inv' in shard model\.safetensors of .* scales a weight 'model\.layers\.0\.mlp\.nothing\.weight' the checkpoint does not hold")
    # a block that is not two whole numbers
    floats = _float8_checkpoint(model, tmp_path / "floats", config_update={"quantization_config": {"quant_method": "fp8", "weight_block_size": [8.0, 8.0]}})
    _expect(floats, r"config\.json: quantization_config's weight_block_size \[8\.0, 8\.0\] is not two whole numbers above 0")
