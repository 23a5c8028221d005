"""The decode step's expert products read in place (kernels/routed_gemv.py) against the
gathered batched matmul they replace: the same products, rounded once from float32."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hostswap.kernels import routed_experts
from hostswap.kernels.routed_gemv import routed_gemv

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def _gathered(x: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``_pairs``' arithmetic in float32: the picked rows gathered, then a batched matmul."""
    w, x = table[rows].float(), x.float().expand(rows.numel(), -1)
    return torch.bmm(x.unsqueeze(1), w).squeeze(1) if transposed else torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)


def _products_match(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    # a reduction longer than one load, outputs not a multiple of a program's block, a repeated pick
    experts, n_out, k_in, rows = 6, 40, 300, torch.tensor([4, 0, 4, 5])
    for dtype in (torch.float32, torch.bfloat16):
        for transposed in (False, True):
            shape = (experts, k_in, n_out) if transposed else (experts, n_out, k_in)
            table = torch.randn(shape, generator=gen).to(dtype).to(device)
            for x in (torch.randn(1, k_in, generator=gen), torch.randn(rows.numel(), k_in, generator=gen)):
                x = x.to(dtype).to(device)
                got = routed_gemv(x, table, rows.to(device), transposed)
                want = _gathered(x, table, rows.to(device), transposed)
                assert got.dtype == dtype and got.shape == want.shape
                if dtype == torch.float32:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
                else:  # the float32 sum rounded once: within a unit in the last place of bfloat16
                    assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-6).all(), (dtype, transposed)
            # a pick of -1 is none: its product is 0, the others' as they were
            skipped = torch.tensor([4, -1, 4, 5]).to(device)
            x = torch.randn(rows.numel(), k_in, generator=gen).to(dtype).to(device)
            got, want = routed_gemv(x, table, skipped, transposed), routed_gemv(x, table, rows.to(device), transposed)
            assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(got[[0, 2, 3]], want[[0, 2, 3]])
            # a cache's slots: picks 0 and 2 missed and read their source rows, filling their slots
            slots = torch.randn((3, *shape[1:]), generator=gen).to(dtype).to(device)
            kept = slots[0].clone()
            slot_rows, source_rows = torch.tensor([2, 0, 1]).to(device), torch.tensor([4, 0, 5]).to(device)
            copy = torch.tensor([1, 0, 1], dtype=torch.int32).to(device)
            x = torch.randn(1, k_in, generator=gen).to(dtype).to(device)
            got = routed_gemv(x, slots, slot_rows, transposed, (table, source_rows, copy))
            assert torch.equal(slots[2], table[4]) and torch.equal(slots[1], table[5]) and torch.equal(slots[0], kept)
            # a pick of -1 marked to copy writes nothing, and its product is 0
            before = slots.clone()
            none = routed_gemv(x, slots, torch.tensor([-1, 0]).to(device), transposed, (table, torch.tensor([3, 0]).to(device), torch.tensor([1, 0], dtype=torch.int32).to(device)))
            assert torch.equal(slots, before) and torch.equal(none[0], torch.zeros_like(none[0]))
            if dtype == torch.float32:
                torch.testing.assert_close(got, _gathered(x, slots, slot_rows, transposed), rtol=1e-5, atol=1e-4)


@needs_triton
def test_products_are_the_gathered_matmuls_interpreted():
    """On the CPU through Triton's interpreter, in a process of its own (the interpreter is
    chosen when Triton is imported)."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import torch; "
            "from test_routed_gemv import _products_match; _products_match(torch.device('cpu'))")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_source_laid_out_unlike_the_slots_is_refused():
    slots, rows = torch.zeros(2, 8, 16), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"rows of the source \(4, 16, 8\) \(torch.float32\) are not laid out as the slots' \(2, 8, 16\)"):
        routed_gemv(torch.zeros(1, 16), slots, rows, False, (torch.zeros(4, 16, 8), rows, rows))
    with pytest.raises(ValueError, match="not laid out as the slots'"):
        routed_gemv(torch.zeros(1, 16), slots, rows, False, (torch.zeros(4, 8, 16, dtype=torch.float16), rows, rows))


def test_a_vector_that_does_not_fit_the_table_is_refused_by_shape():
    table = torch.zeros(4, 8, 16)
    with pytest.raises(ValueError, match=r"x \(1, 12\) does not fit 2 picks of a \(4, 8, 16\) table"):
        routed_gemv(torch.zeros(1, 12), table, torch.tensor([0, 1]), transposed=False)
    with pytest.raises(ValueError, match="x \\(3, 16\\) does not fit 2 picks"):
        routed_gemv(torch.zeros(3, 16), table, torch.tensor([0, 1]), transposed=False)


def test_the_cpu_keeps_the_gathered_batched_matmul():
    """Off CUDA the decode step's experts are transformers' batched_mm arithmetic, op for op."""
    gen = torch.Generator().manual_seed(1)
    hidden, ids = torch.randn(1, 16, generator=gen), torch.tensor([[3, 1]])
    weights = torch.tensor([[0.7, 0.3]])
    gate_up, down = torch.randn(4, 2 * 8, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    act = lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]  # noqa: E731
    got = routed_experts._pairs(hidden, ids, weights, gate_up, down, None, None, act, False)
    mid = act(torch.bmm(gate_up[ids[0]], hidden.repeat(2, 1).unsqueeze(-1)).squeeze(-1))
    want = (torch.bmm(down[ids[0]], mid.unsqueeze(-1)).squeeze(-1) * weights.reshape(-1, 1)).sum(0, keepdim=True)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_products_are_the_gathered_matmuls_on_cuda():
    _products_match(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_on_cuda_reads_in_place_what_the_gather_computes(dtype, monkeypatch):
    """``_pairs`` on CUDA takes the in-place products; forced onto the gathered matmul it gives
    the same output within rounding, for tables on the device."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 256, generator=gen).to(dtype).cuda()
    ids, weights = torch.tensor([[5, 2, 7]]).cuda(), torch.softmax(torch.randn(1, 3, generator=gen), -1).to(dtype).cuda()
    gate_up = (torch.randn(8, 2 * 96, 256, generator=gen) * 0.05).to(dtype).cuda()
    down = (torch.randn(8, 256, 96, generator=gen) * 0.05).to(dtype).cuda()
    act = lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]  # noqa: E731
    calls = []
    real = routed_experts.routed_gemv
    monkeypatch.setattr(routed_experts, "routed_gemv", lambda *a: calls.append(1) or real(*a))
    in_place = routed_experts._pairs(hidden, ids, weights, gate_up, down, None, None, act, False)
    assert len(calls) == 2  # gate_up and down
    monkeypatch.setattr(routed_experts, "routed_gemv_supports", lambda *a: False)
    gathered = routed_experts._pairs(hidden, ids, weights, gate_up, down, None, None, act, False)
    tolerance = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    torch.testing.assert_close(in_place, gathered, rtol=tolerance[0], atol=tolerance[1])
