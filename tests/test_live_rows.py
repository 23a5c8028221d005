"""A batched decode step reads the routed experts of its live rows alone.

A batched program steps every slot, and a slot no sequence holds still routes its row. Its
output is thrown away, so reading its experts (over the bus, or into an expert cache's slots)
is waste: ``Module.run_method(..., live_rows=...)`` names the rows a step reads, and
``BatchGenerator`` gives the rows of its decoding sequences. The live rows' outputs must be
those of the same call over every row; the others' are zero.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from hostswap import batching
from hostswap.kernels.routed_experts import (ExpertReads, _grouped, _pairs, gate, reading_rows, recording_reads, routed_experts, using_caches,
                                             warming_a_graph)
from hostswap.runtime.expert_cache import ExpertCache
from hostswap.schedules.serialization import load_weight_schedules
from hostswap.schedules.weight_schedule import load_floor_bytes

from test_experts import MOE
from test_generation import transformers_greedy

MB = 2**20
EXPERTS, K, HIDDEN, INNER = 8, 2, 6, 4
STATE = ("slot_of", "expert_of", "uses", "last_use", "fresh", "clock", "_counters")


def _tables(seed: int = 0, poisoned: bool = False):
    """The block's tables; ``poisoned``: experts 4..7 (which only ``_batch``'s dead rows pick)
    are NaN, so a live output that read them is NaN."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randn(EXPERTS, 2 * INNER, HIDDEN, generator=gen), torch.randn(EXPERTS, HIDDEN, INNER, generator=gen)
    if poisoned:
        for t in tables:
            t[4:] = float("nan")
    return tables


def _activate(x):
    return gate(x, "silu", True, False, 0.0, 0.0)


def _call(hidden, ids, weights, tables, live, caches=None, reads=None, warming=True):
    with (warming_a_graph() if warming else contextlib.nullcontext()), using_caches(caches or {}), recording_reads({} if reads is None else reads), reading_rows(live):
        return routed_experts(hidden, ids, weights, *tables, None, None, "silu", True, False, False, 0.0, 0.0, "block")


def _batch(tokens: int, seed: int):
    """A step of ``tokens`` rows whose rows 1, 3, ... pick experts 4..7 and the others 0..3:
    the dead rows below (the odd ones) pick no expert a live row picks."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:K] + (4 if t % 2 else 0) for t in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), dim=-1)
    live = torch.tensor([t % 2 == 0 for t in range(tokens)])
    return hidden, ids, weights, live


@pytest.mark.parametrize("cached", [False, True], ids=["every expert", "cache"])
def test_a_captured_batched_step_reads_its_live_rows_alone(cached):
    """The paths without host syncs (a graphed step; ``warming_a_graph`` takes them on the CPU):
    every expert once (products not read in place, off CUDA), and pairs through a cache of 5
    slots. The live rows' outputs are those of the call over every row and the dead rows' are
    0; a cache looks up the live rows alone, so the dead rows' experts never enter it (with
    them NaN, nothing live is), and its reads are counted per live row. (The GPU test of
    batched MoE decode checks pairs read in place.)"""
    clean, tables = _tables(), _tables(poisoned=cached)  # every expert once reads all of them: no poison there
    hidden, ids, weights, live = _batch(3, seed=1)  # 3 x 2 pairs < 8 experts: pairs, not every expert
    cache = ExpertCache("block", EXPERTS, (2 * INNER * HIDDEN + HIDDEN * INNER) * 4, 5, K, torch.device("cpu")) if cached else None
    caches = {"block": cache} if cached else None
    reads: dict[str, ExpertReads] = {}
    out = _call(hidden, ids, weights, tables, live, caches, reads)
    every_row = _pairs(hidden, ids, weights, *clean, None, None, _activate, False)
    torch.testing.assert_close(out[live], every_row[live], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    if not cached:
        assert (reads["block"].calls, reads["block"].experts, reads["block"].row_experts) == (1, EXPERTS, 0)
        return
    assert (reads["block"].calls, reads["block"].experts, reads["block"].row_experts) == (1, 0, K)
    reads["block"].fold(int(live.sum()))
    assert reads["block"].experts == int(live.sum()) * K and reads["block"].row_experts == 0
    hits, misses = cache.counts()[:2]
    assert hits + misses == int(live.sum()) * K
    held = set(cache.expert_of.tolist()) - {EXPERTS}
    assert held and held <= set(ids[live].reshape(-1).tolist()), held


def test_pairs_of_no_pick_are_zero_and_leave_the_others_as_they_are():
    """``_pairs`` with the dead rows' picks -1 and weights 0 (what a masked call gives it): the
    live rows' products bitwise those of the call over every row."""
    from hostswap.kernels.routed_experts import _without_dead_rows

    tables = _tables()
    hidden, ids, weights, live = _batch(3, seed=5)
    every_row = _pairs(hidden, ids, weights, *tables, None, None, _activate, False)
    out = _pairs(hidden, *_without_dead_rows(ids, weights, live), *tables, None, None, _activate, False)
    assert torch.equal(out[live], every_row[live]) and torch.equal(out[~live], torch.zeros_like(out[~live]))


def test_an_eager_batched_step_reads_the_union_of_its_live_rows():
    """An eager step of several rows (weights read from disk, or a step not graphed) learns the
    union of its live rows' picks alone, and reads each of those experts once: the dead rows'
    experts, NaN here, are never read."""
    hidden, ids, weights, live = _batch(4, seed=2)
    reads: dict[str, ExpertReads] = {}
    out = _call(hidden, ids, weights, _tables(poisoned=True), live, reads=reads, warming=False)
    every_row, _ = _grouped(hidden, ids, weights, *_tables(), None, None, _activate, False, EXPERTS)
    assert reads["block"].experts == len(torch.unique(ids[live]))
    torch.testing.assert_close(out[live], every_row[live], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))


def test_a_batch_of_several_tokens_a_row_marks_each_rows_tokens():
    """A call of 2 tokens per row (hidden states flattened row by row, as a verify pass's) takes
    each row's flag for both its tokens, through a cache: the live row's outputs are the call's
    over every row, and its reads count both tokens' picks (as many as the cache looked up). A
    count of tokens that is not a whole number per row is refused."""
    tables = _tables()
    hidden, ids, weights, _ = _batch(4, seed=3)
    cache = ExpertCache("block", EXPERTS, (2 * INNER * HIDDEN + HIDDEN * INNER) * 4, 5, K, torch.device("cpu"))
    reads: dict[str, ExpertReads] = {}
    out = _call(hidden, ids, weights, tables, torch.tensor([True, False]), {"block": cache}, reads)
    every_row = _pairs(hidden, ids, weights, *tables, None, None, _activate, False)
    torch.testing.assert_close(out[:2], every_row[:2], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    reads["block"].fold(1)
    assert reads["block"].experts == 2 * K == sum(cache.counts()[:2])
    with pytest.raises(ValueError, match=r"live rows given for this forward are 3; block is called with 4 tokens"):
        _call(hidden, ids, weights, tables, torch.tensor([True, False, True]))


def test_the_cache_changes_nothing_for_a_row_nobody_reads():
    """A lookup whose ``live`` flag is false: no slot, no copy, no count, and the cache's state
    and slots exactly as before."""
    tables = _tables()
    cache = ExpertCache("block", EXPERTS, (2 * INNER * HIDDEN + HIDDEN * INNER) * 4, 5, K, torch.device("cpu"))
    cache.lookup(torch.tensor([0, 1]), (*tables, None, None))
    before = {name: getattr(cache, name).clone() for name in STATE}
    slots_before = [t.clone() for t in cache.tables if t is not None]
    target, copy = cache.lookup(torch.tensor([5, 6]), (*tables, None, None), live=torch.tensor(False))
    assert target.tolist() == [-1, -1] and copy.tolist() == [0, 0]
    assert all(torch.equal(getattr(cache, name), before[name]) for name in STATE)
    # byte for byte: a slot never filled holds whatever its memory held, NaN patterns included
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip((t for t in cache.tables if t is not None), slots_before))
    target, copy = cache.lookup(torch.tensor([5, 0]), (*tables, None, None), live=torch.tensor(True))
    assert copy.tolist() == [1, 0] and cache.counts()[:2] == (1, 3)


class _Program:
    def __init__(self, directory):
        torch.manual_seed(0)
        self.model = MOE["Qwen3-MoE"]().eval()  # top-2 of 8 experts
        self.pte, self.ptd = batching.export(self.model, os.path.join(directory, "m"), max_seq_len=32, max_batch_size=4, prefill_chunk=4)
        schedules = load_weight_schedules(self.pte)
        self.floor = load_floor_bytes(schedules)
        self.blocks = schedules["decode"].expert_blocks


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return _Program(tmp_path_factory.mktemp("live-rows"))


def test_a_batched_generator_reads_its_decoding_sequences_experts_alone(program):
    """One sequence in a program of 4 slots: each decode step reads its 2 picks per block (the
    union of one row), not those of the three empty rows; its tokens are transformers'."""
    prompt = torch.randint(0, 128, (5,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = transformers_greedy(program.model, torch.tensor([prompt]), 8, 32)[0, len(prompt):].tolist()
    with batching.BatchGenerator(program.pte, program.ptd, weight_offload_budget_mb=program.floor / MB, device="cpu") as b:
        sequence = b.add(prompt, 8, eos_token_id=[])
        before = {block: r["experts"] for block, r in b.module.stats["expert_reads"].items()}
        steps = 0
        while not sequence.finished:
            b.step()
            steps += 1
        after = b.module.stats["expert_reads"]
        assert sequence.tokens == expected
        assert all(after[block.block]["experts"] - before[block.block] == steps * block.top_k for block in program.blocks), (after, before)


def test_live_rows_that_do_not_fit_the_batch_are_refused_naming_the_method(program):
    """One bool per row of the batch (the first input's first dimension), as many as the first
    call gave; refused before the forward starts."""
    with batching.BatchGenerator(program.pte, program.ptd, weight_offload_budget_mb=program.floor / MB, device="cpu") as b:
        inputs = [torch.zeros(4, 1, dtype=torch.long), torch.zeros(4, 1, dtype=torch.long), torch.arange(4)]
        for bad, said in ((torch.ones(3, dtype=torch.bool), r"\(3,\) torch.bool"), (torch.ones(4, dtype=torch.long), r"\(4,\) torch.int64"),
                          ([[True] * 4], r"\(1, 4\) torch.bool")):
            with pytest.raises(ValueError, match=r"live_rows of method 'decode' must be one bool per row of the batch \(4 rows: the first "
                                                 r"input's first dimension\), got " + said):
                b.module.run_method(batching.DECODE, inputs, live_rows=bad)
        (logits,) = b.module.run_method(batching.DECODE, inputs, live_rows=[True, False, False, True])
        assert logits.shape[0] == 4
