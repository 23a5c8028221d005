"""An eager call's experts read once each over all their tokens (kernels/routed_grouped.py)
against the gathered per-pick products, the experts an expert cache holds read from its slots,
and the reads counted on the device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hostswap.kernels import routed_experts
from hostswap.kernels.routed_experts import ExpertReads, recording_reads
from hostswap.kernels.routed_grouped import routed_grouped, rows_for, segments
from hostswap.kernels.row_copy import triton_available
from test_routed_union import _gathered

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter runs the kernel on the CPU)")


def _ids(tokens: int, k: int, experts: int, gen: torch.Generator, none: tuple[int, ...] = (), skew: bool = False) -> torch.Tensor:
    """Each token's k distinct experts; with ``skew``, expert 0 is every token's first pick."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    if skew:
        ids = torch.where(ids == 0, ids[:, :1], ids)
        ids[:, 0] = 0
    ids[list(none)] = -1
    return ids


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, label) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-4, msg=str(label))
    else:  # the float32 sum rounded once: within a unit in the last place of bfloat16
        assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-5).all(), label


def _products_match(device: torch.device, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Tokens of top-3 of 12 experts (rows of no pick among them), a reduction longer than one
    load, outputs not a multiple of a block, vectors per token and per pick; one expert picked
    by more tokens than a program multiplies (read once per ``rows_for`` picks, and counted so).
    Each pick's product within rounding of the gathered one, a pick of -1 exactly 0. The experts
    no token picked are NaN: a read of any of their bytes would show."""
    gen = torch.Generator().manual_seed(0)
    experts, k, n_out, k_in = 12, 3, 40, 300
    for dtype in dtypes:
        for transposed in (False, True):
            for tokens, none, skew in ((1, (), False), (5, (1, 3), False), (70, (0, 69), False), (150, (2,), True), (300, (2,), True)):
                ids = _ids(tokens, k, experts, gen, none, skew)
                shape = (experts, k_in, n_out) if transposed else (experts, n_out, k_in)
                table = torch.randn(shape, generator=gen).to(dtype)
                unpicked = sorted(set(range(experts)) - set(ids.reshape(-1).tolist()))
                table[unpicked] = float("nan")
                table, device_ids = table.to(device), ids.to(device)
                segs = segments(device_ids, experts)
                for per_pick in (False, True):
                    x = torch.randn(tokens * k if per_pick else tokens, k_in, generator=gen).to(dtype).to(device)
                    count = torch.zeros((), dtype=torch.int64, device=device)
                    got = routed_grouped(x, table, device_ids, segs, transposed, per_pick, count_into=count)
                    picks = torch.bincount(ids[ids >= 0], minlength=experts)
                    assert int(count) == int((-(-picks // rows_for(tokens))).sum())  # once per rows_for(tokens) picks of an expert
                    if skew and tokens > rows_for(tokens):
                        assert int(count) > experts - len(unpicked)  # the popular expert was read more than once
                    want = _gathered(x, table, device_ids, transposed, per_pick)
                    label = (dtype, transposed, tokens, per_pick)
                    assert got.dtype == dtype and got.shape == want.shape, label
                    assert not got.isnan().any(), (label, unpicked)
                    dead = device_ids.reshape(-1) < 0
                    assert torch.equal(got[dead], torch.zeros_like(got[dead])), label
                    _close(got, want, dtype, label)


def _cache_slots_are_read(device: torch.device) -> None:
    """A cache holding some experts: those are read from their slots (their rows in the tables
    are NaN, so a read over the bus would show) and counted as hits as well as reads."""
    gen = torch.Generator().manual_seed(4)
    experts, k, tokens = 8, 2, 9
    table = torch.randn(experts, 48, 64, generator=gen)
    ids = _ids(tokens, k, experts, gen)
    held = sorted(set(ids[:, 0].tolist()))[:3]
    slot_of = torch.full((experts + 1,), -1, dtype=torch.int64)
    slots = torch.full((4, 48, 64), float("nan"))
    for slot, e in zip((3, 0, 2), held):
        slot_of[e] = slot
        slots[slot] = table[e]
    bus = table.clone()
    bus[held] = float("nan")
    x = torch.randn(tokens, 64, generator=gen)
    device_ids = ids.to(device)
    count, hits = torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)
    got = routed_grouped(x.to(device), bus.to(device), device_ids, segments(device_ids, experts), False, False, count_into=count,
                         cached=(slot_of.to(device), slots.to(device), hits))
    torch.testing.assert_close(got.cpu(), _gathered(x, table, ids, False, False), rtol=1e-5, atol=1e-4)
    assert int(count) == len(set(ids.reshape(-1).tolist())) and int(hits) == len(held)


def _a_chunk_reads_what_the_cache_holds_from_its_slots(device: torch.device) -> None:
    """``routed_experts`` on a chunk whose block has an expert cache holding 3 of its picked
    experts: the output is the eager loop's on clean tables, though the held experts' rows in the
    tables it is given are NaN (both projections read them from the slots); the stats count the
    3 as hits, the rest of the union as read over the bus."""
    from hostswap.runtime.expert_cache import ExpertCache, expert_read_stats
    from hostswap.schedules.experts import ExpertBlock

    gen = torch.Generator().manual_seed(5)
    experts, k, tokens, hidden_size, inner = 8, 2, 12, 64, 32
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    ids = _ids(tokens, k, experts, gen)
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    gate_up, down = torch.randn(experts, 2 * inner, hidden_size, generator=gen) * 0.1, torch.randn(experts, hidden_size, inner, generator=gen) * 0.1
    activate = lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]  # noqa: E731
    want, union = routed_experts._grouped(hidden, ids, weights, gate_up, down, None, None, activate, False, experts)
    unit = routed_experts.unit_bytes(gate_up, down)
    cache = ExpertCache("block", experts, unit, slots=4, top_k=k, device=device)
    held = sorted(set(ids.reshape(-1).tolist()))[:3]
    cache.fill(torch.tensor(held, device=device), (gate_up.to(device), down.to(device), None, None))
    poisoned = [t.clone() for t in (gate_up, down)]
    for t in poisoned:
        t[held] = float("nan")
    reads: dict[str, ExpertReads] = {}
    with routed_experts.using_caches({"block": cache}), recording_reads(reads):
        out = routed_experts.routed_experts(hidden.to(device), ids.to(device), weights.to(device), *(t.to(device) for t in poisoned), None, None,
                                            "silu", True, False, False, 0.0, 0.0, "block")
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    reads["block"].settle()
    stats = expert_read_stats(ExpertBlock("block", ("gate_up", "down"), k, tokens, experts, unit), reads["block"], False, cache)
    assert (stats["experts"], stats["chunk_hits"], stats["hits"], stats["misses"]) == (union, 3, 3, union - 3)


@pytest.mark.gpu
def test_each_pick_gets_its_product_and_unpicked_experts_are_not_read():
    _products_match(torch.device("cuda"))


@pytest.mark.gpu
def test_the_experts_a_cache_holds_are_read_from_its_slots():
    _cache_slots_are_read(torch.device("cuda"))


@pytest.mark.gpu
def test_a_chunk_reads_what_its_blocks_cache_holds_from_the_slots():
    _a_chunk_reads_what_the_cache_holds_from_its_slots(torch.device("cuda"))


@needs_triton
def test_products_and_cache_reads_interpreted():
    """On the CPU through Triton's interpreter, in a process of its own (the interpreter is
    chosen when Triton is imported); float32 only: the interpreter's matrix product does not
    take bfloat16."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import torch; "
            "from test_routed_grouped import _products_match, _cache_slots_are_read, _a_chunk_reads_what_the_cache_holds_from_its_slots; "
            "from hostswap.kernels import routed_experts; "
            "_products_match(torch.device('cpu'), (torch.float32,)); _cache_slots_are_read(torch.device('cpu')); "
            # on the CPU the products read in place only through the interpreter
            "routed_experts._reads_in_place = lambda *tables: True; "
            "_a_chunk_reads_what_the_cache_holds_from_its_slots(torch.device('cpu'))")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]


def test_segments_sort_the_picks_by_expert():
    """Each expert's picks are one stretch of ``order`` (flat ``t * k + j``, in pick order),
    picks of -1 after every expert's; counted without ``bincount`` (no host sync on CUDA)."""
    ids = torch.tensor([[2, 0], [-1, -1], [0, 3], [2, 2]])
    s = segments(ids, 5)
    assert s.counts.tolist() == [2, 0, 3, 1, 0] and s.starts.tolist() == [0, 2, 2, 5, 6] and s.top_k == 2
    assert s.order[:6].tolist() == [1, 4, 0, 6, 7, 5]
    assert sorted(s.order[6:].tolist()) == [2, 3]
    with pytest.raises(ValueError, match=r"ids \(2,\) are not \[tokens, k\]"):
        segments(ids[0], 5)


def test_vectors_segments_and_slots_that_do_not_fit_are_refused():
    table, ids = torch.zeros(4, 8, 16), torch.tensor([[0, 1], [2, 3]])
    segs = segments(ids, 4)
    with pytest.raises(ValueError, match=r"x \(3, 16\) does not fit 2 tokens of 2 picks of a \(4, 8, 16\) table \(one vector a token\)"):
        routed_grouped(torch.zeros(3, 16), table, ids, segs, False, per_pick=False)
    with pytest.raises(ValueError, match=r"x \(2, 16\) does not fit 2 tokens of 2 picks .* \(one vector a pick\)"):
        routed_grouped(torch.zeros(2, 16), table, ids, segs, False, per_pick=True)
    with pytest.raises(ValueError, match=r"the segments are of 4 picks of 5 experts, top-2; the call has 4 picks of a \(4, 8, 16\) table, top-2"):
        routed_grouped(torch.zeros(2, 16), table, ids, segments(ids, 5), False, per_pick=False)
    with pytest.raises(ValueError, match=r"the segments are of 6 picks of 4 experts, top-2; the call has 4 picks"):
        routed_grouped(torch.zeros(2, 16), table, ids, segments(torch.tensor([[0, 1], [2, 3], [1, 2]]), 4), False, per_pick=False)
    slot_of, hits = torch.full((5,), -1), torch.zeros((), dtype=torch.int64)
    with pytest.raises(ValueError, match=r"the cache's slots \(2, 16, 8\) \(torch.float32\) are not laid out as the table's rows \(4, 8, 16\)"):
        routed_grouped(torch.zeros(2, 16), table, ids, segs, False, per_pick=False, cached=(slot_of, torch.zeros(2, 16, 8), hits))
    with pytest.raises(ValueError, match="are not laid out as the table's rows"):
        routed_grouped(torch.zeros(2, 16), table, ids, segs, False, per_pick=False, cached=(slot_of, torch.zeros(2, 8, 16, dtype=torch.float16), hits))


@pytest.mark.gpu
def test_a_prefill_chunk_reads_its_union_in_one_launch_without_a_host_sync(monkeypatch):
    """An eager call of several tokens on CUDA (a prefill chunk, tables in mapped host memory,
    no expert cache: a cache's fill of the chunk's last row learns its distinct experts on the
    host): the grouped kernel runs (twice: gate/up and down), with no host sync; the output is that of
    transformers' eager loop (``_grouped``) within rounding, rows not live give 0, and the reads
    counted on the device are the live rows' union."""
    from hostswap.runtime.ptd import device_view_of

    gen = torch.Generator().manual_seed(2)
    experts, k, tokens, hidden_size, inner = 8, 2, 40, 256, 96
    hidden = torch.randn(tokens, hidden_size, generator=gen).cuda()
    ids = _ids(tokens, k, experts, gen)
    ids[:, 0] = torch.where(ids[:, 1] == 6, 5, 6)  # every token picks 5 or 6 first
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).cuda()
    gate_up = (torch.randn(experts, 2 * inner, hidden_size, generator=gen) * 0.05).pin_memory()
    down = (torch.randn(experts, hidden_size, inner, generator=gen) * 0.05).pin_memory()
    mapped = device_view_of(gate_up, torch.device("cuda"), "gate_up"), device_view_of(down, torch.device("cuda"), "down")
    calls = []
    real = routed_experts.routed_grouped
    monkeypatch.setattr(routed_experts, "routed_grouped", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    activate = lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]  # noqa: E731
    for live in (None, torch.arange(tokens).cuda() % 3 != 0):
        calls.clear()
        reads: dict[str, ExpertReads] = {}
        device_ids = ids.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with routed_experts.reading_rows(live), recording_reads(reads):
                out = routed_experts.routed_experts(hidden, device_ids, weights, *mapped, None, None, "silu", True, False, False, 0.0, 0.0, "block")
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert len(calls) == 2
        rows = torch.arange(tokens) if live is None else live.cpu().nonzero().squeeze(1)
        want, read = routed_experts._grouped(hidden, device_ids, weights, gate_up.cuda(), down.cuda(), None, None, activate, False, experts,
                                              rows=None if live is None else rows)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        if live is not None:
            assert torch.equal(out[~live], torch.zeros_like(out[~live]))
        reads["block"].settle()
        assert reads["block"].experts == read == len(set(ids[rows].reshape(-1).tolist()))


def test_experts_a_chunk_reads_from_the_slots_are_hits_not_bytes_over_the_bus():
    """``held_like`` gives a chunk the cache's slot map, slots and hit counter, making the slots
    where no lookup or fill has yet (a prefill chunk comes first), where they are laid out as the
    tables' rows (else None: every expert from the tables); what the kernel adds to
    ``chunk_hits`` counts among the block's hits, not its bytes over the bus."""
    from hostswap.runtime.expert_cache import ExpertCache, expert_read_stats
    from hostswap.schedules.experts import ExpertBlock

    gate_up, down = torch.zeros(8, 4, 2), torch.zeros(8, 2, 2)
    unit = 4 * 2 * 4 + 2 * 2 * 4
    cache = ExpertCache("b", num_experts=8, unit_bytes=unit, slots=4, top_k=2, device=torch.device("cpu"))
    sources = (gate_up, down, None, None)
    assert cache.tables is None
    slot_of, (gate_up_slots, down_slots), hits = cache.held_like(sources)  # makes the slots, empty
    assert slot_of is cache.slot_of and gate_up_slots is cache.tables[0] and down_slots is cache.tables[1] and hits is cache.chunk_hits
    assert (slot_of == -1).all() and cache.sources == sources
    cache.fill(torch.tensor([3, 5]), sources)
    assert cache.held_like(sources)[1][0] is gate_up_slots and sorted(torch.nonzero(slot_of >= 0).squeeze(1).tolist()) == [3, 5]
    assert cache.held_like((gate_up.double(), down, None, None)) is None and cache.held_like((torch.zeros(8, 2, 4), down, None, None)) is None
    cache.chunk_hits += 2
    block = ExpertBlock("b", ("gate_up", "down"), 2, 4, 8, unit)
    stats = expert_read_stats(block, ExpertReads(calls=1, experts=6, bytes=6 * unit), False, cache)
    assert (stats["chunk_hits"], stats["hits"], stats["misses"]) == (2, 2, 4)
    assert stats["bytes"] == (4 + 2) * unit  # the 4 read over the bus and the 2 the fill brought in
