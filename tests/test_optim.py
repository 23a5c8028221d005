"""OffloadAdamW against torch.optim.AdamW: the same arithmetic, with the state in host memory
and the update chunk by chunk (on the CPU the chunks are updated in place; CUDA copies them
through the device, tests/test_gpu.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from hostswap.optim import OffloadAdamW


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dtype)


def _loss(model, step, micro=0):
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(16, 32, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize("chunk_bytes", [64, 10_000, 2**30])
def test_fp32_matches_adamw_bitwise_over_20_steps(chunk_bytes):
    ours, theirs = _model(torch.float32), _model(torch.float32)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, chunk_bytes=chunk_bytes)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(20):
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert opt.stats["steps"] == 20
    state_bytes = 2 * sum(p.numel() * 4 for p in ours.parameters())  # two fp32 moments
    assert opt.stats["host_bytes"] == state_bytes and opt.stats["bytes_h2d"] == opt.stats["bytes_d2h"] == 20 * state_bytes


def test_bf16_with_fp32_master_matches_adamw_on_fp32_masters_with_accumulation():
    """bf16 working weights, fp32 masters in host memory, two micro-batches per step: the
    masters equal torch.optim.AdamW run on fp32 copies with the same gradients, and the
    working weights are the masters rounded to bf16."""
    ours, theirs = _model(torch.bfloat16), _model(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in theirs.parameters()]
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, offload_master=True, chunk_bytes=8_000)
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(20):
        opt.zero_grad()
        ref.zero_grad()
        for p in theirs.parameters():
            p.grad = None
        for micro in range(2):  # gradient accumulation
            _loss(ours, step, micro).backward()
            _loss(theirs, step, micro).backward()
        opt.step()
        for m, p in zip(masters, theirs.parameters()):
            m.grad = p.grad.float()
        ref.step()
        with torch.no_grad():
            for m, p in zip(masters, theirs.parameters()):
                p.copy_(m)
    for p, q, m in zip(ours.parameters(), theirs.parameters(), masters):
        assert torch.equal(opt.state[p]["master"], m.detach())
        assert torch.equal(p, q)
        assert opt.state[p]["exp_avg"].dtype == torch.float32


def test_arguments_are_checked():
    params = list(_model(torch.float32).parameters())
    with pytest.raises(ValueError, match="lr must be a number >= 0, got -1"):
        OffloadAdamW(params, lr=-1)
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"):
        OffloadAdamW(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int, got 0"):
        OffloadAdamW(params, chunk_bytes=0)


def test_state_dict_round_trip():
    model = _model(torch.float32)
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    _loss(model, 0).backward()
    opt.step()
    again = OffloadAdamW(copy.deepcopy(model).parameters(), lr=1e-2)
    again.load_state_dict(opt.state_dict())
    assert all(torch.equal(again.state_dict()["state"][i]["exp_avg"], s["exp_avg"]) for i, s in opt.state_dict()["state"].items())


def test_loaded_state_stays_in_host_memory_in_its_own_dtype():
    """torch.optim casts loaded state to the parameter's dtype and device; the fp32 moments
    and masters of bf16 weights must come back as they were."""
    model = _model(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, offload_master=True)
    _loss(model, 0).backward()
    opt.step()
    again = OffloadAdamW(model.parameters(), lr=1e-2, offload_master=True)
    again.load_state_dict(opt.state_dict())
    for p in model.parameters():
        for name in ("exp_avg", "exp_avg_sq", "master"):
            loaded, saved = again.state[p][name], opt.state[p][name]
            assert loaded.dtype == torch.float32 and loaded.device.type == "cpu" and torch.equal(loaded, saved), name


@pytest.mark.parametrize("offload_grads", [False, True])
def test_chunks_hold_at_most_chunk_bytes_and_split_large_parameters(offload_grads):
    model = _model(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), offload_master=True, offload_grads=offload_grads, chunk_bytes=8_000)
    _loss(model, 0).backward()
    from hostswap.optim import _layout_bytes

    chunks = opt._chunks()
    for _, chunk in chunks:
        assert sum(_layout_bytes(opt._moved(p), b - a) for p, a, b in chunk) <= 8_000
    pieces = [(p, a, b) for _, chunk in chunks for p, a, b in chunk]
    weight = model[2].weight  # 64 x 64: 48 kB of moments and master, in slices
    slices = [(a, b) for p, a, b in pieces if p is weight]
    assert len(slices) > 1 and slices[0][0] == 0 and slices[-1][1] == weight.numel()
    assert all(b1 == a2 for (_, b1), (a2, _) in zip(slices, slices[1:]))


@pytest.mark.parametrize("dtype,offload_master", [(torch.float32, False), (torch.bfloat16, True)])
def test_offload_grads_matches_gradients_on_the_device_with_accumulation(dtype, offload_master):
    """offload_grads: each gradient goes to host memory as the backward makes it and ``.grad``
    is dropped; two micro-batches add on the host. The run equals the same optimizer reading
    ``.grad`` on the device, bitwise."""
    ours, theirs = _model(dtype), _model(dtype)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, offload_master=offload_master, offload_grads=True, chunk_bytes=3_000)
    ref = OffloadAdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, offload_master=offload_master, chunk_bytes=3_000)
    for step in range(10):
        ref.zero_grad()
        for micro in range(2):
            _loss(ours, step, micro).backward()
            _loss(theirs, step, micro).backward()
        assert all(p.grad is None for p in ours.parameters())  # in host memory only
        opt.step()
        ref.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    grads = sum(p.numel() * p.element_size() for p in ours.parameters())
    assert opt.stats["host_bytes"] == ref.stats["host_bytes"] + grads
    opt.remove_hooks()
    _loss(ours, 0).backward()
    assert all(p.grad is not None for p in ours.parameters())  # back on .grad
