"""Routed experts read from the disk through a host cache, where their tables do not fit in
the host memory a load may pin (runtime/expert_store.py).

The tokens and logits must be those of the same program with its expert tables pinned whole,
on every MoE architecture; the cache must hold the file's bytes of the experts it says it
holds; and a cache too small for one call's picks is refused at load, naming the least.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import types

import pytest
import torch

import hostswap
import hostswap.llm as llm
from hostswap.kernels.routed_experts import ExpertIndexError
from hostswap.runtime import Module
from hostswap.runtime.disk_reader import CHUNK_BYTES
from hostswap.runtime.expert_store import ExpertReader, HostExpertCache, HostSlots, minimum_host_cache_bytes, plan_host_experts
from hostswap.runtime.host_tier import AUTO_HOST_SHARE, plan_expert_host_tier
from hostswap.runtime.ptd import PtdFile, file_identity
from hostswap.schedules.artifacts import ArtifactError
from hostswap.schedules.experts import ExpertBlock
from hostswap.schedules.serialization import load_weight_schedules

from test_experts import CHUNK, MAX_SEQ_LEN, MOE, _get, _mixtral, _prompt

MB = 2**20


@pytest.fixture(scope="module", params=list(MOE))
def moe(request, tmp_path_factory):
    return _get(request.param, tmp_path_factory)


def _least_mb(moe) -> float:
    """One call's picks of every block: the smallest host cache a load takes."""
    return minimum_host_cache_bytes(moe.schedules["decode"].expert_blocks) / MB


@pytest.mark.parametrize("budget, policy", [("floor", "lfu"), ("floor", "lru"), ("cache", "lfu")])
def test_experts_from_disk_give_the_tokens_and_logits_of_experts_pinned(moe, budget, policy):
    """At the floor (every pick read from the host slots) and with a device cache in front of
    them; the host cache holds one call's picks, so prefill chunks whose union is larger go
    through it in parts."""
    prompt = _prompt(7)
    expected = moe.transformers_tokens(prompt, 12)
    mb = {"floor": moe.floor, "cache": moe.cached}[budget] / MB
    blocks = moe.schedules["decode"].expert_blocks
    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=mb, device="cpu", expert_host_cache_mb=_least_mb(moe),
                       expert_cache_policy=policy) as g:
        plan = g.module.expert_host_plan
        assert plan.on_disk and plan.slots == {b.block: b.top_k for b in blocks}
        out = g.generate(prompt, 12, eos_token_id=[])
        assert torch.equal(out, expected), (out.tolist(), expected.tolist())
        s = g.stats
        assert set(s["expert_host_cache"]) == {b.block for b in blocks}
        for c in s["expert_host_cache"].values():
            assert c["slots"] == blocks[0].top_k and c["policy"] == policy and c["misses"] > c["slots"] and c["hits"] > 0
        assert s["expert_disk_bytes_read"] == sum(c["bytes_read"] for c in s["expert_host_cache"].values()) > 0
        assert re.search(rf"experts from disk: {blocks[0].top_k} a block in host memory, \d+% of picks found there", g.summary()), g.summary()
        assert "read from the disk through" in g.memory_report() and f"evicting {policy}" in g.memory_report()
        if budget == "cache":
            assert set(g.module.expert_caches) == {b.block for b in blocks}
            assert all(r["cache_hits"] > 0 for r in s["expert_reads"].values())
            # a pick the device cache holds needs nothing from the disk: decode reads at most its misses
            device_misses = sum(r["cache_misses"] for r in s["expert_reads"].values())  # since load, the warm-up's step too
            assert 0 < s["bytes_from_disk_per_token"] * (s["new_tokens"] - 1) <= device_misses * blocks[0].unit_bytes  # the decode steps
        # step by step, against the same program with its tables pinned whole
        steps = [("prefill", _prompt(CHUNK, 3), torch.arange(CHUNK)), ("decode", _prompt(1, 4), torch.tensor([CHUNK])),
                 ("decode", _prompt(1, 5), torch.tensor([CHUNK + 1]))]
        g.module.reset_state()
        from_disk = [g.module.run_method(m, [x, p])[0] for m, x, p in steps]
    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=mb, device="cpu") as g:
        assert not g.module.expert_host_plan.on_disk and not g.module.host_experts
        g.module.reset_state()
        pinned = [g.module.run_method(m, [x, p])[0] for m, x, p in steps]
    for (method, _, _), a, b in zip(steps, from_disk, pinned):
        assert torch.equal(a, b), (method, (a - b).abs().max().item())


def test_host_slots_evict_the_expert_asked_for_least_often_lately():
    """Worked examples of ``HostSlots``: an empty slot first; then the fewest requests (lfu),
    the least recently used among equals, or the least recently used (lru); the counts halved
    every ``half_life`` calls."""
    def calls(policy, half_life=256):
        slots = HostSlots(3, 8, policy, half_life)
        out = []
        for experts in ([0, 1], [0, 1], [2], [3]):
            out.append(slots.place(experts))
            slots.filled(out[-1][1], out[-1][0])
        return slots, out

    lfu, out = calls("lfu")
    assert out[0] == ([0, 1], [(0, 0), (1, 1)]) and out[1] == ([0, 1], []) and out[2] == ([2], [(2, 2)])
    assert lfu.uses[:4] == [2, 2, 1, 1]
    # 0 and 1 were asked for twice, 2 once: lfu evicts 2, though 0 and 1 were used longer ago
    assert out[3] == ([2], [(3, 2)]) and lfu.expert_of == [0, 1, 3] and lfu.slot_of == {0: 0, 1: 1, 3: 2}
    lru, out = calls("lru")
    assert out[3] == ([0], [(3, 0)]) and lru.expert_of == [3, 1, 2]  # the least recently used: slot 0, before slot 1
    # halved every 2 calls: at the fourth every count is 0 and lfu takes the least recently used
    halved, out = calls("lfu", half_life=2)
    assert out[3] == ([0], [(3, 0)]) and halved.uses[:4] == [0, 0, 0, 1]
    # lfu among equal counts: the least recently used, not the lower slot
    ties = HostSlots(3, 8, "lfu")
    for experts in ([0], [1], [2], [1], [2], [0], [1]):  # 0 and 2 asked for twice (0 last at call 6, 2 at call 5), 1 three times
        ties.filled(*reversed(ties.place(experts)))
    assert ties.place([3]) == ([2], [(3, 2)])
    # a slot holding another expert of the call is never taken, however old
    own = HostSlots(2, 8, "lru")
    for experts in ([0], [1]):
        own.filled(*reversed(own.place(experts)))
    assert own.place([0, 2]) == ([0, 1], [(2, 1)])
    # a read that failed left its slot empty: taken first, before an older full one
    failed = HostSlots(3, 8, "lru")
    for experts in ([0], [1], [2], [0]):
        failed.filled(*reversed(failed.place(experts)))
    assert failed.place([1, 3]) == ([1, 2], [(3, 2)])  # not filled: its read never came in
    assert failed.expert_of == [0, 1, -1] and 2 not in failed.slot_of and failed.last_use == [4, 2, 3]
    assert failed.place([4]) == ([2], [(4, 2)])  # slot 1 (used at call 2) is older than slot 2 (call 3), but holds an expert
    with pytest.raises(ValueError, match=re.escape("expert_cache_policy must be one of ('lfu', 'lru'), got 'mru'")):
        HostSlots(3, 8, "mru")


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_host_cache_holds_the_files_rows_and_evicts_as_its_policy_says(tmp_path_factory, policy):
    moe = _get("Qwen3-MoE", tmp_path_factory)
    block = moe.schedules["decode"].expert_blocks[0]
    with PtdFile(moe.ptd) as ptd:
        with contextlib.closing(ExpertReader(ptd)) as reader:
            cache = HostExpertCache(block, ptd, 3, reader, torch.device("cpu"), policy)
            try:
                def holds(expert, slot):
                    for fqn, table in zip(block.tables, cache.host_tables):
                        assert torch.equal(table[slot], ptd.host_tensor(fqn)[expert]), (fqn, expert, slot)

                assert cache.bring([5, 1]) == [0, 1]  # empty slots first, in order
                assert cache.bring([1, 7]) == [1, 2]
                # 5 was used least recently and asked for least often; 1 and 7 are this call's own
                assert cache.bring([7, 0]) == [2, 0]
                assert cache.bring([3, 0, 7]) == [1, 0, 2]  # slot 1 is the only one no expert of the call holds
                assert (cache.hits, cache.misses) == (4, 5)
                assert cache.expert_of == [0, 3, 7] and cache.slot_of == {0: 0, 3: 1, 7: 2}
                for expert, slot in cache.slot_of.items():
                    holds(expert, slot)
                assert reader.bytes_read == 5 * block.unit_bytes == cache.stats()["bytes_read"]
                with pytest.raises(ValueError, match=re.escape(f"4 experts of {block.block} at once; its host cache holds 3")):
                    cache.bring([0, 1, 2, 4])
                # a read that fails (a file cut short, an interrupt) leaves its slots holding no expert
                real = reader.read
                reader.read = lambda requests: (_ for _ in ()).throw(KeyboardInterrupt())
                with pytest.raises(KeyboardInterrupt):
                    cache.bring([5, 6])
                reader.read = real
                assert sorted(cache.slot_of) == [7] and cache.expert_of.count(-1) == 2
                misses = cache.misses
                assert sorted(cache.bring([5, 6, 7])) == [0, 1, 2] and cache.misses == misses + 2  # 5 and 6 read again
                for expert, slot in cache.slot_of.items():
                    holds(expert, slot)
                # a slot is refilled only once the kernels that read it are done: a wait interrupted leaves it empty, waited for again
                class Event:
                    def __init__(self, fails):
                        self.fails, self.waits = fails, 0

                    def synchronize(self):
                        self.waits += 1
                        if self.fails:
                            raise KeyboardInterrupt

                slot = cache.slot_of[5]
                cache._readers[slot] = stuck = Event(fails=True)
                with pytest.raises(KeyboardInterrupt):
                    cache.bring([0, 1, 2])  # 5's slot among those taken
                assert stuck.waits == 1 and cache._readers[slot] is stuck and 5 not in cache.slot_of and cache.expert_of[slot] == -1
                stuck.fails = False
                assert cache.bring([5]) == [slot] and stuck.waits == 2 and cache._readers[slot] is None
                holds(5, slot)
                with pytest.raises(ValueError, match=re.escape(f"a host cache of {block.block} needs top_k ({block.top_k}) to {block.num_experts} slots, not 1")):
                    HostExpertCache(block, ptd, 1, reader, torch.device("cpu"))
            finally:
                cache.close()
            # where the policies part: 0 and 1 asked for twice, 2 once, then 3
            cache = HostExpertCache(block, ptd, 3, reader, torch.device("cpu"), policy)
            try:
                for experts in ([0, 1], [0, 1], [2]):
                    cache.bring(experts)
                evicted = {"lfu": 2, "lru": 0}[policy]  # lfu: the fewest requests; lru: the least recently used
                assert cache.bring([3]) == [evicted] and sorted(cache.slot_of) == sorted({0, 1, 2, 3} - {evicted})  # expert e was in slot e
                for expert, at in cache.slot_of.items():
                    holds(expert, at)
            finally:
                cache.close()


def _file_like(path) -> types.SimpleNamespace:
    """What ExpertReader takes of a PtdFile: its path, descriptor and identity at load."""
    f = open(path, "rb")
    return types.SimpleNamespace(path=str(path), identity=file_identity(os.fstat(f.fileno())), fileno=f.fileno, file=f)


@pytest.mark.parametrize("direct", [True, False])
def test_the_reader_reads_any_range_to_any_place(tmp_path, direct):
    """Ranges at any offset and length, into places at the same offset within a disk block
    (the middle read with O_DIRECT where the file takes it) and at another (buffered)."""
    import mmap

    data = torch.randint(0, 256, (CHUNK_BYTES + 3 * 4096 + 123,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    path = tmp_path / "bytes"
    path.write_bytes(data)
    source = _file_like(path)
    reader = ExpertReader(source, direct=direct)
    buffer = mmap.mmap(-1, 2 * len(data))
    try:
        cases = [(0, 4096, 0), (100, 50, 100), (4000, 200, 4000), (4000, 9000, 8096), (123, CHUNK_BYTES + 5000, 123), (8192, 3 * 4096, 0),
                 (5, 4096 * 2, 77), (len(data) - 10, 10, 12)]
        for offset, nbytes, start in cases:
            buffer[:] = b"\xa5" * len(buffer)  # a sentinel around the range, which must stay
            reader.read([("range", offset, nbytes, buffer, start)])
            assert buffer[start : start + nbytes] == data[offset : offset + nbytes], (offset, nbytes, start)
            assert buffer[:start] == b"\xa5" * start and buffer[start + nbytes :] == b"\xa5" * (len(buffer) - start - nbytes), (offset, nbytes, start)
        assert reader.bytes_read == sum(n for _, n, _ in cases)
        if reader.mode == "O_DIRECT":
            assert reader.direct_bytes > 0  # the congruent ranges' whole blocks
        else:
            assert reader.direct_bytes == 0
    finally:
        reader.close()
        source.file.close()


def test_the_reader_names_a_file_changed_or_cut_short_since_load(tmp_path):
    import mmap

    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)) * 64)
    source = _file_like(path)
    reader = ExpertReader(source)
    buffer = mmap.mmap(-1, 1 << 16)
    try:
        with pytest.raises(ArtifactError, match="read 0 of 100 bytes at offset 20000: the file is shorter than at load"):
            reader.read([("expert 3 of weight 'w'", 20000, 100, buffer, 0)])
        os.utime(path, ns=(0, 12345))
        with pytest.raises(ArtifactError, match="changed on disk while routed experts were read from it"):
            reader.read([("expert 0 of weight 'w'", 0, 100, buffer, 0)])
    finally:
        reader.close()
        source.file.close()


def _blocks(n=2, experts=8, top_k=2, unit=1000) -> tuple[ExpertBlock, ...]:
    return tuple(ExpertBlock(f"layers.{i}.experts", (f"layers.{i}.gate_up", f"layers.{i}.down"), top_k, 1, experts, unit, "float32") for i in range(n))


def test_the_experts_stay_pinned_where_they_fit_else_slots_of_the_room():
    blocks = _blocks()  # 2 blocks of 8 experts of 1000 bytes: 16000 bytes of tables
    pinned = plan_host_experts("auto", blocks, 16000)
    assert not pinned.on_disk and pinned.pinned_bytes == 16000 and "pinned whole" in pinned.explain()
    on_disk = plan_host_experts("auto", blocks, 11999)  # 5 experts a block
    assert on_disk.slots == {b.block: 5 for b in blocks} and on_disk.cache_bytes == on_disk.pinned_bytes == 10000
    assert "read from the disk through" in on_disk.explain() and "5 experts per block" in on_disk.explain()
    given = plan_host_experts(6000 / MB, blocks, 10**12)  # a figure given is taken whatever the room
    assert given.slots == {b.block: 3 for b in blocks} and given.room_bytes is None
    assert not plan_host_experts(16000 / MB, blocks, 0).on_disk
    assert not plan_host_experts("auto", (), 0).on_disk


def test_blocks_of_other_top_ks_need_the_largest_in_each():
    blocks = _blocks(1, top_k=2) + tuple(dataclasses.replace(b, block="other", top_k=4) for b in _blocks(1))
    assert minimum_host_cache_bytes(blocks) == 2 * 4 * 1000  # equal slots per block: 4 in each
    plan = plan_host_experts(minimum_host_cache_bytes(blocks) / MB, blocks, 0)
    assert set(plan.slots.values()) == {4}


def test_a_host_cache_below_one_calls_picks_is_refused_naming_the_least():
    blocks = _blocks()  # one call's picks: 2 blocks x top-2 x 1000 bytes
    least = f"at least {4000 / MB:.1f} MiB"
    with pytest.raises(ValueError, match=re.escape("expert_host_cache_mb=0.001 holds fewer than one call's picks") + ".*" + re.escape(least)):
        plan_host_experts(0.001, blocks, 10**12)
    with pytest.raises(ValueError, match=re.escape("the host memory left for them at load (0.0 MiB)") + ".*" + re.escape(least)):
        plan_host_experts("auto", blocks, 3999)
    for bad in ("big", -1, 0, float("nan"), True):
        with pytest.raises(ValueError, match="expert_host_cache_mb must be"):
            plan_host_experts(bad, blocks, 10**12)


def test_auto_puts_the_experts_on_disk_where_the_host_share_cannot_hold_them_besides_the_rest(tmp_path_factory):
    moe = _get("Mixtral", tmp_path_factory)
    decode = moe.schedules["decode"]
    tables = sum(b.table_bytes for b in decode.expert_blocks)
    others = sum(n for f, n in zip(decode.host_read, decode.host_read_bytes) if not any(f in b.tables for b in decode.expert_blocks))
    streamed = list(range(len(decode.fqns)))
    from hostswap.schedules.tiers import staging_bytes

    staging = staging_bytes(decode.weight_bytes)  # the ring a disk tier of these weights would need
    every = others + sum(decode.weight_bytes) + staging + tables
    assert not plan_expert_host_tier("auto", decode, streamed, available_bytes=int(every / AUTO_HOST_SHARE) + 1).on_disk
    short = plan_expert_host_tier("auto", decode, streamed, available_bytes=int((every - tables // 4) / AUTO_HOST_SHARE) + 2)
    assert short.on_disk and short.cache_bytes <= tables - tables // 4 and set(short.slots.values()) == {3}  # of 4 experts
    # streamed weights that leave less than one call's picks give way to them (the disk tier reads what they lack)
    least = minimum_host_cache_bytes(decode.expert_blocks)
    crowded = plan_expert_host_tier("auto", decode, streamed, available_bytes=int((others + staging + least) / AUTO_HOST_SHARE) + 2)
    assert crowded.on_disk and crowded.cache_bytes == least
    # the whole plan: the streamed weights (and their staging ring) keep what they need, the
    # experts take the rest, and the pinned total stays within the share
    from hostswap.runtime.host_tier import plan_host_tiers
    from hostswap.schedules.policies import plan_layout

    layout = plan_layout(decode, decode.floor_bytes)
    moved = [w for w in range(len(decode.fqns)) if w not in layout.resident]
    assert moved
    share = others + sum(decode.weight_bytes[w] for w in moved) + staging_bytes(decode.weight_bytes[w] for w in moved) + tables * 3 // 4
    budget, tiers, experts = plan_host_tiers("auto", decode, layout, expert_host_cache_mb="auto", available_bytes=int(share / AUTO_HOST_SHARE) + 2)
    assert experts.on_disk and not tiers.disk and set(experts.slots.values()) == {3}
    assert tiers.pinned_bytes + tiers.host_read_bytes + tiers.staging_bytes <= share + 2
    # blocks the device holds whole need no host memory
    assert not plan_expert_host_tier("auto", decode, streamed, frozenset(b.block for b in decode.expert_blocks), available_bytes=1).on_disk


def test_a_load_below_one_calls_picks_is_refused_and_a_compiled_one_named(tmp_path_factory):
    moe = _get("Mixtral", tmp_path_factory)
    least = _least_mb(moe)
    with pytest.raises(ValueError, match=re.escape(f"at least {least:.1f} MiB of host slots")):
        Module(moe.pte, moe.ptd, weight_offload_budget_mb=moe.floor / MB, device="cpu", expert_host_cache_mb=least / 2)
    with pytest.raises(ValueError, match="expert_host_cache_mb must be a number of MB or 'auto'"):
        Module(moe.pte, moe.ptd, weight_offload_budget_mb=moe.floor / MB, device="cpu", expert_host_cache_mb="half")
    with pytest.raises(ValueError, match="compiled needs the routed experts in pinned host memory; expert tables .* read from the disk through"):
        Module(moe.pte, moe.ptd, weight_offload_budget_mb=moe.cached / MB, device="cpu", expert_host_cache_mb=least, compiled=("decode",))


def test_a_corrupted_router_stops_a_call_of_experts_on_disk_before_any_read(tmp_path):
    model = _mixtral().eval()
    router = model.model.layers[1].mlp.gate
    original = router.forward

    def corrupted(hidden_states):
        logits, scores, indices = original(hidden_states)
        return logits, scores, indices + router.num_experts - 1

    router.forward = corrupted
    pte, ptd = llm.export(model, tmp_path / "m", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    schedules = load_weight_schedules(pte)
    floor = hostswap.schedules.load_floor_bytes(schedules)
    least = minimum_host_cache_bytes(schedules["decode"].expert_blocks) / MB
    with llm.Generator(pte, ptd, weight_offload_budget_mb=floor / MB, device="cpu", warm_up=False, expert_host_cache_mb=least) as g:
        with pytest.raises(ExpertIndexError, match=re.escape("router of model.layers.1.mlp.experts picked an expert outside 0..3")):
            g.generate(_prompt(7), 4, eos_token_id=[])
        assert g.module.host_experts["model.layers.1.mlp.experts"].misses == 0


def test_a_batch_of_sequences_reads_its_experts_from_disk_and_each_gets_its_own_tokens(tmp_path_factory):
    """Continuous batching over a program whose expert tables are on disk: a step's union goes
    through a host cache of one token's picks per block, in parts."""
    from hostswap import batching
    from test_batching import Batched, _prompts

    b = Batched("Mixtral", None, tmp_path_factory.mktemp("batched-mixtral"))
    prompts, news = _prompts([5, 3, 9, 2]), [6, 9, 4, 7]
    expected = [b.transformers_tokens(p, n) for p, n in zip(prompts, news)]
    least = minimum_host_cache_bytes(load_weight_schedules(b.pte)["decode"].expert_blocks) / MB
    with batching.BatchGenerator(b.pte, b.ptd, weight_offload_budget_mb=b.floor / MB, device="cpu", expert_host_cache_mb=least) as g:
        assert g.module.expert_host_plan.on_disk
        assert g.generate(prompts, news, eos_token_id=[]) == expected
        assert all(c.misses > c.slots for c in g.module.host_experts.values())


def test_generate_command_takes_the_host_cache_and_names_a_bad_one(tmp_path_factory):
    import subprocess
    import sys

    moe = _get("Mixtral", tmp_path_factory)
    prefix = os.path.splitext(moe.pte)[0]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "hostswap.cli", "generate", prefix, "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                               "--device", "cpu", "--budget-mb", str(moe.floor / MB + 0.01), *map(str, args)], capture_output=True, text=True, timeout=600)

    ok = cli("--expert-host-cache-mb", _least_mb(moe) + 0.01)
    assert ok.returncode == 0, ok.stderr
    assert "read from the disk through" in ok.stderr and "experts from disk: 2 a block in host memory" in ok.stderr
    for bad, named in (("half", "--expert-host-cache-mb"), (_least_mb(moe) / 4, "at least")):
        result = cli("--expert-host-cache-mb", bad)
        assert result.returncode == 2 and named in result.stderr, result.stderr


def test_inspect_shows_where_the_experts_tables_are_in_host_memory(tmp_path_factory, capsys):
    """``hostswap inspect`` with a host budget places the expert tables as a load would: behind
    host slots of ``--expert-host-cache-mb`` (the tables then not counted as pinned), pinned
    whole where this machine's RAM holds them (auto), and a figure below one call's picks, or
    one without a host budget, refused naming the least or what is missing."""
    import json

    from hostswap.cli import main

    moe = _get("Mixtral", tmp_path_factory)
    decode = moe.schedules["decode"]
    tables = sum(b.table_bytes for b in decode.expert_blocks)
    base = ["inspect", moe.pte, "--method", "decode", "--budget-mb", str(moe.floor / MB + 0.01), "--host-budget-mb", "1000"]
    assert main(base + ["--expert-host-cache-mb", str(_least_mb(moe) + 0.01), "--format", "json"]) == 0
    tiers = json.loads(capsys.readouterr().out)["budget"]["tiers"]
    experts = tiers["experts"]
    assert experts["on_disk"] and experts["table_bytes"] == tables and experts["host_cache_bytes"] == minimum_host_cache_bytes(decode.expert_blocks)
    assert tiers["host_read_bytes"] == sum(decode.host_read_bytes) - tables + experts["pinned_bytes"] < sum(decode.host_read_bytes)
    assert main(base + ["--expert-host-cache-mb", str(_least_mb(moe) + 0.01)]) == 0
    assert "routed experts: expert tables (" in capsys.readouterr().out
    assert main(base) == 0
    assert "routed experts: expert tables pinned whole" in capsys.readouterr().out
    assert main(base + ["--expert-host-cache-mb", str(_least_mb(moe) / 4)]) == 2
    assert "experts read from the disk need at least" in capsys.readouterr().err
    assert main(base[:-2] + ["--expert-host-cache-mb", "5"]) == 2
    assert "--expert-host-cache-mb needs --host-budget-mb" in capsys.readouterr().err


def test_speculative_decoding_of_a_target_with_experts_on_disk_keeps_its_greedy_output(tmp_path):
    """A verify pass checks several drafted tokens in one call: its union goes through the
    host cache in parts, and the output is the target's own greedy output."""
    model = _mixtral().eval()
    target = llm.export(model, tmp_path / "target", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, speculate_k=4)
    schedules = load_weight_schedules(target[0])
    floor = hostswap.schedules.load_floor_bytes(schedules) / MB + 0.01
    least = minimum_host_cache_bytes(schedules["decode"].expert_blocks) / MB
    with llm.Generator(*target, weight_offload_budget_mb=floor, device="cpu") as g:
        expected = g.generate(_prompt(7), 12, eos_token_id=[])
    with llm.Generator(*target, weight_offload_budget_mb=floor, device="cpu", expert_host_cache_mb=least, draft=str(tmp_path / "target"), speculate_k=4) as g:
        assert g.module.expert_host_plan.on_disk
        assert torch.equal(g.generate(_prompt(7), 12, eos_token_id=[]), expected)
        assert g.last_speculation.passes > 0 and g.last_speculation.acceptance == 1.0


def test_a_union_larger_than_the_slots_reads_only_what_they_lack(tmp_path_factory):
    """A prefill chunk whose experts outnumber the slots: the held ones go first, so a chunk
    that routes as the last one did misses only what the slots cannot hold (in the experts'
    order it would evict each just before reaching it, and miss all). The sums keep the
    experts' order: the output is that of the tables read whole, bitwise."""
    from hostswap.kernels.routed_experts import _grouped, gate

    moe = _get("Qwen3-MoE", tmp_path_factory)
    block = moe.schedules["prefill"].expert_blocks[0]
    torch.manual_seed(0)
    tokens = 6
    ids = torch.stack([torch.randperm(block.num_experts)[: block.top_k] for _ in range(tokens)])
    ids[:4] = torch.arange(block.num_experts).view(4, 2)  # every expert in the union
    weights = torch.rand(tokens, block.top_k)
    activate = lambda x: gate(x, "silu", True, False, 0.0, 0.0)  # noqa: E731
    with PtdFile(moe.ptd) as ptd:
        tables = tuple(ptd.host_tensor(t) for t in block.tables)
        hidden = torch.randn(tokens, tables[0].shape[-1])
        whole, _ = _grouped(hidden, ids, weights, *tables, None, None, activate, False, block.num_experts)
        reader = ExpertReader(ptd)
        cache = HostExpertCache(block, ptd, block.num_experts - 2, reader, torch.device("cpu"))
        try:
            for call in range(3):
                misses = cache.misses
                out, read = _grouped(hidden, ids, weights, *cache.tables_for(*tables), None, None, activate, False, block.num_experts, host=cache)
                assert read == block.num_experts and torch.equal(out, whole)
                assert cache.misses - misses == (block.num_experts if call == 0 else 2), call
        finally:
            cache.close()
            reader.close()
