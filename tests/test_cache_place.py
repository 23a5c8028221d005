"""The expert cache's bookkeeping as one Triton kernel (kernels/cache_place.py) against the same
bookkeeping as torch ops: the same slots and the same state after every call, over a random
run of lookups, guesses, fills and lookups of rows nobody reads."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from hostswap.runtime.expert_cache import ExpertCache

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

STATE = ("slot_of", "expert_of", "uses", "last_use", "fresh", "clock", "_counters")


def _same_state_over_a_run(device: torch.device, experts: int, k: int, slots: int, steps: int = 120, policy: str = "lfu") -> None:
    """The pick counts halved every 16 calls on the way; lookups hold the slots of up to
    ``slots // k - 1`` calls before them."""
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(experts, 6, 3, generator=gen), torch.randn(experts, 3, 3, generator=gen)
    tables = (gate_up.to(device), down.to(device), None)
    unit = (6 * 3 + 3 * 3) * 4
    fused = ExpertCache("block", experts, unit, slots, k, device, prefetch=True, fused=True, policy=policy, half_life=16)
    ops = ExpertCache("block", experts, unit, slots, k, device, prefetch=True, fused=False, policy=policy, half_life=16)
    popularity = torch.tensor([1.0 / (e + 1) for e in range(experts)])
    for step in range(steps):
        ids = torch.multinomial(popularity, k, generator=gen).to(device)
        if step % 9 == 4:
            last = torch.randperm(experts, generator=gen)[: k - 1].to(device)  # fewer ids than k, too
            for cache in (fused, ops):
                cache.fill(last, tables)
        if step % 4 != 3 and step > 0:
            guess = torch.randperm(experts, generator=gen)[:k].to(device)
            for cache in (fused, ops):
                cache.prefetch(guess)
        recent = step % (slots // k)  # a batched step's group: the calls before it in the group held
        if step % 7 == 5:  # a batch row nobody reads: nothing changes, its slots are -1
            before = {name: getattr(fused, name).clone() for name in STATE}
            off = torch.tensor(False, device=device)
            for cache in (fused, ops):
                target, missed = cache.lookup(torch.full((1, k), -1, device=device), tables, live=off, recent=recent)  # its picks marked none, as a step gives them
                assert target.tolist() == [-1] * k and missed.tolist() == [0] * k, step
                assert all(torch.equal(getattr(cache, name), before[name]) for name in STATE), step
        (got, got_missed), (want, want_missed) = (cache.lookup(ids.view(1, k), tables, recent=recent) for cache in (fused, ops))
        assert torch.equal(got, want) and torch.equal(got_missed, want_missed), step
        for name in STATE:
            assert torch.equal(getattr(fused, name), getattr(ops, name)), (step, name)
        assert torch.equal(fused.tables[0][got], gate_up[ids.cpu()].to(device)) and torch.equal(fused.tables[1][got], down[ids.cpu()].to(device))
    assert int(fused.uses.max()) > 0
    hits, misses, prefetched, prefetch_hits, filled = fused.counts()
    assert hits > 0 and misses > 0 and prefetched > 0 and prefetch_hits > 0 and filled > 0


@needs_triton
@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("experts,k,slots", [(16, 4, 6), (128, 8, 27), (8, 2, 3)])
def test_one_kernel_leaves_the_state_of_the_torch_ops_interpreted(experts, k, slots, policy):
    """On the CPU, through Triton's interpreter: in a process of its own, since the interpreter
    is chosen when Triton's own kernels are defined, at its import."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import torch; "
            f"from test_cache_place import _same_state_over_a_run; "
            f"_same_state_over_a_run(torch.device('cpu'), {experts}, {k}, {slots}, steps=40, policy={policy!r})")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("experts,k,slots", [(16, 4, 6), (128, 8, 27), (128, 8, 127), (8, 2, 3)])
def test_one_kernel_leaves_the_state_of_the_torch_ops_on_cuda(experts, k, slots, policy):
    """On the GPU, where a cache on CUDA takes the kernel by default."""
    assert ExpertCache("block", experts, 100, slots, k, torch.device("cuda")).fused
    _same_state_over_a_run(torch.device("cuda"), experts, k, slots, policy=policy)
