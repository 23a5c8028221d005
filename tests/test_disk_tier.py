"""The host-memory budget and the disk tier: which weight lives where (schedules/tiers.py), the
reader that brings disk weights in ahead of their copies (runtime/disk_reader.py), and runs
whose outputs and tokens are bitwise those of the all-resident run at every host budget."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import hostswap
import hostswap.llm as llm
from hostswap.runtime import Module
from hostswap.runtime.disk_reader import DiskReader, StagingRing
from hostswap.runtime.host_tier import AUTO_HOST_SHARE, host_budget
from hostswap.runtime.ptd import PtdFile
from hostswap.schedules import load_weight_schedules
from hostswap.schedules.artifacts import ArtifactError
from hostswap.schedules.policies import plan_layout
from hostswap.schedules.tiers import STAGING_READS, plan_tiers, read_span

from real_models import BY_NAME, VOCAB, build

MB = 2**20
MAX_SEQ_LEN, CHUNK = 30, 4
ARCHITECTURES = ["Llama", "Qwen2", "GPT-2", "Gemma3"]


class _Program:
    def __init__(self, name: str, folder):
        self.pte, self.ptd = llm.export(build(BY_NAME[name])[0].eval(), os.path.join(folder, "model"), max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
        schedules = load_weight_schedules(self.pte)
        self.schedule = schedules["decode"]
        self.floor = max(s.floor_bytes for s in schedules.values())


_programs: dict[str, _Program] = {}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def program(request, tmp_path_factory):
    if request.param not in _programs:
        _programs[request.param] = _Program(request.param, tmp_path_factory.mktemp(request.param.replace("-", "")))
    return _programs[request.param]


def _run(program: _Program, gpu_mb: float, host_mb, prompt: torch.Tensor, new: int = 6):
    """(prefill logits, generated ids, module stats, tiers) at the given budgets, on the CPU."""
    with llm.Generator(program.pte, program.ptd, weight_offload_budget_mb=gpu_mb, host_memory_budget_mb=host_mb, device="cpu", warm_up=False) as g:
        logits = g._step(llm.PREFILL, prompt[:, :CHUNK], 0).clone()
        g.module.reset_state()
        ids = g.generate(prompt, new, eos_token_id=[])
        return logits, ids, g.module.stats, g.module.tiers


@pytest.mark.parametrize("gpu", ["floor", "half"])
def test_every_host_budget_gives_the_all_resident_outputs_bitwise(program, gpu):
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    total = program.schedule.total_bytes
    reference_logits, reference_ids, stats, tiers = _run(program, total / MB + 1, "auto", prompt)
    assert not tiers.disk and stats["disk_bytes_read"] == 0
    gpu_mb = program.floor / MB + 0.01 if gpu == "floor" else max(program.floor / MB + 0.01, total / 2 / MB)
    streamed = plan_layout(program.schedule, round(gpu_mb * MB)).streamed_bytes
    read = []
    for host_mb in (0, streamed / 2 / MB, total / MB):
        logits, ids, stats, tiers = _run(program, gpu_mb, host_mb, prompt)
        assert torch.equal(logits, reference_logits), host_mb
        assert torch.equal(ids, reference_ids), host_mb
        assert tiers.pinned_bytes <= host_mb * MB
        read.append(stats["disk_bytes_read"])
        assert (stats["disk_bytes_read"] > 0) == bool(tiers.disk)
        assert stats["disk_reads"] in (None, "O_DIRECT", "buffered")
    assert read[0] > read[1] > read[2] == 0  # all from disk, some, none


def test_disk_tier_decode_reads_the_planned_bytes_per_token(program):
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    with llm.Generator(program.pte, program.ptd, weight_offload_budget_mb=program.floor / MB + 0.01, host_memory_budget_mb=0, device="cpu") as g:
        g.generate(prompt, 5, eos_token_id=[])
        tiers = g.module.tiers
        assert g.stats["bytes_from_disk_per_token"] == tiers.disk_bytes_per_forward
        assert tiers.pinned_bytes == 0 and tiers.disk_bytes_per_forward == g.stats["bytes_streamed_per_token"]
        assert "from disk" in g.summary()
        assert "read from the disk" in g.memory_report()


def test_plan_places_every_streamed_weight_and_spreads_the_disk_bytes(program):
    schedule = program.schedule
    layout = plan_layout(schedule, program.floor)
    streamed = {schedule.probe_weight[q] for q in layout.fill_offset}
    total = sum(schedule.weight_bytes[w] for w in streamed)
    for budget in (0, total // 4, total // 2, total, 10 * total):
        tiers = plan_tiers(schedule, layout, budget)
        assert tiers.pinned | tiers.disk == streamed and not tiers.pinned & tiers.disk
        assert tiers.resident == layout.resident
        assert tiers.pinned_bytes <= budget and tiers.pinned_bytes == sum(schedule.weight_bytes[w] for w in tiers.pinned)
        assert tiers.disk_bytes_per_forward + tiers.pinned_bytes_per_forward == layout.streamed_bytes
        assert list(tiers.disk_fills) == [q for q in sorted(layout.fill_offset) if schedule.probe_weight[q] in tiers.disk]
        largest = max((schedule.weight_bytes[w] for w in tiers.disk), default=0)
        assert tiers.staging_bytes == (STAGING_READS * read_span(largest) if tiers.disk else 0)
        if budget >= total:
            assert not tiers.disk
    # a weight larger than all others is pinned where the budget holds it: staging follows the rest
    largest = max(streamed, key=lambda w: schedule.weight_bytes[w])
    others = max((schedule.weight_bytes[w] for w in streamed if w != largest), default=0)
    if schedule.weight_bytes[largest] > others:
        tiers = plan_tiers(schedule, layout, schedule.weight_bytes[largest])
        assert largest in tiers.pinned and tiers.staging_bytes == STAGING_READS * read_span(others)
    # half the bytes on disk: in every half of the fill order, some disk bytes (not all at one end)
    tiers = plan_tiers(schedule, layout, total // 2)
    fills = sorted(layout.fill_offset)
    halves = fills[: len(fills) // 2], fills[len(fills) // 2 :]
    assert all(any(schedule.probe_weight[q] in tiers.disk for q in half) for half in halves)
    with pytest.raises(ValueError, match="must not be negative"):
        plan_tiers(schedule, layout, -1)


def test_read_span_covers_any_offset():
    for nbytes in (1, 4095, 4096, 4097, 10**6):
        for offset in (0, 1, 4095, 4096 * 7 + 13):
            first = offset // 4096 * 4096
            assert -(-(offset + nbytes) // 4096) * 4096 - first <= read_span(nbytes)


class _Event:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_staging_ring_hands_out_in_order_and_refills_only_after_the_copy():
    ring = StagingRing(100)
    a, b = ring.allocate(40), ring.allocate(40)
    assert (a, b) == (0, 40)
    assert ring.allocate(40) is None  # 20 left at the end, nothing free at the start
    copy = _Event(False)
    ring.release(a, copy)
    assert ring.allocate(40) is None  # released, but its copy still reads it
    copy.done = True
    assert ring.allocate(40) == 0  # wraps to the space the first read gave back
    assert ring.allocate(10) is None  # wrapped: only [40, 40) is free
    ring.release(b, None)
    assert ring.allocate(50) == 40  # [40, 100) free once the second is back
    assert ring.allocate(101) is None
    assert not ring.wait_oldest()  # the oldest (at 0) is not released yet


@pytest.fixture()
def ptd_file(program, tmp_path):
    path = tmp_path / "copy.ptd"
    shutil.copyfile(program.ptd, path)
    with PtdFile(path) as ptd:
        yield ptd


def _sequence(ptd: PtdFile) -> list[tuple[str, int, int]]:
    return [(e.fqn, e.offset, e.nbytes) for e in sorted(ptd.entries.values(), key=lambda e: e.offset)]


def test_reader_reads_every_weight_as_mapped_in_order_and_after_a_restart(ptd_file):
    sequence = _sequence(ptd_file)
    staging = STAGING_READS * max(read_span(n) for _, _, n in sequence)
    reader = DiskReader(ptd_file, sequence, staging, pinned=False, threads=2)
    try:
        for cycle in range(2):
            for i, (fqn, _, _) in enumerate(sequence):
                if cycle:  # polled as the pool polls before issuing a fill it must not wait for
                    while not reader.ready(i):
                        time.sleep(0.001)
                    assert not reader.ready((i + 1) % len(sequence))  # not the next in order
                data, region = reader.take(i)
                assert torch.equal(data, ptd_file.host_tensor(fqn).reshape(-1).view(torch.uint8)), (cycle, fqn)
                reader.release(region, None)
        assert reader.bytes_read == 2 * sum(n for _, _, n in sequence) and reader.restarts == 0
        # a forward abandoned part-way: the next take asks for another read than the reader expects
        reader.take(0)
        data, region = reader.take(3)
        assert torch.equal(data, ptd_file.host_tensor(sequence[3][0]).reshape(-1).view(torch.uint8))
        assert reader.restarts == 1
    finally:
        reader.close()


def test_reader_refuses_a_file_changed_or_cut_short_while_it_reads(program, tmp_path):
    path = tmp_path / "changing.ptd"
    shutil.copyfile(program.ptd, path)
    with PtdFile(path) as ptd:
        sequence = _sequence(ptd)
        reader = DiskReader(ptd, sequence, STAGING_READS * max(read_span(n) for _, _, n in sequence), pinned=False, threads=1)
        try:
            with open(path, "r+b") as f:  # rewritten in place: same size, new contents
                f.seek(sequence[-1][1])
                f.write(b"\xff" * 16)
            os.utime(path, ns=(ptd.identity[1] + 10**9, ptd.identity[1] + 10**9))
            with pytest.raises(ArtifactError, match="changed on disk while the disk tier read weight"):
                reader.take(0)
            os.truncate(path, sequence[0][1] + 1)
            with pytest.raises(ArtifactError, match="shorter than at load|changed on disk"):
                reader.take(len(sequence) - 1)
        finally:
            reader.close()


def test_buffered_reads_serve_the_same_bytes(ptd_file):
    """The path taken where the filesystem refuses O_DIRECT: pages dropped after each read."""
    sequence = _sequence(ptd_file)
    reader = DiskReader(ptd_file, sequence, STAGING_READS * max(read_span(n) for _, _, n in sequence), pinned=False, direct=False)
    try:
        assert reader.mode == "buffered"
        for i, (fqn, _, _) in enumerate(sequence):
            data, region = reader.take(i)
            assert torch.equal(data, ptd_file.host_tensor(fqn).reshape(-1).view(torch.uint8)), fqn
            reader.release(region, None)
    finally:
        reader.close()


def test_a_module_changed_on_disk_is_refused_before_the_reader_serves_it(program, tmp_path):
    pte, ptd = tmp_path / "m.pte", tmp_path / "m.ptd"
    shutil.copyfile(program.pte, pte)
    shutil.copyfile(program.ptd, ptd)
    with llm.Generator(pte, ptd, weight_offload_budget_mb=program.floor / MB + 0.01, host_memory_budget_mb=0, device="cpu", warm_up=False) as g:
        g.generate(torch.tensor([[1, 2, 3]]), 2, eos_token_id=[])
        with open(ptd, "ab") as f:
            f.write(b"\0" * 4096)
        with pytest.raises(ArtifactError, match="changed on disk"):
            g.generate(torch.tensor([[1, 2, 3]]), 2, eos_token_id=[])


def test_the_lowered_models_run_from_disk_bitwise(lowered):
    """Plain programs (not generation): a convnet, a tied embedding, a weight read twice."""
    with Module(lowered.pte, weight_offload_budget_mb=lowered.schedule.floor_bytes / MB + 0.01, device="cpu", host_memory_budget_mb=0) as m:
        out = m(*lowered.args)
        assert m.stats["disk_bytes_read"] > 0 or not m.tiers.disk
        out2 = m(*lowered.args)
    expected = lowered.lowered_expected
    for got in (out, out2):
        assert torch.equal(got, expected) if isinstance(expected, torch.Tensor) else all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("bad", ["lots", -1, float("nan"), float("inf"), True, None, [1]])
def test_bad_host_budgets_are_named_before_any_work(program, bad):
    with pytest.raises(ValueError, match="host_memory_budget_mb"):
        Module(program.pte, weight_offload_budget_mb=program.floor / MB + 1, device="cpu", host_memory_budget_mb=bad)


def test_lru_refuses_a_host_budget_it_cannot_keep(program):
    with pytest.raises(ValueError, match="policy='lru' streams every weight from pinned host memory.*Use policy='planned'"):
        Module(program.pte, weight_offload_budget_mb=program.floor / MB * 1.5, device="cpu", policy="lru", host_memory_budget_mb=0)
    # every weight fits the GPU budget: lru keeps them all resident, and nothing needs pinning
    with Module(program.pte, weight_offload_budget_mb=program.schedule.total_bytes / MB + 1, device="cpu", policy="lru", host_memory_budget_mb=0) as m:
        assert not m.tiers.pinned and not m.tiers.disk and len(m.tiers.resident) == len(program.schedule.fqns)


def test_auto_host_budget_is_a_share_of_available_memory_less_what_is_pinned_besides(program):
    schedule = program.schedule
    streamed = list(range(len(schedule.fqns)))
    reserved = sum(schedule.host_read_bytes) + STAGING_READS * max(read_span(b) for b in schedule.weight_bytes)
    budget = host_budget("auto", schedule, streamed, available_bytes=64 * 2**30)
    assert budget.budget_bytes == int(64 * 2**30 * AUTO_HOST_SHARE) - reserved
    assert budget.reserved_bytes == reserved and budget.available_bytes == 64 * 2**30
    assert host_budget("auto", schedule, streamed, available_bytes=1).budget_bytes == 0  # nothing left: all from disk
    assert host_budget(12.5, schedule, streamed).budget_bytes == round(12.5 * MB)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hostswap.cli", *map(str, args)], capture_output=True, text=True, timeout=600)


def test_inspect_shows_the_three_tiers(program):
    result = _cli("inspect", program.pte, "--method", "decode", "--budget-mb", program.floor / MB + 0.01, "--host-budget-mb", 0)
    assert result.returncode == 0, result.stderr
    assert "Tiers with 0.00 MB of pinned host memory" in result.stdout
    for tier in ("gpu (resident)", "host (pinned)", "disk (.ptd)"):
        assert tier in result.stdout
    refused = _cli("inspect", program.pte, "--method", "decode", "--host-budget-mb", 0)
    assert refused.returncode == 2 and "--host-budget-mb needs --budget-mb" in refused.stderr
    report = hostswap.schedules.load_weight_schedules(program.pte)["decode"].to_dict(program.floor, 0)
    tiers = report["budget"]["tiers"]
    assert set(tiers["weights"].values()) <= {"gpu", "host", "disk"} and tiers["host_bytes"] == 0 and tiers["disk_bytes"] > 0


def test_generate_cli_reads_from_disk_below_the_host_budget(program):
    prefix = os.path.splitext(program.pte)[0]
    result = _cli("generate", prefix, "--prompt-ids", "1,2,3", "--max-new-tokens", 3, "--device", "cpu",
                  "--budget-mb", program.floor / MB + 0.01, "--host-budget-mb", 0)
    assert result.returncode == 0, result.stderr
    assert "read from the disk" in result.stderr and "MiB/token from disk" in result.stderr
    bad = _cli("generate", prefix, "--prompt-ids", "1", "--max-new-tokens", 2, "--device", "cpu", "--host-budget-mb", "-3")
    assert bad.returncode == 2 and "host_memory_budget_mb" in bad.stderr


def test_a_cgroup_limit_caps_the_memory_auto_counts_on():
    from hostswap.runtime.host_memory import available_host_memory, cgroup_room

    files = {"/sys/fs/cgroup/user.slice/job/memory.max": "8589934592\n", "/sys/fs/cgroup/user.slice/job/memory.current": "1073741824\n"}
    assert cgroup_room("0::/user.slice/job\n", files.get) == 7 * 2**30
    unlimited = {"/sys/fs/cgroup/memory.max": "max\n", "/sys/fs/cgroup/memory.current": "5\n"}
    assert cgroup_room("0::/\n", unlimited.get) is None
    assert cgroup_room(None, files.get) is None and cgroup_room("1:cpu:/x\n", files.get) is None
    v1 = {"/sys/fs/cgroup/memory/memory.limit_in_bytes": "4294967296\n", "/sys/fs/cgroup/memory/memory.usage_in_bytes": "1073741824\n"}
    assert cgroup_room("4:memory:/not/mounted/here\n0::/\n", v1.get) == 3 * 2**30  # a container's v1 root
    v1_unlimited = {k: ("9223372036854771712\n" if "limit" in k else "1\n") for k in v1}
    assert cgroup_room("4:memory:/\n", v1_unlimited.get) is None
    assert 0 < available_host_memory()


def test_reader_keeps_at_most_one_cycle_in_flight(ptd_file):
    """With room for every read, the reader runs a whole cycle ahead and no further: a read is
    never in flight twice."""
    sequence = _sequence(ptd_file)[:2]
    reader = DiskReader(ptd_file, sequence, 8 * sum(read_span(n) for _, _, n in sequence), pinned=False, threads=1)
    try:
        for _ in range(3):
            reader.ready(0)
        assert [r.index for r in reader._pending] == [0, 1]
        data, region = reader.take(0)
        reader.release(region, None)
        assert [r.index for r in reader._pending] == [1, 0]
    finally:
        reader.close()
