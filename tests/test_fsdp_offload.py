"""OffloadAdamW on parameters sharded by FSDP2 (``fully_shard``), on the CPU with gloo.

Each rank holds its shards' moments in host memory and updates its shards (with
``offload_grads``, its reduce-scattered gradient shards too); the run must match
plain FSDP2 with ``torch.optim.AdamW`` step for step (the same reduce-scatter feeds both, and
the update is PyTorch's AdamW arithmetic), on a transformers Llama from a tiny config.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.multiprocessing as mp

from ports import free_port

STEPS = 10


def _train(rank: int, world: int, port: int, optimizer: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from hostswap.optim import OffloadAdamW

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)
        model = LlamaForCausalLM(config)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if optimizer == "offload_context":  # activations of layer 0 of 2 to the host, on FSDP2's layers
            from hostswap.activations import OffloadContext

            offload = OffloadContext(model_layers=2, num_layers=1, min_offload_bytes=1024)
            offload.attach(model.model.layers)
        params = list(model.parameters())
        assert all(type(p).__name__ == "DTensor" for p in params)
        opt = (OffloadAdamW(params, lr=1e-2, weight_decay=0.1, chunk_bytes=4096, offload_grads=optimizer == "offload_grads")
               if optimizer in ("offload", "offload_grads") else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False))
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + rank))  # each rank its own batch
        losses = []
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if optimizer == "offload_grads":  # the reduce-scattered shards went to host memory
                assert all(p.grad is None for p in params) and len(opt._grads_held) == len(params)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        if optimizer == "offload_context":
            assert offload.stats["bytes_offloaded"] > 0, offload.stats
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        if optimizer in ("offload", "offload_grads"):
            shard_elements = sum(p.to_local().numel() for p in params)
            state_elements = sum(s["exp_avg"].numel() for s in opt.state.values())
            assert state_elements == shard_elements < sum(p.numel() for p in params)  # its shards' moments only
        if rank == 0:
            torch.save({"losses": torch.stack(losses), "params": full}, out)
        # nothing of FSDP's (pending work, its collectives' tensors) outlives the process group,
        # and no rank tears it down while another still uses it
        del model, opt, params
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_offload_adamw_on_fsdp2_shards_equals_adamw(world, tmp_path):
    runs = {}
    for optimizer in ("adamw", "offload", "offload_grads"):
        out = str(tmp_path / f"{optimizer}.pt")
        mp.spawn(_train, args=(world, free_port(), optimizer, out), nprocs=world, join=True)
        runs[optimizer] = torch.load(out)
    expected = runs["adamw"]
    for got in (runs["offload"], runs["offload_grads"]):
        torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-6, atol=1e-6)
        assert got["losses"][-1] < got["losses"][0]  # it trains
        assert set(got["params"]) == set(expected["params"])
        for name, value in expected["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-6, atol=1e-6, msg=name)


def test_offload_context_on_fsdp2_layers_changes_nothing(tmp_path):
    """OffloadContext attached to fully_shard'ed decoder layers: their saved activations go to
    the host and back, and the run is bitwise the run without it."""
    runs = {}
    for optimizer in ("adamw", "offload_context"):
        out = str(tmp_path / f"{optimizer}.pt")
        mp.spawn(_train, args=(2, free_port(), optimizer, out), nprocs=2, join=True)
        runs[optimizer] = torch.load(out)
    assert torch.equal(runs["offload_context"]["losses"], runs["adamw"]["losses"])
    for name, value in runs["adamw"]["params"].items():
        assert torch.equal(runs["offload_context"]["params"][name], value), name


def test_bench_script_on_the_cpu(tmp_path):
    """bench/fsdp.py's paths on gloo: a row per configuration, each training as the AdamW row does."""
    import json

    from bench_scripts import load

    bench = load("fsdp")
    assert bench.main(["--gpus", "2", "--device", "cpu", "--layers", "1", "--hidden", "128", "--vocab", "256", "--batch", "2", "--seq", "16",
                       "--steps", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fsdp_cpu.json").read_text())["rows"]
    assert [r["configuration"] for r in rows] == list(bench.CONFIGS)
    assert all(r["max_loss_diff_vs_adamw"] < 1e-4 for r in rows[:4]), rows  # fp32 on the CPU; the next row trains bf16 shards
    quantized = [r for r in rows if r["configuration"] in bench.QUANTS]
    assert len(quantized) == 2 and all(0 < r["max_loss_diff_vs_adamw"] < 0.05 and r["quantizations_per_step"] > 0 for r in quantized), quantized
