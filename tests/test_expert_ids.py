"""The router's ids checked as one device flag: the Triton kernel agrees with the ATen ops on
ids in range and on each way out of it (on the GPU, and on the CPU through Triton's
interpreter), and on CUDA a corrupted router stops the call before any expert is read."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hostswap.kernels import expert_ids
from hostswap.kernels.row_copy import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter runs the kernel on the CPU)")


def _flag_matches_aten(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    for num_experts in (1, 8, 128):
        for n in (1, 2, 8, 64, 1023, 1024, 1025, 3000):
            for dtype in (torch.int64, torch.int32):
                ids = torch.randint(0, num_experts, (n,), generator=g).to(dtype)
                cases = {"in range": ids}
                at = int(torch.randint(0, n, (1,), generator=g))
                for name, bad in (("-1", -1), ("E", num_experts), ("far", 2**30)):
                    wrong = ids.clone()
                    wrong[at] = bad
                    cases[name] = wrong
                for name, case in cases.items():
                    shaped = case.to(device).view(1, n) if n % 2 else case.to(device).view(-1, 2)
                    flag = expert_ids.launch(shaped, num_experts)
                    expected = bool(((case >= 0) & (case < num_experts)).all())
                    assert flag.dtype == torch.bool and flag.shape == () and flag.device == shaped.device
                    assert bool(flag) == expected == (name == "in range"), (num_experts, n, dtype, name)
    # strided ids (a column of a wider tensor)
    wide = torch.zeros(16, 3, dtype=torch.int64, device=device)
    wide[5, 2] = -1
    assert bool(expert_ids.launch(wide[:, 1], 4)) and not bool(expert_ids.launch(wide[:, 2], 4))
    assert bool(expert_ids.launch(torch.empty(0, 8, dtype=torch.int64, device=device), 4))


def test_aten_ops_off_cuda():
    ids = torch.tensor([[0, 3], [2, 1]])
    assert not expert_ids.uses_kernel(ids)
    assert bool(expert_ids.ids_in_range(ids, 4)) and not bool(expert_ids.ids_in_range(ids, 3))
    assert not bool(expert_ids.ids_in_range(ids - 1, 4))


@needs_triton
def test_kernel_interpreted():
    """On the CPU through Triton's interpreter, in a process of its own (the interpreter is
    chosen when Triton is imported)."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import torch; "
            "from test_expert_ids import _flag_matches_aten; _flag_matches_aten(torch.device('cpu'))")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
def test_kernel_on_the_gpu():
    assert expert_ids.uses_kernel(torch.zeros(1, dtype=torch.int64, device="cuda"))
    _flag_matches_aten(torch.device("cuda"))


@pytest.mark.gpu
def test_a_corrupted_router_stops_the_call_on_the_gpu():
    """An id out of range raises a device-side assertion (in a process of its own: it ends the
    CUDA context) naming the block; in range the same call runs."""
    code = """
import sys, torch
from hostswap.kernels.routed_experts import routed_experts
torch.manual_seed(0)
E, H, I = 4, 64, 32
gate_up = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
down = torch.randn(E, H, I, dtype=torch.bfloat16, device="cuda")
hidden = torch.randn(1, H, dtype=torch.bfloat16, device="cuda")
weights = torch.full((1, 2), 0.5, dtype=torch.bfloat16, device="cuda")
ids = torch.tensor([[0, int(sys.argv[1])]], device="cuda")
out = routed_experts(hidden, ids, weights, gate_up, down, None, None, "silu", True, False, False, 1.0, 0.0, "model.layers.3.mlp.experts")
torch.cuda.synchronize()
print("ran", tuple(out.shape))
"""
    fine = subprocess.run([sys.executable, "-c", code, "3"], capture_output=True, text=True, timeout=300)
    assert fine.returncode == 0 and "ran (1, 64)" in fine.stdout, fine.stderr[-3000:]
    for bad in ("4", "-1"):
        run = subprocess.run([sys.executable, "-c", code, bad], capture_output=True, text=True, timeout=300)
        said = run.stdout + run.stderr
        assert run.returncode != 0 and "ran" not in run.stdout, said[-3000:]
        assert "device-side assert" in said and "model.layers.3.mlp.experts" in said, said[-3000:]
