"""offload_quants on FSDP2 (``fully_shard``), on the CPU with gloo.

Each Linear weight's shard keeps a persistent quantized copy in host memory, and the all-gathers
send that copy. The reference is plain FSDP2 whose Linear layers run on the same per-row
quantize-dequantize of their gathered weight, gradients passed straight through: both runs
reduce-scatter the same gradients, so losses and parameters must match step for step.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.multiprocessing as mp

from ports import free_port

STEPS = 4


def _model(arch: str, vocab: int):
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common))
    if arch == "qwen2-tied":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common, tie_word_embeddings=True))
    if arch == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    raise ValueError(arch)


class _QuantizedWeight(torch.autograd.Function):
    """The reference's weight: per-row quantize-dequantize forward, the gradient passed through."""

    @staticmethod
    def forward(ctx, weight, scheme):
        from hostswap.fsdp_quants import dequantize_rows, quantize_rows

        codes, scale = quantize_rows(weight, scheme)
        return dequantize_rows(codes, scale, torch.empty_like(weight))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _quantize_forward(model, scheme: str) -> None:
    """The reference: every module holding a Linear weight (a tied embedding too) runs on it quantized."""
    import torch.nn.functional as F

    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) in linear_weights:
            module.forward = lambda x, m=module: F.linear(x, _QuantizedWeight.apply(m.weight, scheme), m.bias)
        elif isinstance(module, torch.nn.Embedding) and id(module.weight) in linear_weights:
            module.forward = lambda ids, m=module: F.embedding(ids, _QuantizedWeight.apply(m.weight, scheme), m.padding_idx)


def _train(rank: int, world: int, port: int, arch: str, mode: str, scheme: str, vocab: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from hostswap.fsdp_quants import offload_quants

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = _model(arch, vocab)
        stats = offload_quants(model, scheme) if mode.startswith("quants") else None
        if mode == "reference":
            _quantize_forward(model, scheme)
        options = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if mode == "quants+cpu_offload" else {}
        if mode == "quants+bf16":  # gathered codes dequantized into bf16, the compute dtype
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
        losses, quantizations = [], []
        for _ in range(STEPS):
            for micro in range(2):  # two backwards per step: the copies are made once per step, not per gather
                loss = model(input_ids=ids[micro : micro + 1], labels=ids[micro : micro + 1]).loss
                loss.backward()
                losses.append(loss.detach())
            if stats is not None:
                quantizations.append(stats.quantizations)
            opt.step()
            opt.zero_grad()
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save({"losses": torch.stack(losses), "params": full, "stats": stats, "quantizations": quantizations,
                        "local_bytes": sum(p.to_local().numel() * p.element_size() for p in params)}, out)
        del model, opt, params
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(tmp_path, world: int, arch: str, mode: str, scheme: str = "int8", vocab: int = 128) -> dict:
    out = str(tmp_path / f"{arch}-{mode}-{scheme}-{world}.pt")
    mp.spawn(_train, args=(world, free_port(), arch, mode, scheme, vocab, out), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def _same_run(got: dict, expected: dict) -> None:
    torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-5, atol=1e-5)
    assert set(got["params"]) == set(expected["params"])
    for name, value in expected["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("world,arch,scheme", [(1, "llama", "int8"), (2, "llama", "int8"), (4, "llama", "int8"), (2, "qwen2-tied", "int8"), (2, "mixtral", "int8"),
                                               (2, "llama", "float8")])
def test_quantized_gathers_train_as_quantized_weights(tmp_path, world, arch, scheme):
    """The run with offload_quants equals FSDP2 whose layers quantize their gathered weight, and
    each step quantizes each Linear shard once (two backwards in a step gather it four times)."""
    expected = _run(tmp_path, world, arch, "reference", scheme)
    got = _run(tmp_path, world, arch, "quants", scheme)
    _same_run(got, expected)
    assert got["losses"][-1] < got["losses"][0]  # it trains
    stats = got["stats"]
    linear = {id(m.weight) for m in _model(arch, 128).modules() if isinstance(m, torch.nn.Linear)}
    assert got["quantizations"] == [len(linear) * (step + 1) for step in range(STEPS)]
    assert stats.gathers > stats.quantizations and stats.plain == []
    assert stats.host_bytes > 0 and stats.bytes_h2d == 0  # on the CPU the host copy is read in place
    # codes are one byte per element, a quarter of the fp32 shards
    assert stats.bytes_gathered / stats.gathers < 0.3 * got["local_bytes"] / len(linear) * 4


def test_cpu_offload_policy_and_uneven_rows(tmp_path):
    """Under FSDP2's CPUOffloadPolicy the run is the one without it; a weight whose rows do not
    split over the ranks (a 130-token head on 4 ranks) is gathered as its master, and named;
    with bf16 compute the gathered copies dequantize into bf16; the quantized weights do change
    the run (plain FSDP2 trains otherwise)."""
    got = _run(tmp_path, 4, "llama", "quants+cpu_offload", vocab=130)
    assert got["stats"].plain == ["lm_head.weight"]
    _same_run(got, _run(tmp_path, 4, "llama", "quants", vocab=130))
    bf16 = _run(tmp_path, 4, "llama", "quants+bf16", vocab=130)
    torch.testing.assert_close(bf16["losses"], got["losses"], rtol=0.02, atol=0.02)
    plain = _run(tmp_path, 4, "llama", "plain", vocab=130)
    assert not torch.allclose(got["losses"], plain["losses"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["losses"], plain["losses"], rtol=0.02, atol=0.02)  # int8 rows: close to the weights they stand for


def test_bad_input_is_refused_by_name():
    from torch import nn

    from hostswap.fsdp_quants import QuantsError, offload_quants

    with pytest.raises(QuantsError, match="scheme 'int4' is not one of"):
        offload_quants(nn.Sequential(nn.Linear(4, 4)), "int4")
    with pytest.raises(QuantsError, match="Sequential has no nn.Linear weights"):
        offload_quants(nn.Sequential(nn.LayerNorm(4)))
    model = nn.Sequential(nn.Linear(4, 4))
    offload_quants(model)
    with pytest.raises(QuantsError, match="0.weight already has a quantized copy"):
        offload_quants(model)


def test_shard_behaves_as_its_master():
    """Outside the gathers a quantized weight computes as its master does, in-place updates
    reach the master, and the copy is made again only after the master changed."""
    from torch import nn

    from hostswap.fsdp_quants import QuantizedShard, QuantsError, offload_quants

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    plain = [p.detach().clone() for p in model.parameters()]
    stats = offload_quants(model)
    weight = model[0].weight
    assert isinstance(weight, QuantizedShard) and weight.requires_grad
    x = torch.randn(5, 8)
    reference = torch.relu(x @ plain[0].T + plain[1]) @ plain[2].T + plain[3]
    assert torch.equal(model(x), reference)
    model(x).sum().backward()
    assert weight.grad is not None and type(weight.grad) is torch.Tensor
    copy = weight._copy
    packed = copy.fresh(weight._master, weight._changes)
    assert copy.fresh(weight._master, weight._changes) is packed and stats.quantizations == 1
    with torch.no_grad():
        weight.mul_(2)
    assert torch.equal(weight._master, plain[0] * 2)
    copy.fresh(weight._master, weight._changes)
    assert stats.quantizations == 2
    # FSDP2's asynchronous copy of a host shard to another device: the master follows only when
    # an operation reads it, and only while it has not changed since
    moved = weight.detach().to("meta", non_blocking=True)
    assert isinstance(moved, QuantizedShard) and moved.device.type == "meta" and moved._moved is None and moved._copy is copy
    assert (moved * 2).device.type == "meta" and moved._moved is not None
    stale = weight.detach().to("meta", non_blocking=True)
    with torch.no_grad():
        weight.add_(1)
    with pytest.raises(QuantsError, match="was made before its master on cpu changed"):
        stale * 2
    snapshot = weight.detach().to("meta")  # any other .to() is a copy made now
    assert snapshot._moved is not None


def _copy_is_current(weight) -> bool:
    from hostswap.fsdp_quants import dequantize_rows, unpack_rows

    packed = weight._copy.fresh(weight._master, weight._changes)
    codes, scale = unpack_rows(packed, torch.int8)
    return torch.allclose(dequantize_rows(codes, scale, torch.empty(weight.shape)), weight._master, atol=0.05)


@pytest.mark.parametrize("write", [
    lambda w: w.mul_(2), lambda w: w.view(-1).mul_(2), lambda w: w.t().mul_(2), lambda w: w.T.mul_(2), lambda w: w.__setitem__(0, 5.0),
    lambda w: w.__setitem__((slice(None), 0), 5.0), lambda w: w.unsqueeze(0).mul_(2), lambda w: w.unbind()[0].mul_(2),
    lambda w: w.diagonal().mul_(2), lambda w: w.permute(1, 0).mul_(2), lambda w: w.split(2)[0].mul_(2), lambda w: w.data.normal_(),
    lambda w: w.copy_(torch.ones(4, 4)), lambda w: torch._foreach_lerp_([w], [torch.ones(4, 4) * 3], 0.5),
    lambda w: torch.add(torch.ones(4, 4), 1, out=w), lambda w: torch.nn.init.orthogonal_(w), lambda w: setattr(w, "data", torch.zeros(4, 4)),
], ids=["mul_", "view", "t", "T", "row", "column", "unsqueeze", "unbind", "diagonal", "permute", "split", "data.normal_", "copy_", "foreach",
        "out=", "init", "data="])
def test_every_write_makes_the_copy_again(write):
    """A write to the master, through whatever view, makes the next gather quantize it again:
    a stale copy would train on weights that are no longer there."""
    from torch import nn

    from hostswap.fsdp_quants import offload_quants

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    offload_quants(model)
    weight = model[0].weight
    assert _copy_is_current(weight)
    with torch.no_grad():
        write(weight)
    assert _copy_is_current(weight)


def test_dequantize_rounds_once_and_packs_one_tensor():
    """Each weight is the fp32 product of its code and its row's scale, rounded once to the
    compute dtype (a scale rounded first would lose tiny rows in fp16); codes and scales travel
    as one byte tensor."""
    from hostswap.fsdp_quants import dequantize_rows, pack_rows, quantize_rows, unpack_rows

    torch.manual_seed(0)
    weight = torch.randn(64, 32) * torch.logspace(-8, 2, 64).unsqueeze(1)
    for scheme, dtype in (("int8", torch.int8), ("float8", torch.float8_e4m3fn)):
        codes, scale = quantize_rows(weight, scheme)
        packed = pack_rows(codes, scale)
        assert packed.dtype == torch.uint8 and packed.shape == (64, 4 + 32)
        back_codes, back_scale = unpack_rows(packed, dtype)
        assert torch.equal(back_codes.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(back_scale, scale)
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            got = dequantize_rows(back_codes, back_scale, torch.empty(64, 32, dtype=out_dtype))
            assert torch.equal(got, (codes.float() * scale).to(out_dtype)), (scheme, out_dtype)
    tiny = torch.randn(1, 32) * 1e-6  # fp16 holds these (its smallest step is 6e-8); a scale rounded to fp16 first is 0
    assert (dequantize_rows(*quantize_rows(tiny, "int8"), torch.empty(1, 32, dtype=torch.float16)) != 0).any()


def test_what_would_drop_the_copy_is_refused_or_kept(tmp_path):
    """A dtype change keeps the quantized copy; loading with assign=True (which would put plain
    tensors in place of the shards) and shards of columns are refused by name; a saved weight is
    a plain tensor."""
    from torch import nn

    from hostswap.fsdp_quants import QuantizedShard, QuantsError, offload_quants

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    offload_quants(model)
    state = {k: torch.zeros(v.shape).copy_(v) for k, v in model.state_dict().items()}  # plain tensors, as read from a file
    torch.save(model[0].weight, tmp_path / "w.pt")
    saved = torch.load(tmp_path / "w.pt", weights_only=True)
    assert type(saved) is torch.Tensor and type(state["0.weight"]) is torch.Tensor and torch.equal(saved, state["0.weight"])
    model.load_state_dict(state)  # copied in: still quantized
    assert isinstance(model[0].weight, QuantizedShard)
    with pytest.raises(QuantsError, match="load_state_dict replaced 0.weight"):
        model.load_state_dict(state, assign=True)
    model = nn.Sequential(nn.Linear(4, 4))
    offload_quants(model)
    model.to(torch.bfloat16)
    assert isinstance(model[0].weight, QuantizedShard) and model[0].weight.dtype == torch.bfloat16
    with pytest.raises(QuantsError, match="gathers shards of whole rows"):
        model[0].weight.fsdp_pre_all_gather(_OneRank(), torch.Size([4, 8]), (8, 1), model[0], None)


class _OneRank:
    def size(self) -> int:
        return 1


def test_copies_kept_beside_the_masters():
    """host=False (persistent quants without the offload): the copy is the one made where the
    master is, and no host memory is held for it."""
    from torch import nn

    from hostswap.fsdp_quants import offload_quants

    model = nn.Sequential(nn.Linear(4, 4))
    stats = offload_quants(model, host=False)
    weight = model[0].weight
    packed = weight._copy.fresh(weight._master, weight._changes)
    assert weight._copy.packed is packed and stats.host_bytes == 0 and stats.quantizations == 1
    assert _copy_is_current(weight)
