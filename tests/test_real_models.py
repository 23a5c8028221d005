"""The support matrix: transformers architectures x export modes x budgets x policies, bitwise.

Every architecture of tests/real_models.py is exported as a user would (``strict=False``),
normally and under ``torch.no_grad()``, passed through ``apply_weight_offload``, saved, and
run at the floor, at a seeded random budget between floor and total, and at the total,
under both pool policies. Outputs are compared with eager PyTorch on the same inputs: bitwise,
or, for an architecture marked as one where lowering decomposes an op, bitwise with the
lowered edge program and within 1e-5 of eager. The README's support table is rendered from
the same list.
"""

from __future__ import annotations

import contextlib
import os
import random
import zlib

import pytest
import torch
import torch.utils._pytree as pytree

import hostswap
from hostswap.runtime.executor import ProgramError
from real_models import ARCHITECTURES, BY_NAME, EXPORT_MODES, build, support_table

pytest.importorskip("transformers")

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
CASES = [(a.name, mode) for a in ARCHITECTURES if a.refused is None for mode in EXPORT_MODES]
BUDGETS = ("floor", "random", "total")
POLICIES = ("planned", "lru")


def _export_context(mode: str):
    return torch.no_grad() if mode == "export under no_grad" else contextlib.nullcontext()


class ExportedCase:
    """One architecture exported one way, probed, saved; its eager outputs as the reference."""

    def __init__(self, name: str, mode: str, directory: str):
        self.name, self.mode = name, mode
        self.model, self.args, self.kwargs = build(BY_NAME[name])
        with torch.no_grad():
            self.expected = pytree.tree_leaves(self.model(*self.args, **self.kwargs))
        with _export_context(mode):
            self.ep = torch.export.export(self.model, self.args, self.kwargs, strict=False)
        self.ep = hostswap.apply_weight_offload(self.ep)
        stem = "".join(c if c.isalnum() else "_" for c in f"{name}_{mode}")
        self.pte, self.ptd = hostswap.save(self.ep, os.path.join(directory, stem))
        self.schedule = hostswap.schedules.load_weight_schedule(self.pte)
        self._edge_expected = None

    @property
    def inputs(self) -> list:
        return list(self.args) + list(self.kwargs.values())

    def budget_mb(self, which: str) -> float:
        floor, total = self.schedule.floor_bytes, self.schedule.total_bytes
        if which == "floor":
            nbytes = floor
        elif which == "total":
            nbytes = max(total, floor)
        else:
            rng = random.Random(zlib.crc32(f"{self.name}/{self.mode}".encode()))
            nbytes = rng.randint(floor, max(total, floor))
        return nbytes / 2**20

    def edge_expected(self) -> list[torch.Tensor]:
        """Outputs of the lowered edge program: the same kernels as the .pte."""
        if self._edge_expected is None:
            manager = hostswap.to_executorch(self.ep)
            with torch.no_grad():
                self._edge_expected = pytree.tree_leaves(manager.hostswap_edge_program.module()(*self.args, **self.kwargs))
        return self._edge_expected

    def check(self, outputs) -> None:
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        assert len(outputs) == len(self.expected), f"{len(outputs)} outputs, eager has {len(self.expected)}"
        for i, (got, want) in enumerate(zip(outputs, self.expected)):
            got = got.cpu()
            assert got.shape == want.shape and got.dtype == want.dtype, f"output {i}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
            if BY_NAME[self.name].bitwise_to_eager:
                assert torch.equal(got, want), f"output {i} of {self.name} ({self.mode}) differs from eager PyTorch"
            else:
                # lowering decomposes an op: bitwise against the lowered program, close to eager
                assert torch.equal(got, self.edge_expected()[i]), f"output {i} differs from the lowered program"
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


_cases: dict[tuple[str, str], ExportedCase] = {}


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    def get(name: str, mode: str) -> ExportedCase:
        key = (name, mode)
        if key not in _cases:
            _cases[key] = ExportedCase(name, mode, str(tmp_path_factory.mktemp("real_models")))
        return _cases[key]

    return get


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{'no_grad' if 'no_grad' in m else 'grad'}" for n, m in CASES])
def test_bitwise_on_cpu(exported, name, mode, budget, policy):
    case = exported(name, mode)
    with hostswap.runtime.Module(case.pte, data_path=case.ptd, weight_offload_budget_mb=case.budget_mb(budget), device="cpu", policy=policy) as m:
        case.check(m(*case.inputs))
        if budget != "total":
            assert m.stats["bytes_h2d"] > 0 or case.schedule.floor_bytes >= case.schedule.total_bytes


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{'no_grad' if 'no_grad' in m else 'grad'}" for n, m in CASES])
def test_outputs_belong_to_the_caller(exported, name, mode):
    """A second call with other inputs leaves the first call's outputs as they were."""
    case = exported(name, mode)
    other_model, other_args, other_kwargs = build(BY_NAME[name], random_state=7)
    other_inputs = list(other_args) + list(other_kwargs.values())
    with hostswap.runtime.Module(case.pte, data_path=case.ptd, weight_offload_budget_mb=case.budget_mb("floor"), device="cpu") as m:
        first = m(*case.inputs)
        first_leaves = [t.clone() for t in pytree.tree_leaves(first)]
        second = m(*other_inputs)
        for before, now in zip(first_leaves, pytree.tree_leaves(first)):
            assert torch.equal(before, now), "a later call changed an earlier call's output"
        assert any(not torch.equal(a, b) for a, b in zip(pytree.tree_leaves(first), pytree.tree_leaves(second)))
    case.check(first)


def test_export_under_inference_mode(tmp_path):
    model, args, kwargs = build(BY_NAME["Llama"])
    with torch.no_grad():
        expected = pytree.tree_leaves(model(*args))
    with torch.inference_mode():
        ep = torch.export.export(model, args, strict=False)
    ep = hostswap.apply_weight_offload(ep)
    pte, ptd = hostswap.save(ep, tmp_path / "llama_inference_mode")
    floor = hostswap.schedules.load_weight_schedule(pte).floor_bytes
    with hostswap.runtime.Module(pte, data_path=ptd, weight_offload_budget_mb=floor / 2**20, device="cpu") as m:
        assert torch.equal(m(*args), expected[0])


def test_readme_support_table_is_the_matrix():
    with open(README) as f:
        readme = f.read()
    assert support_table() in readme, "README's support table differs from tests/real_models.py: paste `python -m tests.real_models`"


# Architectures with a kernel that reads device data on the host (MoE routing: the experts
# op splits tokens by counts it copies to the host): no CUDA graph can capture them.
HOST_SYNCING = ("Mixtral", "Qwen2-MoE")
GPU_CASES = [(a.name, "export under no_grad") for a in ARCHITECTURES if a.refused is None]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("budget", ("floor", "total"))
@pytest.mark.parametrize("name,mode", GPU_CASES, ids=[n for n, _ in GPU_CASES])
def test_matrix_on_gpu(exported, name, mode, budget, policy):
    case = exported(name, mode)
    _, other_args, other_kwargs = build(BY_NAME[name], random_state=7)
    other = [t.cuda() for t in list(other_args) + list(other_kwargs.values())]
    cuda_graph = policy == "planned" and budget == "floor"  # the captured forward's outputs are the caller's too
    if cuda_graph and name in HOST_SYNCING:
        with hostswap.runtime.Module(case.pte, data_path=case.ptd, weight_offload_budget_mb=case.budget_mb(budget), device="cuda", cuda_graph=True) as m:
            for _ in range(2):  # refused for good: the pool was left mid-forward
                with pytest.raises(ProgramError, match="cannot be captured as a CUDA graph .* synchronizes with the host"):
                    m(*[t.cuda() for t in case.inputs])
        cuda_graph = False
    with hostswap.runtime.Module(case.pte, data_path=case.ptd, weight_offload_budget_mb=case.budget_mb(budget), device="cuda", policy=policy, cuda_graph=cuda_graph) as m:
        inputs = [t.cuda() for t in case.inputs]
        first = m(*inputs)
        kept = [t.clone() for t in pytree.tree_leaves(first)]
        m(*other)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(kept, pytree.tree_leaves(first))), "a later call changed an earlier output"
        # reference: eager PyTorch on the same GPU (the CPU reference differs by kernel choice)
        model = build(BY_NAME[name])[0].cuda()
        with torch.no_grad():
            expected = pytree.tree_leaves(model(*inputs[: len(case.args)], **{k: v.cuda() for k, v in case.kwargs.items()}))
        for i, (got, want) in enumerate(zip(pytree.tree_leaves(first), expected)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m, i=i: f"output {i} of {name} on the GPU: {m}")
