"""Floor (against brute force), lowered schedule, constant-method round trip, inspect CLI."""

import dataclasses
import json

import pytest
import torch

import hostswap
from hostswap import models
from hostswap.cli import main as cli_main
from hostswap.schedules import ScheduleError, load_weight_schedule
from hostswap.schedules.floor import StreamSequence, aligned, ring_is_safe, ring_step
from hostswap.schedules.policies import BudgetError, LruPolicy, lru_streamed_bytes, plan_layout


def brute_force_protected_peak(schedule) -> int:
    """Literal replay of the runtime's protection rule over the probe/launch event sequence.

    At each probe the runtime protects the probe's weight and the next ``d`` probes' weights
    until the launch of the kernel after their reader; record the largest protected set.
    """
    pinned = {schedule.fqns.index(f) for f in schedule.pin}
    size = [aligned(b) for b in schedule.weight_bytes]
    until = {}
    launched = 0
    peak = 0
    for p in range(schedule.num_probes):
        for q in range(p, min(p + schedule.prefetch_depth, schedule.num_probes - 1) + 1):
            w = schedule.probe_weight[q]
            if w not in pinned:
                until[w] = max(until.get(w, -1), schedule.probe_kernel[q] + 1)
        protected = {w for w, u in until.items() if launched <= u}
        peak = max(peak, sum(size[w] for w in protected))
        if p + 1 == schedule.num_probes or schedule.probe_kernel[p + 1] != schedule.probe_kernel[p]:
            launched = schedule.probe_kernel[p] + 1
    return peak


def _run_lru(schedule, capacity_override=None, forwards=2):
    policy = LruPolicy(schedule, schedule.floor_bytes)
    if capacity_override is not None:
        policy.capacity = capacity_override
    for _ in range(forwards):
        policy.begin_forward()
        for p in range(schedule.num_probes):
            policy.on_probe(p)
            if p + 1 == schedule.num_probes or schedule.probe_kernel[p + 1] != schedule.probe_kernel[p]:
                policy.kernel_launched(schedule.probe_kernel[p])
    return policy


def test_floor_equals_brute_force(lowered):
    s = lowered.schedule
    assert s.floor.lru_bytes == brute_force_protected_peak(s)


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_floor_is_safe_and_tight_for_lru(lowered_by_name, depth):
    base = lowered_by_name("demo_transformer")
    s = dataclasses.replace(base.schedule, prefetch_depth=depth)
    assert s.floor.lru_bytes == brute_force_protected_peak(s)
    policy = _run_lru(s)  # at the floor: never needs to evict a protected weight
    assert policy.peak_used <= s.floor_bytes
    with pytest.raises(BudgetError, match="protected"):
        _run_lru(s, capacity_override=s.floor.lru_bytes - 1)


def test_floor_is_tight_pair_not_model(lowered_by_name):
    s = lowered_by_name("demo_transformer").schedule
    # a deep model's floor is a couple of kernels plus headroom, far below the total
    assert s.floor_bytes < 0.75 * s.total_bytes
    assert s.floor.pair_bytes == max(a + b for a, b in zip(s.kernel_weight_bytes(), s.kernel_weight_bytes()[1:])) or s.floor.pair_bytes <= max(s.kernel_weight_bytes()) * 2


def test_planned_ring_safe_at_floor_and_not_below(lowered):
    s = lowered.schedule
    layout = plan_layout(s, s.floor_bytes)
    assert layout.arena_bytes <= s.floor_bytes
    seq = StreamSequence(s.probe_weight, s.probe_kernel, s.num_kernels, tuple(aligned(b) for b in s.weight_bytes))
    assert ring_is_safe(seq, s.prefetch_depth, s.floor.ring_bytes)
    if s.floor.ring_bytes > s.floor.lru_bytes:
        assert not ring_is_safe(seq, s.prefetch_depth, s.floor.ring_bytes - ring_step(seq))


def test_planned_keeps_resident_what_the_budget_allows(lowered):
    s = lowered.schedule
    total = sum(aligned(b) for b in s.weight_bytes)
    assert plan_layout(s, total).streamed_bytes == 0
    for budget in (s.floor_bytes, (s.floor_bytes + total) // 2):
        layout = plan_layout(s, budget)
        assert layout.arena_bytes <= budget
        # streams no more than what was not kept resident
        assert layout.streamed_bytes <= sum(s.weight_bytes[w] * s.probe_weight.count(w) for w in range(len(s.fqns)) if w not in layout.resident)
        assert lru_streamed_bytes(s, budget) >= 0


def test_budget_below_floor_names_required_mb(lowered_by_name):
    s = lowered_by_name("nonuniform").schedule
    with pytest.raises(BudgetError, match=rf"at least {s.floor_bytes} bytes \({-(-s.floor_bytes // 2**20)} MB\)"):
        plan_layout(s, s.floor_bytes - 1)


def test_lowered_schedule_matches_pass_schedule(lowered):
    stored = load_weight_schedule(lowered.pte)
    assert stored.same_order(lowered.schedule)
    assert stored.floor_bytes == lowered.schedule.floor_bytes
    assert stored.weight_bytes == lowered.schedule.weight_bytes


def test_constant_method_round_trip_is_exact(lowered):
    stored = load_weight_schedule(lowered.pte)
    manager_schedule = hostswap.to_executorch(lowered.ep).hostswap_schedule if lowered.expected_uses < 30 else stored
    assert stored == manager_schedule
    assert stored.floor == manager_schedule.floor


def test_ptd_holds_the_weights_by_fqn(lowered):
    from executorch.extension.flat_tensor.serialize.serialize import _deserialize_to_flat_tensor

    flat = _deserialize_to_flat_tensor(open(lowered.ptd, "rb").read())
    keys = {entry.key for entry in flat.named_data}
    assert set(lowered.schedule.fqns) <= keys


def test_error_to_executorch_without_pass():
    ep = torch.export.export(models.NonUniformMLP(), (torch.randn(2, 32),))
    with pytest.raises(hostswap.WeightOffloadError, match="not passed through"):
        hostswap.to_executorch(ep)


def test_error_schedule_from_foreign_pte(tmp_path):
    from executorch.exir import to_edge

    ep = torch.export.export(models.NonUniformMLP(), (torch.randn(2, 32),))
    path = tmp_path / "plain.pte"
    path.write_bytes(to_edge(ep).to_executorch().buffer)
    with pytest.raises(hostswap.ArtifactError, match="not saved by hostswap.save"):
        load_weight_schedule(path)
    with pytest.raises(hostswap.ArtifactError, match="not an ExecuTorch program"):
        load_weight_schedule(b"definitely not a program")


def test_inspect_cli_table_json_plot(lowered_by_name, tmp_path, capsys):
    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    budget_mb = s.floor_bytes * 1.5 / 2**20
    assert cli_main(["inspect", demo.pte, "--budget-mb", str(budget_mb), "--plot", str(tmp_path / "s.svg")]) == 0
    text = capsys.readouterr().out
    for needle in ("Summary", "Access order", "Floor set by kernels", "lru", "planned", "layers.0.q_proj.weight"):
        assert needle in text
    assert (tmp_path / "s.svg").read_text().lstrip().startswith("<?xml")
    assert cli_main(["inspect", demo.pte, "--format", "json", "--budget-mb", "0.01", "--plot", str(tmp_path / "s.png")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["floor_bytes"] == s.floor_bytes
    assert report["budget"]["loads"] is False and report["budget"]["required_mb"] == -(-s.floor_bytes // 2**20)
    assert len(report["access_order"]) == s.num_probes
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_inspect_cli_bad_file(tmp_path, capsys):
    bad = tmp_path / "x.pte"
    bad.write_bytes(b"nope")
    assert cli_main(["inspect", str(bad)]) == 2
    assert "not an ExecuTorch program" in capsys.readouterr().err
    assert cli_main(["inspect", str(tmp_path / "missing.pte")]) == 2


def test_planned_keeps_resident_all_but_what_streaming_needs():
    """The streaming-bytes target on the benchmark's model (weights on the meta device: no data)."""
    import dataclasses

    from hostswap.models import llama_decoder
    from hostswap.schedules.policies import plan_layout

    model = llama_decoder(3, device="meta")
    ep = hostswap.apply_weight_offload(torch.export.export(model, (torch.zeros(1, 1, dtype=torch.long, device="meta"),)))
    schedule = hostswap.get_weight_schedule(ep)
    total = schedule.total_bytes
    for depth in (0, 1, 2, 4):
        s = dataclasses.replace(schedule, prefetch_depth=depth)
        for budget in (s.floor_bytes, int(0.5 * total), int(0.75 * total), total):
            budget = max(budget, s.floor_bytes)
            layout = plan_layout(s, budget)
            assert layout.resident_bytes + layout.ring_bytes <= budget
            # within 3 %: the resident set is whole weights, the ring a multiple of ring_step()
            assert layout.streamed_bytes <= 1.03 * (total - (budget - s.floor_bytes)), (depth, budget)


def _meta_llama_schedule(layers):
    from hostswap.models import llama_decoder

    model = llama_decoder(layers, device="meta")
    ep = hostswap.apply_weight_offload(torch.export.export(model, (torch.zeros(1, 1, dtype=torch.long, device="meta"),)))
    return hostswap.get_weight_schedule(ep)


def test_spread_streamed_keeps_bytes_and_spaces_each_size_class_evenly():
    from hostswap.schedules.policies import _spread_streamed

    s = _meta_llama_schedule(4)
    sizes = [aligned(b) for b in s.weight_bytes]
    order = sorted(range(len(sizes)), key=s.probe_weight.index)
    # the worst case for overlap: everything of the first half resident, the second half streamed
    kept = set(order[: len(order) // 2])
    spread = _spread_streamed(s, sizes, kept, set())
    assert sum(sizes[w] for w in spread) == sum(sizes[w] for w in kept)
    for size in set(sizes):
        members = [w for w in order if sizes[w] == size]
        streamed = [i for i, w in enumerate(members) if w not in spread]
        assert len(streamed) == sum(1 for w in members if w not in kept)
        if len(streamed) > 1:
            gaps = [b - a for a, b in zip(streamed, streamed[1:])]
            assert max(gaps) - min(gaps) <= 1, (size, streamed)
        if 0 < len(streamed) < len(members):
            # the forward ends on a streamed weight of the class (a short tail after the
            # last copy) and starts on a resident one
            assert streamed[-1] == len(members) - 1 and streamed[0] > 0, (size, streamed)


@pytest.mark.parametrize("depth", [1, 4])
def test_planned_streams_in_every_layer_not_in_a_block(depth):
    """Below the total, every decoder layer after the first streams something: no stretch of
    resident layers leaves the copy stream idle while a later stretch is copy-bound. The first
    may stay resident (its kernels run while the first copies land), and the last streams
    (after the last copy only its end and the head are left to run)."""
    s = dataclasses.replace(_meta_llama_schedule(9), prefetch_depth=depth)
    for fraction in (0.5, 0.75):
        layout = plan_layout(s, int(fraction * s.total_bytes))
        streamed_layers = {s.fqns[w].split(".")[1] for w in range(len(s.fqns)) if w not in layout.resident and s.fqns[w].startswith("layers.")}
        assert streamed_layers >= {str(i) for i in range(1, 9)}, (fraction, sorted(streamed_layers))
        assert layout.streamed_bytes <= 1.01 * (s.total_bytes - (int(fraction * s.total_bytes) - s.floor_bytes))


def test_depth_zero_plans_a_ring_that_runs_one_weight_ahead_when_the_floor_allows():
    """Depth 0's smallest ring holds just two consecutive kernels' weights, so a copy cannot
    start before the kernel ahead of the one it feeds has run (policies.plan_layout). Where the
    budget allows, the plan is safe at depth 1 (each copy may run a weight ahead), its ring no
    larger than what the depth-0 floor reserves for streaming: the byte target holds
    against the depth-0 floor. Where that ring does not fit (at the floor), the smallest ring."""
    from hostswap.schedules.floor import ring_is_safe
    from hostswap.schedules.policies import _plan_layout, _stream_sequence

    s = dataclasses.replace(_meta_llama_schedule(9), prefetch_depth=0)
    total, floor = s.total_bytes, s.floor
    ahead = []
    for budget in (s.floor_bytes, int(0.25 * total), int(0.5 * total), int(0.75 * total)):
        layout = plan_layout(s, budget)
        smallest = _plan_layout(s, budget)  # the smallest ring
        seq, _ = _stream_sequence(s, set(layout.resident))
        assert ring_is_safe(seq, 0, layout.ring_bytes)
        assert layout.resident_bytes + layout.ring_bytes <= budget
        assert layout.ring_bytes <= floor.floor_bytes - floor.pinned_bytes
        assert layout.streamed_bytes <= 1.01 * (total - (budget - s.floor_bytes)), budget
        if ring_is_safe(seq, 1, layout.ring_bytes):
            ahead.append(budget)
            assert layout != smallest
        else:
            assert layout == smallest
    # at the floor no such ring fits; at half and three quarters of the weights one does
    assert s.floor_bytes not in ahead and int(0.5 * total) in ahead and int(0.75 * total) in ahead
    # the smallest ring at 75 %: every copy waits for the kernel just before the one it feeds
    smallest = _plan_layout(s, int(0.75 * total))
    seq, _ = _stream_sequence(s, set(smallest.resident))
    assert not ring_is_safe(seq, 1, smallest.ring_bytes)


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_carried_fills_wait_for_every_reader_of_their_bytes(depth):
    """The fills the runtime may issue at the end of a forward for the next one: a prefix of the
    forward's fills that overwrite nothing read earlier in it, each waiting for the last kernel
    of the whole forward that reads any of the bytes it overwrites (placements recomputed)."""
    from hostswap.schedules.floor import ring_placement
    from hostswap.schedules.policies import _stream_sequence

    s = dataclasses.replace(_meta_llama_schedule(4), prefetch_depth=depth)
    sizes = [aligned(b) for b in s.weight_bytes]
    carried_any = False
    for fraction in (0.5, 0.75, 0.9):
        layout = plan_layout(s, max(s.floor_bytes, int(fraction * s.total_bytes)))
        seq, probes = _stream_sequence(s, set(layout.resident))
        offsets = ring_placement(seq, layout.ring_bytes).offsets if probes else []
        fills = sorted(layout.fill_offset)
        carry = sorted(layout.carry_waits_for)
        assert carry == fills[: len(carry)]
        assert all(layout.fill_waits_for[p] == -1 for p in carry)
        if len(carry) < len(fills):
            assert layout.fill_waits_for[fills[len(carry)]] >= 0
        reads = [(off, off + sizes[s.probe_weight[p]], s.probe_kernel[p]) for p, off in zip(probes, offsets)]
        for p in carry:
            start, end = layout.fill_offset[p], layout.fill_offset[p] + sizes[s.probe_weight[p]]
            readers = [k for a, b, k in reads if a < end and start < b]
            assert readers and layout.carry_waits_for[p] == max(readers)  # its own read at least
            carried_any = True
    assert carried_any


def _quantized_like_schedule(layers: int = 6) -> "hostswap.schedules.WeightSchedule":
    """Per layer a 4 KiB norm weight and two linears, each read with its 4 KiB scale and zero
    point by one kernel (a quantized linear): many copies of few bytes beside large ones."""
    from hostswap.schedules.weight_schedule import WeightSchedule

    fqns, sizes, probe_weight, probe_kernel, ops = [], [], [], [], []
    for layer in range(layers):
        linear = [("qdata", 1 << 20), ("scale", 4096), ("zero_point", 4096)]
        for name, parts in (("norm", [("weight", 4096)]), ("up", linear), ("down", linear)):
            kernel = len(ops)
            ops.append("aten::mm.default")
            for part, nbytes in parts:
                probe_weight.append(len(fqns))
                probe_kernel.append(kernel)
                fqns.append(f"layers.{layer}.{name}.{part}")
                sizes.append(nbytes)
    return WeightSchedule(fqns=tuple(fqns), weight_bytes=tuple(sizes), probe_weight=tuple(probe_weight), probe_kernel=tuple(probe_kernel),
                          kernel_ops=tuple(ops), prefetch_depth=1, pin=()).check()


def test_keep_order_puts_small_weights_first_only_beside_large_ones():
    from hostswap.schedules.policies import keep_order

    sizes = [4 << 20, 16384, 4096, 1 << 20, 300 * 1024]
    assert keep_order(sizes, set(range(5))) == [0, 3, 4, 1, 2]  # largest first
    assert keep_order(sizes, set(range(5)), small_first=True) == [2, 1, 0, 3, 4]  # small ascending, then largest first
    same_magnitude = [4096, 2048, 3000]
    assert keep_order(same_magnitude, {0, 1, 2}, small_first=True) == [0, 2, 1]  # nothing small beside the largest


@pytest.mark.parametrize("extra, small_first_wins", [(256 << 10, False), (1 << 20, True), (3 << 20, False), (4 << 20, True)])
def test_planner_takes_the_keep_order_that_costs_the_link_less(extra, small_first_wins):
    """The planned layout is the cheaper, in bytes plus a fixed cost per copy, of keeping the
    largest weights first and keeping the small ones (scales, zero points) first. Where
    keeping the small weights pays, every scale is resident and each streamed linear is one
    copy; where it would displace a large one, largest-first stays."""
    from hostswap.schedules.policies import _plan_layout_in_order, link_cost

    s = _quantized_like_schedule()
    budget = s.floor_bytes + extra
    largest_first, small_first = (_plan_layout_in_order(s, budget, f) for f in (False, True))
    layout = plan_layout(s, budget)
    assert link_cost(layout) == min(link_cost(largest_first), link_cost(small_first))
    scales = {w for w, f in enumerate(s.fqns) if f.endswith(".scale")}
    if small_first_wins:  # (largest-first may find the same layout: its runs of small weights are kept too)
        assert link_cost(small_first) <= link_cost(largest_first) and scales <= layout.resident
        assert {s.fqns[s.probe_weight[p]].rsplit(".", 1)[1] for p in layout.fill_offset} <= {"qdata", "weight"}
    else:
        assert link_cost(largest_first) <= link_cost(small_first) and layout == largest_first
