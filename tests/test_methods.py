"""Programs with several methods that read the same weights: one pool serves them all."""

from __future__ import annotations

import pytest
import torch

import hostswap
from hostswap.models import demo_transformer
from hostswap.runtime import Module, ProgramError
from hostswap.schedules import load_weight_schedule
from hostswap.schedules.floor import aligned

MB = 2**20


@pytest.fixture(scope="module")
def two_lengths(tmp_path_factory):
    """The demo transformer exported for 32 tokens ("long") and for one ("short")."""
    model, (tokens,) = demo_transformer(random_state=0)
    short = tokens[:, :1].clone()
    programs = {
        "long": hostswap.apply_weight_offload(torch.export.export(model, (tokens,))),
        "short": hostswap.apply_weight_offload(torch.export.export(model, (short,))),
    }
    pte, ptd = hostswap.save(programs, tmp_path_factory.mktemp("methods") / "demo")
    with torch.no_grad():
        expected = {"long": model(tokens), "short": model(short)}
    return pte, ptd, {"long": tokens, "short": short}, expected


def test_each_method_has_its_schedule_and_the_floor_is_theirs(two_lengths):
    pte, *_ = two_lengths
    schedules = hostswap.schedules.load_weight_schedules(pte)
    assert list(schedules) == ["long", "short"]
    assert schedules["long"].same_order(schedules["short"])
    assert load_weight_schedule(pte, "short").floor_bytes == schedules["short"].floor_bytes
    with pytest.raises(hostswap.schedules.ScheduleError, match=r"methods \['long', 'short'\]; name one"):
        load_weight_schedule(pte)
    with pytest.raises(hostswap.schedules.ScheduleError, match="no schedule for method 'forward'"):
        load_weight_schedule(pte, "forward")


@pytest.mark.parametrize("policy", ["planned", "lru"])
def test_one_pool_serves_both_methods_bitwise(two_lengths, policy):
    """Calls alternate between the methods: outputs are bitwise eager's, and a planned pool
    copies exactly its plan's streamed bytes per call, whichever method runs: weights kept
    resident for one method are never fetched again for the other."""
    pte, ptd, inputs, expected = two_lengths
    schedule = load_weight_schedule(pte, "long")
    total = sum(aligned(b) for b in schedule.weight_bytes)
    for budget in (schedule.floor_bytes, (schedule.floor_bytes + total) // 2):
        with Module(pte, ptd, weight_offload_budget_mb=budget / MB, device="cpu", policy=policy) as m:
            order = ["long", "short", "short", "long", "short"]
            for name in order:
                (y,) = m.run_method(name, [inputs[name]])
                assert torch.equal(y, expected[name]), (name, budget)
            stats = m.stats
            assert stats["forwards"] == len(order)
            assert stats["peak_weight_bytes"] <= budget
            if policy == "planned":
                assert stats["bytes_h2d"] == len(order) * m.pool.layout.streamed_bytes
                assert m.pool.layout.resident, "the mid budget keeps weights resident"  if budget > schedule.floor_bytes else True


class _Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)


class _AB(_Pair):
    def forward(self, x):
        return self.b(self.a(x))


class _BA(_Pair):
    def forward(self, x):
        return self.a(self.b(x))


def test_error_methods_reading_weights_in_different_orders(tmp_path):
    ab, ba = _AB(), _BA()
    ba.load_state_dict(ab.state_dict())
    x = torch.randn(2, 8)
    programs = {name: hostswap.apply_weight_offload(torch.export.export(m, (x,))) for name, m in (("ab", ab), ("ba", ba))}
    pte, ptd = hostswap.save(programs, tmp_path / "pair")
    with pytest.raises(ProgramError, match="methods 'ab' and 'ba' read their weights in different orders"):
        Module(pte, ptd, weight_offload_budget_mb=1, device="cpu")


def test_error_cuda_graph_names_a_method_the_program_lacks(two_lengths):
    pte, ptd, *_ = two_lengths
    with pytest.raises(ValueError, match=r"cuda_graph names \['decode'\], which are not methods"):
        Module(pte, ptd, weight_offload_budget_mb=1, device="cpu", cuda_graph=("decode",))
    # a bare name is not read as its letters
    with pytest.raises(ValueError, match=r"cuda_graph must be True, False or a tuple of method names, got 'decode'"):
        Module(pte, ptd, weight_offload_budget_mb=1, device="cpu", cuda_graph="decode")


def test_error_device_memory_names_weights_state_and_activations():
    from hostswap.runtime.budget import check_device_memory
    from hostswap.runtime.pool import PoolCreationError

    check_device_memory("cuda:0", 100 * MB, 20 * MB, 5 * MB, 125 * MB)  # fits exactly
    with pytest.raises(PoolCreationError, match=r"cuda:0 has 124.0 MiB free; this program needs 125.0 MiB: weights 100.0 MiB \(the budget\), "
                                                r"state such as a KV cache 20.0 MiB, activations 5.0 MiB"):
        check_device_memory("cuda:0", 100 * MB, 20 * MB, 5 * MB, 124 * MB)
