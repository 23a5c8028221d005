"""offload_quants under FSDP2's CPUOffloadPolicy on GPUs with NCCL (as many ranks as GPUs, up
to 2): the masters stay in host memory, each gather brings only the int8 copy to the GPU, and
the run equals the reference whose layers quantize their gathered weight."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

from ports import free_port

pytestmark = pytest.mark.gpu
STEPS = 3


def _rank(rank: int, world: int, port: int, mode: str, out: str) -> None:
    import torch.distributed as dist
    import transformers as T
    from test_fsdp_quants import _quantize_forward
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from hostswap.fsdp_quants import offload_quants

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                                                 num_key_value_heads=4, max_position_embeddings=64, bos_token_id=None, eos_token_id=None))
        stats = offload_quants(model, "int8") if mode != "reference" else None
        if mode == "reference":
            _quantize_forward(model, "int8")
        options = {"mesh": init_device_mesh("cuda", (world,))}
        if mode != "gpu-masters":
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        if mode == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        assert all(p.device.type == ("cuda" if mode == "gpu-masters" else "cpu") for p in model.parameters())  # where the masters are
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(rank)).cuda()
        losses = []
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
        torch.cuda.synchronize()
        if rank == 0:
            torch.save({"losses": torch.stack(losses), "stats": stats, "allocated": torch.cuda.memory_allocated()}, out)
        del model, opt
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(tmp_path, mode: str) -> dict:
    world = min(2, torch.cuda.device_count())
    out = str(tmp_path / f"{mode}.pt")
    mp.spawn(_rank, args=(world, free_port(), mode, out), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_quantized_copies_come_from_the_host(tmp_path):
    expected = _run(tmp_path, "reference")
    got = _run(tmp_path, "int8")
    torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-4, atol=1e-4)
    stats = got["stats"]
    assert stats.gathers > 0 and stats.bytes_h2d == stats.bytes_gathered  # every gathered byte came from pinned host memory
    assert stats.quantizations == 15 * STEPS  # 2 layers of 7 Linear weights and the head, one copy per step each
    bf16 = _run(tmp_path, "bf16")  # dequantized to the compute dtype of the mixed-precision policy
    assert bf16["losses"][-1] < bf16["losses"][0]
    torch.testing.assert_close(bf16["losses"], got["losses"], rtol=0.02, atol=0.02)
    # masters on the GPU, copies on the host: quantized on the GPU after each step, kept on the host
    gpu_masters = _run(tmp_path, "gpu-masters")
    torch.testing.assert_close(gpu_masters["losses"], expected["losses"], rtol=1e-4, atol=1e-4)
    stats = gpu_masters["stats"]
    assert stats.quantizations == 15 * STEPS and stats.host_bytes > 0 and 0 < stats.bytes_h2d < stats.bytes_gathered
