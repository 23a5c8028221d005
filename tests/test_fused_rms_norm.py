"""RMSNorm's normalization runs as one ``hostswap::rms_norm``: the pass finds it in transformers'
norms (and only there), the op gives bitwise the ATen ops' values on the CPU, and its Triton
kernel stays within float32 rounding of them (on the GPU, and on the CPU through Triton's
interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hostswap.kernels import rms_norm as kernel
from hostswap.kernels.row_copy import triton_available
from hostswap.passes.fused_rms_norm import FuseRmsNormPass, rms_norm

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter runs the kernel on the CPU)")


def _norms(arch: str, hidden: int = 64):
    import transformers as T

    if arch == "llama":
        return T.models.llama.modeling_llama.LlamaRMSNorm(hidden, eps=1e-5)
    if arch == "gemma":  # (1 + weight), applied in float32 before the cast back
        return T.models.gemma.modeling_gemma.GemmaRMSNorm(hidden, eps=1e-6)
    if arch == "qwen3":
        return T.models.qwen3.modeling_qwen3.Qwen3RMSNorm(hidden, eps=1e-6)
    raise AssertionError(arch)


def _fused(module, *args):
    ep = torch.export.export(module, args)
    before = ep.module()(*args)
    replaced = FuseRmsNormPass().call(ep.graph_module)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    return replaced, targets, before, ep.module()(*args)


@pytest.mark.parametrize("arch", ["llama", "gemma", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_norms_become_one_op_with_bitwise_values_on_the_cpu(arch, dtype):
    torch.manual_seed(0)
    norm = _norms(arch).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 5, 64).to(dtype) * 3
    replaced, targets, before, after = _fused(norm, x)
    assert replaced == 1 and targets.count(rms_norm) == 1
    assert torch.ops.aten.rsqrt.default not in targets and torch.ops.aten.pow.Tensor_Scalar not in targets
    assert torch.ops.aten.mul.Tensor not in targets  # the weight's product is the op's too
    assert torch.equal(after, before) and torch.equal(after, norm(x))
    if dtype == torch.bfloat16 and arch != "gemma":  # both casts are the op's (Gemma casts after its weight)
        assert torch.ops.aten.to.dtype not in targets


class _Variants(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        h = x.to(torch.float32)
        if self.kind == "mean over dim 0":
            return h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)
        if self.kind == "keepdim False":
            return h * torch.rsqrt(h.pow(2).mean(-1) + 1e-6).unsqueeze(-1)
        if self.kind == "cube":
            return h * torch.rsqrt(h.pow(3).mean(-1, keepdim=True) + 1e-6)
        if self.kind == "variance also returned":
            variance = h.pow(2).mean(-1, keepdim=True)
            return h * torch.rsqrt(variance + 1e-6), variance
        if self.kind == "scaled by another tensor":
            return (h + 1) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.kind == "times a matrix":  # the op's weight is one value per column; this stays a mul
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * x
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["mean over dim 0", "keepdim False", "cube", "variance also returned", "scaled by another tensor", "times a matrix"])
def test_what_is_not_an_rms_norm_is_left_alone(kind):
    x = (torch.rand(3, 8) + 0.5).to(torch.bfloat16)
    replaced, targets, before, after = _fused(_Variants(kind), x)
    if kind == "times a matrix":  # the norm is fused, the product is not
        assert replaced == 1 and torch.ops.aten.mul.Tensor in targets
    else:
        assert replaced == 0 and rms_norm not in targets
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(before), torch.utils._pytree.tree_leaves(after)))


def test_a_cast_read_elsewhere_stays_and_the_op_reads_it():
    class Shared(torch.nn.Module):
        def forward(self, x):
            h = x.to(torch.float32)
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype), h + 1

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    replaced, targets, before, after = _fused(Shared(), x)
    assert replaced == 1 and targets.count(torch.ops.aten.to.dtype) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_a_norm_of_a_norm_reads_the_first_ones_call(dtype, weighted):
    """Each match sees the rewrites before it: the second norm's input is the first one's call."""
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = _norms("llama", 16).to(dtype), _norms("llama", 16).to(dtype)
            with torch.no_grad():
                self.first.weight.normal_()
                self.second.weight.normal_()

        def forward(self, x):
            if weighted:
                return self.second(self.first(x))
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)

    x = torch.randn(3, 16).to(dtype)
    replaced, targets, before, after = _fused(Twice(), x)
    assert replaced == 2 and targets.count(rms_norm) == 2 and torch.equal(after, before)


def test_a_norm_whose_input_is_written_in_place_before_its_end_is_left_alone():
    """The op reads its input once, where the norm ends; the ATen ops read it along the way."""
    class Written(torch.nn.Module):
        def forward(self, x):
            h = x.to(torch.float32)
            variance = h.pow(2).mean(-1, keepdim=True)
            x.add_(1)
            return (h * torch.rsqrt(variance + 1e-6)).to(x.dtype)

    ep = torch.export.export(Written(), (torch.randn(2, 8, dtype=torch.bfloat16),))
    assert FuseRmsNormPass().call(ep.graph_module) == 0


def test_an_alpha_on_the_eps_sum_is_left_alone():
    """``add.Scalar(mean, eps, alpha)`` adds alpha * eps: not the op's arithmetic."""
    graph = torch.fx.Graph()
    h = graph.placeholder("h")
    h.meta["val"] = torch.empty(2, 8)
    aten = torch.ops.aten
    power = graph.call_function(aten.pow.Tensor_Scalar, (h, 2))
    mean = graph.call_function(aten.mean.dim, (power, [-1], True))
    add = graph.call_function(aten.add.Scalar, (mean, 1e-6, 1e6))
    rsqrt = graph.call_function(aten.rsqrt.default, (add,))
    graph.output(graph.call_function(aten.mul.Tensor, (h, rsqrt)))
    assert FuseRmsNormPass().call(torch.fx.GraphModule(torch.nn.Module(), graph)) == 0


def test_a_norm_that_is_the_programs_output_keeps_its_name():
    """The last matched node becomes the call: the program's output names stay valid."""
    norm = _norms("llama", 16)
    x = torch.randn(2, 16)
    ep = torch.export.export(norm, (x,))
    assert FuseRmsNormPass().call(ep.graph_module) == 1
    ep.validate()
    assert torch.equal(ep.module()(x), norm(x))


def test_exported_decoders_run_their_norms_as_the_op(tmp_path):
    """A tiny Llama's program: every norm is the op (two a layer and the final one), no rsqrt."""
    import hostswap.llm as llm
    from hostswap.models import tiny_llama
    from hostswap.schedules.pte_program import read_program

    model = tiny_llama()
    pte, _ = llm.export(model, tmp_path / "llama", max_seq_len=16, prefill_chunk=4)
    plan = next(p for p in read_program(pte).execution_plan if p.name == "decode")
    names = [op.name for op in plan.operators]
    assert "hostswap::rms_norm" in names and "aten::rsqrt" not in names
    norms = sum(1 for chain in plan.chains for ins in chain.instructions
                if type(ins.instr_args).__name__ == "KernelCall" and plan.operators[ins.instr_args.op_index].name == "hostswap::rms_norm")
    assert norms == 2 * model.config.num_hidden_layers + 1


def test_an_out_or_weight_that_does_not_fit_is_refused_by_name():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"hostswap::rms_norm.out: out is \(2, 8\) torch.float16, the result is \(2, 8\) torch.bfloat16"):
        torch.ops.hostswap.rms_norm.out(x, 1e-6, torch.bfloat16, out=torch.empty(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out is \(2, 8\) torch.bfloat16, the result is \(2, 8\) torch.float32"):  # a float32 weight promotes
        torch.ops.hostswap.rms_norm.out(x, 1e-6, torch.bfloat16, torch.ones(8), out=torch.empty(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"weight of shape \(4,\) for rows of 8; it takes one value per column"):
        torch.ops.hostswap.rms_norm.out(x, 1e-6, torch.float32, torch.ones(4), out=torch.empty(2, 8))
    with pytest.raises(ValueError, match=r"weight of shape \(1,\) for rows of 8"):  # ATen would broadcast it; the kernel would read past it
        torch.ops.hostswap.rms_norm(x, 1e-6, torch.float32, torch.ones(1))


def _kernel_matches_reference(device: torch.device, dtypes) -> None:
    """The kernel against the ATen ops: float32 results within a few float32 roundings;
    16-bit results differ in at most one unit of the last place, in few values."""
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(1, 1, 2048), (1, 4, 1, 128), (3, 7, 96), (2, 5000), (1, 9000), (6, 1)]
    for shape in shapes:
        for in_dtype in dtypes:
            for norm_dtype in dtypes:
                for weight_dtype in (None, *dtypes):
                    x = (torch.randn(shape, generator=g) * 4).to(in_dtype).to(device)
                    weight = None if weight_dtype is None else (torch.randn(shape[-1], generator=g) + 1).to(weight_dtype).to(device)
                    want = kernel.rms_norm_reference(x, 1e-6, norm_dtype, weight)
                    got = kernel.launch(x, 1e-6, norm_dtype, weight, torch.empty(shape, dtype=want.dtype, device=device))
                    _close(got, want, norm_dtype, (shape, in_dtype, norm_dtype, weight_dtype), units=1 if weight is None else 2)
    # rows that are not contiguous (a permuted view) are read where they lie
    x = torch.randn(8, 4, 64, generator=g).to(device).permute(1, 0, 2)
    _close(kernel.launch(x, 1e-5, torch.float32, None, torch.empty(4, 8, 64, device=device)), kernel.rms_norm_reference(x, 1e-5, torch.float32),
           torch.float32, "permuted")


def _close(got: torch.Tensor, want: torch.Tensor, norm_dtype: torch.dtype, case, units: int = 1) -> None:
    """Within a float32 rounding of the normalized value, or where the normalized value or the
    result is 16-bit, ``units`` of that dtype's last place, in few values (a weight's product
    rounds again: a normalized value one unit off can come out two units off)."""
    assert got.dtype == want.dtype and got.shape == want.shape, case
    coarse = max(norm_dtype, want.dtype, key=lambda d: torch.finfo(d).eps)
    if coarse == torch.float32:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6, msg=str(case))
        return
    a, b = got.float(), want.float()
    ulp = units * torch.finfo(coarse).eps * b.abs().clamp(min=torch.finfo(coarse).tiny)
    assert bool(((a - b).abs() <= ulp).all()), case
    assert (a != b).float().mean().item() < 0.01, case


@needs_triton
def test_kernel_interpreted():
    """On the CPU through Triton's interpreter, in a process of its own (the interpreter is
    chosen when Triton is imported)."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import torch; "
            "from test_fused_rms_norm import _kernel_matches_reference; "
            "_kernel_matches_reference(torch.device('cpu'), (torch.float32,))")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
def test_kernel_on_the_gpu():
    _kernel_matches_reference(torch.device("cuda"), (torch.float32, torch.bfloat16, torch.float16))
    x = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.float32)
    assert kernel.uses_kernel(x, torch.bfloat16, w, torch.empty_like(x, dtype=torch.float32))
    out = torch.ops.hostswap.rms_norm(x, 1e-6, torch.bfloat16, w)
    assert out.dtype == torch.float32 and out.shape == x.shape
