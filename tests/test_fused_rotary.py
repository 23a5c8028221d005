"""Rotary position embedding runs as one ``hostswap::rotary`` per tensor: the pass finds
transformers' ``apply_rotary_pos_emb`` (and nothing else), and the op gives bitwise the ATen
ops' values on the CPU and through its Triton kernel (on the GPU, and on the CPU through
Triton's interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hostswap.kernels import rotary as kernel
from hostswap.kernels.row_copy import triton_available
from hostswap.passes.fused_rotary import FuseRotaryPass, rotary

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter runs the kernel on the CPU)")
aten = torch.ops.aten


class _Attention(torch.nn.Module):
    """Queries and keys through transformers' own ``apply_rotary_pos_emb`` (Llama's)."""

    def forward(self, q, k, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def _inputs(dtype, cos_dtype=None):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 4, 16, generator=g).to(dtype), torch.randn(2, 5, 2, 16, generator=g).to(dtype)
    angles = torch.randn(2, 5, 16, generator=g)
    return q, k, angles.cos().to(cos_dtype or dtype), angles.sin().to(cos_dtype or dtype)


def _fused(module, *args):
    ep = torch.export.export(module, args)
    before = ep.module()(*args)
    replaced = FuseRotaryPass().call(ep.graph_module)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    return replaced, targets, before, ep.module()(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_transformers_rotary_becomes_one_op_per_tensor_with_bitwise_values(dtype):
    args = _inputs(dtype)
    ep = torch.export.export(_Attention(), args)
    replaced, targets, before, after = _fused(_Attention(), *args)
    assert replaced == 2 and targets.count(rotary) == 2
    # the calls' recorded values are laid out as the op returns them (the queries were transposed)
    FuseRotaryPass().call(ep.graph_module)
    assert all(n.meta["val"].is_contiguous() for n in ep.graph.nodes if n.op == "call_function" and n.target is rotary)
    assert aten.neg.default not in targets and aten.cat.default not in targets
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.equal(a, b) for a, b in zip(after, _Attention()(*args)))


class _Variants(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x, cos, sin):
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        if self.kind == "halves not negated":
            return x * cos + torch.cat((x2, x1), dim=-1) * sin
        if self.kind == "the other half negated":
            return x * cos + torch.cat((x1, -x2), dim=-1) * sin
        if self.kind == "not halves":
            return x * cos + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * sin
        if self.kind == "rotated value read elsewhere":
            turned = torch.cat((-x2, x1), dim=-1)
            return x * cos + turned * sin, turned
        if self.kind == "another tensor's halves":
            return x * cos + torch.cat((-(x + 1)[..., h:], x1), dim=-1) * sin
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["halves not negated", "the other half negated", "not halves", "rotated value read elsewhere", "another tensor's halves"])
def test_what_is_not_rotary_is_left_alone(kind):
    x, _, cos, sin = _inputs(torch.bfloat16)
    replaced, targets, before, after = _fused(_Variants(kind), x, cos[:, :, None], sin[:, :, None])
    assert replaced == 0 and rotary not in targets
    leaves = torch.utils._pytree.tree_leaves
    assert all(torch.equal(a, b) for a, b in zip(leaves(before), leaves(after)))


def test_rotary_of_rotary_and_as_the_programs_output():
    """Each match sees the rewrites before it (the second rotation reads the first one's call),
    and the sum becomes the call, so the program's output names stay valid."""
    class Twice(torch.nn.Module):
        def forward(self, x, cos, sin):
            from transformers.models.llama.modeling_llama import rotate_half

            once = x * cos + rotate_half(x) * sin
            return once * sin + rotate_half(once) * cos

    x, _, cos, sin = _inputs(torch.bfloat16)
    ep = torch.export.export(Twice(), (x, cos[:, :, None], sin[:, :, None]))
    before = ep.module()(x, cos[:, :, None], sin[:, :, None])
    assert FuseRotaryPass().call(ep.graph_module) == 2
    ep.validate()
    assert torch.equal(ep.module()(x, cos[:, :, None], sin[:, :, None]), before)


def test_a_rotation_whose_input_is_written_in_place_before_its_sum_is_left_alone():
    class Written(torch.nn.Module):
        def forward(self, x, cos, sin):
            h = x.shape[-1] // 2
            straight = x * cos
            x.add_(1)
            return straight + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin

    x, _, cos, sin = _inputs(torch.float32)
    ep = torch.export.export(Written(), (x, cos[:, :, None], sin[:, :, None]))
    assert FuseRotaryPass().call(ep.graph_module) == 0


def test_cos_of_another_dtype_is_left_alone():
    """bfloat16 queries times float32 cos promote to float32: not the op's arithmetic."""
    replaced, targets, _, _ = _fused(_Attention(), *_inputs(torch.bfloat16, torch.float32))
    assert replaced == 0 and rotary not in targets


def test_an_out_or_cos_that_does_not_fit_is_refused_by_name():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"hostswap::rotary.out: out is \(2, 3, 8\) torch.bfloat16 on cpu, the result is \(2, 3, 8\) torch.float32 on cpu"):
        torch.ops.hostswap.rotary.out(x, x, x, out=torch.empty(2, 3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"cos \(2, 5, 8\) and sin \(2, 3, 8\) must broadcast to x \(2, 3, 8\)"):
        torch.ops.hostswap.rotary.out(x, torch.randn(2, 5, 8), x, out=torch.empty(2, 3, 8))
    # the op without out checks the same, and an odd last dimension has no halves to swap
    odd = torch.randn(2, 3, 7)
    for call in (lambda: rotary(odd, odd, odd), lambda: torch.ops.hostswap.rotary.out(odd, odd, odd, out=torch.empty_like(odd)),
                 lambda: rotary(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(1.0))):
        with pytest.raises(ValueError, match=r"must broadcast to x .*whose last dimension must be even"):
            call()
    with pytest.raises(ValueError, match=r"cos \(2, 5, 8\)"):
        rotary(x, torch.randn(2, 5, 8), x)


def _kernel_is_bitwise(device: torch.device, dtypes) -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for shape, cos_shape in (((1, 32, 1, 128), (1, 1, 1, 128)), ((2, 4, 7, 64), (2, 1, 7, 64)), ((3, 6, 16), (3, 6, 16)), ((5, 8), (8,))):
            x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
            angles = torch.randn(cos_shape, generator=g) * 10
            cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
            got = kernel.launch(x, cos, sin, torch.empty(shape, dtype=dtype, device=device))
            assert torch.equal(got, kernel.rotary_reference(x, cos, sin)), (dtype, shape)
        # queries read where they lie: a transposed view
        x = torch.randn(1, 7, 4, 32, generator=g).to(dtype).to(device).transpose(1, 2)
        cos, sin = torch.randn(1, 1, 7, 32, generator=g).to(dtype).to(device), torch.randn(1, 1, 7, 32, generator=g).to(dtype).to(device)
        assert torch.equal(kernel.launch(x, cos, sin, torch.empty(x.shape, dtype=dtype, device=device)), kernel.rotary_reference(x, cos, sin)), dtype


@needs_triton
def test_kernel_interpreted():
    """On the CPU through Triton's interpreter, in a process of its own (the interpreter is
    chosen when Triton is imported)."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import torch; "
            "from test_fused_rotary import _kernel_is_bitwise; _kernel_is_bitwise(torch.device('cpu'), (torch.float32,))")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
def test_kernel_on_the_gpu():
    _kernel_is_bitwise(torch.device("cuda"), (torch.float32, torch.bfloat16, torch.float16))
    x = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    assert kernel.uses_kernel(x, x[:1, :1], x[:1, :1], torch.empty_like(x))
