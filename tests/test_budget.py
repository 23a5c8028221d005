"""The weight budget: "auto" arithmetic, its refusal, and the argument checks."""

from __future__ import annotations

import math

import pytest

import hostswap
from hostswap.runtime.budget import AUTO_MARGIN_MIN_BYTES, auto_budget, check_budget_argument
from hostswap.schedules.policies import BudgetError

MiB, GiB = 2**20, 2**30


def test_auto_takes_the_free_memory_less_state_activations_and_margin():
    auto = auto_budget(free_bytes=10 * GiB, total_bytes=80 * GiB, state_bytes=1 * GiB, activation_bytes=GiB // 2,
                       weight_bytes=20 * GiB, floor_bytes=GiB)
    assert auto.margin_bytes == 4 * GiB  # 5 % of the device
    assert auto.budget_bytes == 10 * GiB - GiB - GiB // 2 - 4 * GiB
    assert not auto.all_resident
    text = auto.explain("cuda:0")
    assert "4608.0 MiB of 20480.0 MiB of weights, the rest streamed" in text
    assert "10240.0 MiB free on cuda:0 - KV cache and other state 1024.0 MiB - activations 512.0 MiB - margin 4096.0 MiB = 4608.0 MiB" in text


def test_auto_is_capped_at_the_weights_and_keeps_a_least_margin():
    auto = auto_budget(free_bytes=3 * GiB, total_bytes=4 * GiB, state_bytes=0, activation_bytes=0, weight_bytes=GiB, floor_bytes=GiB // 4)
    assert auto.margin_bytes == AUTO_MARGIN_MIN_BYTES  # 5 % of 4 GiB is less
    assert auto.budget_bytes == GiB and auto.all_resident
    assert "every weight resident" in auto.explain("cuda:0")


def test_auto_is_at_least_the_floor_where_the_floor_exceeds_the_weights():
    """A small model with a large head: its two largest kernels and the prefetch headroom come to
    more than all its weights, and "auto" takes the floor (it loaded nothing before)."""
    auto = auto_budget(free_bytes=3 * GiB, total_bytes=4 * GiB, state_bytes=0, activation_bytes=0, weight_bytes=GiB // 4, floor_bytes=GiB // 3)
    assert auto.budget_bytes == GiB // 3 and auto.all_resident


def test_auto_below_the_floor_fails_with_both_numbers():
    with pytest.raises(BudgetError) as e:
        auto_budget(free_bytes=2 * GiB, total_bytes=16 * GiB, state_bytes=GiB, activation_bytes=100 * MiB, weight_bytes=8 * GiB,
                    floor_bytes=300 * MiB, device="cuda:0")
    message = str(e.value)
    # 2048 - 1024 - 100 - 819.2 (5 % of 16 GiB) = 104.8 MiB left, floor 300 MB
    assert "cuda:0 has 2048.0 MiB free" in message and "KV cache and other state (1024.0 MiB)" in message
    assert "104.8 MiB is left for weights, below this program's floor of 314572800 bytes (300 MB)" in message
    assert "shorter max_seq_len" in message


@pytest.mark.parametrize("bad,match", [
    ("big", "a number of MB or 'auto', got 'big'"),
    (True, "a number of MB or 'auto', got True"),
    (None, "a number of MB or 'auto', got None"),
    (0, "above 0, got 0"),
    (-5.0, "above 0, got -5.0"),
    (math.nan, "above 0, got nan"),
])
def test_budget_argument_errors_name_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        check_budget_argument(bad)


def test_module_auto_takes_every_weight_where_memory_allows(lowered_by_name):
    """A Module loaded with "auto" on the CPU (gigabytes of RAM for a few MB of weights) holds
    every weight; the refusal below the floor is the arithmetic's, tested above."""
    lowered = lowered_by_name("demo_transformer")
    with hostswap.runtime.Module(lowered.pte, lowered.ptd, weight_offload_budget_mb="auto", device="cpu") as m:
        assert m.auto_budget.all_resident and m.budget_bytes == m.schedule.resident_bytes
        assert m.auto_budget.floor_bytes == m.schedule.floor_bytes


def test_cpu_free_memory_counts_the_page_cache_the_kernel_can_drop():
    """On the CPU "auto" counts MemAvailable, not free pages alone: after a checkpoint is read most
    of the RAM is page cache, and a budget from free pages would refuse a program that fits."""
    import torch

    from hostswap.runtime.budget import free_memory
    from hostswap.runtime.host_memory import _read, cgroup_room

    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    room = cgroup_room(_read("/proc/self/cgroup"), _read)
    expected = meminfo["MemAvailable"] if room is None else min(meminfo["MemAvailable"], room)
    assert abs(free_memory(torch.device("cpu")) - expected) < 256 * MiB
