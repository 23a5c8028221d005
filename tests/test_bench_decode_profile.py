"""bench/decode_profile.py's reading of a profiler trace, on a synthetic one (no GPU)."""

import pytest

import bench_scripts

_profile = bench_scripts.load("decode_profile")
Fill, replay_timeline, budget_bytes = _profile.Fill, _profile.replay_timeline, _profile.budget_bytes


def _event(cat, name, ts, dur, correlation, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation, **args}}


def _trace():
    """Two replays of a forward with two fills: A (no wait) then B (waits for kernel 0)."""
    events = []
    for start, correlation in ((0.0, 7), (100.0, 9)):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": start - 50, "dur": 5, "args": {"correlation": correlation}})
        events.append(_event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", start + 10, 20, correlation, bytes=2000))  # fill A
        events.append(_event("kernel", "mm", start + 30, 30, correlation))  # kernel 0 reads A
        events.append(_event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", start + 60, 20, correlation, bytes=2000))  # fill B after kernel 0
        events.append(_event("kernel", "mm", start + 80, 15, correlation))
        events.append(_event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", start + 96, 1, correlation, bytes=8))
    events.append(_event("kernel", "prefill", -500, 100, 3))  # not a replay's: left out
    return events


def test_gaps_are_charged_to_the_fill_they_precede():
    fills = [Fill("a", 2000, -1), Fill("b", 2000, 0)]
    t = replay_timeline(_trace(), fills)
    assert t["replays"] == 2 and t["copies_per_replay"] == 2
    assert t["span_us_per_replay"] == pytest.approx((197 - 10) / 2)
    assert t["copy_busy_us_per_replay"] == 40 and t["copy_bytes_per_s_while_busy"] == pytest.approx(8000 / 80e-6)
    assert t["kernel_busy_us_per_replay"] == 45
    gaps = {g["weight"]: g["mean_gap_us"] for g in t["gaps"]}
    assert gaps == {"b": 30, "a": 30}  # b waited for kernel 0 (30 us); a: from replay 0's last copy to replay 1's first
    assert t["gap_before_unwaited_fills_us_per_replay"] == 30 and t["copy_gap_us_per_replay"] == 60


def test_errors_name_the_mismatch():
    with pytest.raises(ValueError, match="4 host-to-device copies in 2 replays, but the layout issues 3 fills per forward"):
        replay_timeline(_trace(), [Fill("a", 1, -1)] * 3)
    with pytest.raises(ValueError, match="no GPU work of a graph replay"):
        replay_timeline([e for e in _trace() if e["name"] != "cudaGraphLaunch"], [Fill("a", 1, -1)])


def test_budget_names():
    class Schedule:
        floor_bytes, total_bytes = 10 * 2**20, 100 * 2**20

    assert budget_bytes("floor", Schedule) == 10 * 2**20
    assert budget_bytes("50%", Schedule) == 50 * 2**20 and budget_bytes("5%", Schedule) == 10 * 2**20
    assert budget_bytes("100%", Schedule) == 101 * 2**20
    assert budget_bytes("20.5MiB", Schedule) == int(20.5 * 2**20)
    with pytest.raises(ValueError, match="budget '3GB'"):
        budget_bytes("3GB", Schedule)


def test_layout_fills_are_the_copies_the_pool_issues(tmp_path):
    """layout_fills gives one Fill per copy a planned forward issues, in issue order, with its
    bytes, so that a trace's copies map one to one (an int8 program: data and scale fills)."""
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    import hostswap
    from hostswap.runtime import Module

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).eval()
    quantize_(model, Int8WeightOnlyConfig())
    x = torch.randn(1, 256)
    hostswap.prepare_quantized(model)
    pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, (x,))), tmp_path / "q")
    schedule = hostswap.schedules.load_weight_schedule(pte)
    with Module(pte, ptd, weight_offload_budget_mb=schedule.floor_bytes / 2**20, device="cpu", policy="planned") as m:
        m(x)
        fills = _profile.layout_fills(m)
        assert len(fills) == len(m.pool.layout.fill_offset) > 0
        assert sum(f.nbytes for f in fills) == m.stats["bytes_h2d"]
        assert any(f.weight.endswith("scale") for f in fills) and any(f.weight.endswith("qdata") for f in fills)
