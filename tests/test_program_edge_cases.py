"""Programs that real models produce and that the built-in ones did not: constants of every
kind, checks that lowering deletes, custom ops without an out variant."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hostswap
from hostswap.passes.graph_facts import is_probe, reads_no_data
from hostswap.runtime.instructions import FunctionalAsOut, ProgramError, resolve_operator
from hostswap.runtime.method_loader import LoadedMethod
from hostswap.schedules.pte_program import plan_by_name, read_program

MB = 2**20


class EveryConstant(torch.nn.Module):
    """Tensor constants (plain tensor attributes) of every kind, one of them read twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)
        self.scale = torch.tensor(2.5)  # 0-d, read by two kernels
        self.mask = torch.tensor([True, False, True])  # bool
        self.index = torch.tensor([2, 0, 1])  # int64
        self.transposed = torch.randn(3, 4).t()  # dense, not contiguous

    def forward(self, x):
        y = self.lin(x) * self.scale
        y = torch.where(self.mask, y, -y)
        y = y[:, self.index] + y * self.scale
        return y + (x @ self.transposed) + 1e-6  # the scalar becomes a constant of the lowered program


def _save(model, args, path, no_grad=False):
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        ep = torch.export.export(model, args, strict=False)
    ep = hostswap.apply_weight_offload(ep)
    pte, ptd = hostswap.save(ep, path)
    return ep, pte, ptd, hostswap.schedules.load_weight_schedule(pte)


@pytest.fixture(scope="module")
def every_constant(tmp_path_factory):
    model = EveryConstant().eval()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    return (model, x, *_save(model, (x,), tmp_path_factory.mktemp("constants") / "m"))


@pytest.mark.parametrize("policy", ["planned", "lru"])
@pytest.mark.parametrize("where", ["floor", "total"])
def test_constants_of_every_kind_bitwise(every_constant, policy, where):
    model, x, ep, pte, ptd, schedule = every_constant
    assert {"scale", "mask", "index", "transposed"} <= set(schedule.fqns)
    assert schedule.probe_fqns().count("scale") == 2  # one probe per (kernel, weight) use
    budget = schedule.floor_bytes if where == "floor" else schedule.total_bytes + MB
    # Bitwise the exported program; eager reads the transposed constant strided, the program
    # contiguous, and which BLAS kernel that picks, and so the last bit, depends on the CPU.
    with torch.no_grad():
        exported, eager = ep.module()(x), model(x)
    torch.testing.assert_close(exported, eager, rtol=1e-6, atol=1e-6)
    with hostswap.runtime.Module(pte, ptd, weight_offload_budget_mb=budget / MB, device="cpu", policy=policy) as m:
        for _ in range(2):
            assert torch.equal(m(x), exported)


def test_transposed_constant_stored_contiguous_with_its_values(every_constant):
    model, x, ep, *_ = every_constant
    assert ep.constants["transposed"].is_contiguous()
    assert torch.equal(ep.constants["transposed"], model.transposed)


def test_constant_read_only_within_its_slot(every_constant):
    """A constant the program carries inline is read as exactly its bytes, which must lie in
    its slot of the constant buffer; a short slot is refused at load, naming the constant."""
    *_, pte, ptd, schedule = every_constant
    program = read_program(pte)
    plan = plan_by_name(program, "forward")
    inline = [v.val for v in plan.values if type(v.val).__name__ == "Tensor" and v.val.data_buffer_idx > 0 and v.val.allocation_info is None
              and (v.val.extra_tensor_info is None or v.val.extra_tensor_info.location.name != "EXTERNAL")]
    assert inline, "lowering lifted the scalar into an inline constant"
    LoadedMethod(program, plan, torch.device("cpu"), weights=lambda fqn: None)  # every slot holds its constant
    t = inline[0]
    program.constant_buffer[t.data_buffer_idx].storage = b"\0"
    with pytest.raises(ProgramError, match=rf"constant tensor {t.data_buffer_idx} of shape .* needs \d+ bytes, its slot of the constant buffer holds 1"):
        LoadedMethod(program, plan, torch.device("cpu"), weights=lambda fqn: None)


class CastsItsBuffer(torch.nn.Module):
    """``.to()`` on a buffer: export under no_grad records an ``_assert_tensor_metadata`` on it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("freq", torch.rand(8), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.freq.to(x.device, torch.float32)[None, :]


def test_no_probe_in_front_of_a_check(tmp_path):
    model = CastsItsBuffer().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        exported = torch.export.export(model, (x,), strict=False)
    checks = [n for n in exported.graph.nodes if reads_no_data(n)]
    assert checks, "export recorded a check on the buffer"
    ep = hostswap.apply_weight_offload(exported)
    assert not any(is_probe(a) for n in ep.graph.nodes if reads_no_data(n) for a in n.all_input_nodes)
    pte, ptd = hostswap.save(ep, tmp_path / "m")
    lowered = hostswap.schedules.load_weight_schedule(pte)
    assert lowered.probe_fqns() == hostswap.get_weight_schedule(ep).probe_fqns()
    with hostswap.runtime.Module(pte, ptd, weight_offload_budget_mb=lowered.floor_bytes / MB, device="cpu") as m:
        assert torch.equal(m(x), model(x))


# --- custom ops ---------------------------------------------------------------------------------
@torch.library.custom_op("hostswap_test::rowscale", mutates_args=())
def rowscale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w.sum(dim=1)


@rowscale.register_fake
def _(x, w):
    return torch.empty_like(x)


@torch.library.custom_op("hostswap_test::split_pair", mutates_args=())
def split_pair(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    return [x * w[0], x * w[1]]


@split_pair.register_fake
def _(x, w):
    return [torch.empty_like(x), torch.empty_like(x)]


class UsesCustomOp(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Module()
        self.inner.w = torch.nn.Parameter(torch.randn(6, 3))
        self.op = op

    def forward(self, x):
        out = self.op(x, self.inner.w)
        return out if isinstance(out, torch.Tensor) else out[0] + out[1]


class Inner(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 6))
        self.op = op

    def forward(self, x):
        out = self.op(x, self.w)
        return out[0] + out[1]


class Outer(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        torch.manual_seed(0)
        self.block = Inner(op)

    def forward(self, x):
        return self.block(x)


def test_custom_op_without_out_variant_runs_bitwise(tmp_path):
    model = UsesCustomOp(rowscale).eval()
    x = torch.randn(4, 6)
    with torch.no_grad():
        expected = model(x)
    _, pte, ptd, schedule = _save(model, (x,), tmp_path / "m", no_grad=True)
    assert schedule.kernel_ops == ("hostswap_test::rowscale.default",)  # the schedule names the edge op
    with hostswap.runtime.Module(pte, ptd, weight_offload_budget_mb=schedule.floor_bytes / MB, device="cpu") as m:
        assert torch.equal(m(x), expected)


_test_library = torch.library.Library("hostswap_test", "FRAGMENT")
_test_library.define("halve(Tensor x) -> Tensor")
_test_library.impl("halve", lambda x: x / 2, "CompositeExplicitAutograd")


def test_functional_op_runs_as_its_out_variant_where_that_is_not_registered():
    """The runtime's own stand-in, for a process that never lowered the op."""
    op = resolve_operator("hostswap_test::halve", "out")
    assert isinstance(op, FunctionalAsOut)
    assert [a.name for a in op._schema.arguments] == ["x", "out"] and op._schema.arguments[1].kwarg_only
    out = torch.empty(3)
    assert op(torch.tensor([2.0, 4.0, 6.0]), out=out) is out and torch.equal(out, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ProgramError, match="operator hostswap_test::no_such_op has no PyTorch kernel in this process"):
        resolve_operator("hostswap_test::no_such_op", "out")


def test_custom_op_that_cannot_have_an_out_variant_is_refused_naming_op_and_module(tmp_path):
    model = Outer(split_pair).eval()
    x = torch.randn(4, 6)
    with torch.no_grad():
        ep = hostswap.apply_weight_offload(torch.export.export(model, (x,), strict=False))
    with pytest.raises(hostswap.OutVariantError, match=r"custom op hostswap_test::split_pair.default, used by module 'block', .* returns a List\[Tensor\]"):
        hostswap.save(ep, tmp_path / "m")
    assert not list(tmp_path.iterdir()), "nothing is written for a refused program"


def test_permuted_weight_read_through_its_strides_is_refused(tmp_path):
    class ViewsTransposed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 3).t())

        def forward(self, x):
            return x * self.w.t().view(12).sum()

    ep = torch.export.export(ViewsTransposed(), (torch.randn(2),), strict=False)
    before = ep.state_dict["w"]
    with pytest.raises(hostswap.WeightOffloadError, match=r"weight 'w' is not contiguous \(stride \(1, 3\)\) and 'view' .* views it through its strides"):
        hostswap.apply_weight_offload(ep)
    assert ep.state_dict["w"] is before and not any(is_probe(n) for n in ep.graph.nodes)  # left as it was


def test_custom_op_with_an_argument_named_out_is_refused(tmp_path):
    _test_library.define("takes_out(Tensor x, Tensor out) -> Tensor")
    _test_library.impl("takes_out", lambda x, out: x + out, "CompositeExplicitAutograd")
    _test_library._register_fake("takes_out", lambda x, out: torch.empty_like(x))

    class UsesIt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return torch.ops.hostswap_test.takes_out(x, self.w)

    ep = hostswap.apply_weight_offload(torch.export.export(UsesIt(), (torch.randn(3),), strict=False))
    with pytest.raises(hostswap.OutVariantError, match="has an argument named 'out'"):
        hostswap.save(ep, tmp_path / "m")


_BIG = [float(i) for i in range(300_000)]  # 1.2 MB as float32


class CreatesConstants(torch.nn.Module):
    def __init__(self, big: bool):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.big = big

    def forward(self, x):
        y = self.lin(x) * torch.tensor(3.0)  # a tensor created in forward: a lifted constant
        return y + torch.tensor(_BIG)[:4].sum() if self.big else y


def test_constant_created_in_forward_stays_in_the_program(tmp_path):
    model = CreatesConstants(big=False).eval()
    x = torch.randn(2, 4)
    ep = torch.export.export(model, (x,), strict=False)
    lifted = [s.target for s in ep.graph_signature.input_specs if s.target and "lifted_tensor" in s.target]
    assert lifted, "export lifted the tensor created in forward"
    ep = hostswap.apply_weight_offload(ep)
    pte, ptd = hostswap.save(ep, tmp_path / "m")
    schedule = hostswap.schedules.load_weight_schedule(pte)
    assert not set(lifted) & set(schedule.fqns)  # inline in the .pte, not streamed
    with hostswap.runtime.Module(pte, ptd, weight_offload_budget_mb=schedule.floor_bytes / MB, device="cpu") as m:
        assert torch.equal(m(x), model(x))


def test_large_constant_created_in_forward_is_refused():
    ep = torch.export.export(CreatesConstants(big=True).eval(), (torch.randn(2, 4),), strict=False)
    with pytest.raises(hostswap.WeightOffloadError, match=r"tensor constant '.*lifted_tensor.*' \(1200000 bytes\) is created inside forward"):
        hostswap.apply_weight_offload(ep)


class FillsAnEmptyTensor(torch.nn.Module):
    """``new_empty`` then written in two slices (DeepSeek-V3 builds its keys so): lowered to
    ExecuTorch's ``_empty_dim_order``, which runs without a memory format beside its out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        joined = y.new_empty(*y.shape[:-1], 12)
        joined[..., :8].copy_(y)
        joined[..., 8:].copy_(y[..., :4] * 2)
        return joined


def test_an_empty_tensor_filled_in_slices(tmp_path):
    model = FillsAnEmptyTensor().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        exported = torch.export.export(model, (x,), strict=False)
    pte, ptd = hostswap.save(hostswap.apply_weight_offload(exported), tmp_path / "m")
    lowered = hostswap.schedules.load_weight_schedule(pte)
    with hostswap.runtime.Module(pte, ptd, weight_offload_budget_mb=lowered.floor_bytes / MB, device="cpu") as m:
        assert torch.equal(m(x), model(x))
