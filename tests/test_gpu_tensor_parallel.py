"""Tensor-parallel streamed generation on 2 GPUs with NCCL (skipped with fewer): each rank's
program at its floor, decode captured in a CUDA graph with the all-reduces inside, against the
one-GPU program of the same fp32 model."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

import hostswap.llm as llm
from hostswap.schedules.serialization import load_weight_schedules
from hostswap.schedules.weight_schedule import load_floor_bytes
from hostswap.tensor_parallel import rank_path

from ports import free_port

pytestmark = pytest.mark.gpu
MB = 2**20
MAX_SEQ_LEN, CHUNK, NEW = 64, 8, 16
PROMPT = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(2))


def _model():
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                                            num_key_value_heads=4, max_position_embeddings=MAX_SEQ_LEN, tie_word_embeddings=False,
                                            bos_token_id=None, eos_token_id=None)).eval()


def _floor_mb(pte: str) -> float:
    return load_floor_bytes(load_weight_schedules(pte)) / MB


def _rank(rank: int, port: int, prefix: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    try:
        path = rank_path(prefix, rank)
        with llm.Generator(path + ".pte", path + ".ptd", weight_offload_budget_mb=_floor_mb(path + ".pte"), device=f"cuda:{rank}") as g:
            assert g.module.cuda_graph, "decode is graphed"
            tokens = g.generate(PROMPT, NEW)
            streamed = g.stats["bytes_streamed_per_token"]
            g.module.reset_state()
            logits = g._step(llm.PREFILL, PROMPT[:, :CHUNK], 0).cpu()
        if rank == 0:
            torch.save({"tokens": tokens, "logits": logits, "streamed": streamed}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_give_the_one_gpu_tokens_streaming_half_the_bytes(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    single = str(tmp_path / "single")
    pte, ptd = llm.export(_model(), single, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    with llm.Generator(pte, ptd, weight_offload_budget_mb=_floor_mb(pte), device="cuda:0") as g:
        tokens = g.generate(PROMPT, NEW)
        streamed = g.stats["bytes_streamed_per_token"]
        g.module.reset_state()
        logits = g._step(llm.PREFILL, PROMPT[:, :CHUNK], 0).cpu()
    prefix = str(tmp_path / "tp")
    llm.export(_model(), prefix, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, tensor_parallel=2)
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_rank, args=(free_port(), prefix, out), nprocs=2, join=True)
    got = torch.load(out)
    assert torch.equal(got["tokens"], tokens), (got["tokens"], tokens)
    torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)  # fp32: a sum over 2 GPUs, not one dot product
    assert got["streamed"] < 0.6 * streamed, (got["streamed"], streamed)  # each GPU streams its half
