"""A captured step's experts read once each (kernels/routed_union.py) against the gathered
per-pick products they replace, and the union reads counted on the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hostswap.kernels import routed_experts
from hostswap.kernels.routed_experts import ExpertReads, recording_reads
from hostswap.kernels.routed_union import MAX_ROWS, routed_union


def _gathered(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, transposed: bool, per_pick: bool) -> torch.Tensor:
    """Each pick's product in float32 from the gathered rows; a pick of -1 gives 0."""
    flat = ids.reshape(-1)
    w = table[flat.clamp(min=0)].float()
    x = x.float() if per_pick else x.float().repeat_interleave(ids.shape[1], dim=0)
    out = torch.bmm(x.unsqueeze(1), w).squeeze(1) if transposed else torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
    return out.masked_fill((flat < 0)[:, None], 0)


def _ids(tokens: int, k: int, experts: int, gen: torch.Generator, none: tuple[int, ...] = ()) -> torch.Tensor:
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    ids[list(none)] = -1
    return ids


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_each_pick_gets_its_product_and_unpicked_experts_are_not_read(dtype, transposed):
    """Tokens of top-3 of 12 experts (rows not live among them), a reduction longer than one
    load, outputs not a multiple of a block, vectors per token and per pick, and more tokens
    than one program multiplies: each pick's product within rounding of the gathered one, a
    pick of -1 exactly 0. The experts no token picked are NaN: a read of any of their bytes
    would show."""
    gen = torch.Generator().manual_seed(0)
    experts, k, n_out, k_in = 12, 3, 40, 300
    for tokens, none in ((1, ()), (5, (1, 3)), (70, (0, 69))):
        ids = _ids(tokens, k, experts, gen, none)
        shape = (experts, k_in, n_out) if transposed else (experts, n_out, k_in)
        table = torch.randn(shape, generator=gen).to(dtype)
        unpicked = sorted(set(range(experts)) - set(ids.reshape(-1).tolist()))
        table[unpicked] = float("nan")
        table, device_ids = table.cuda(), ids.cuda()
        for per_pick in (False, True):
            x = torch.randn(tokens * k if per_pick else tokens, k_in, generator=gen).to(dtype).cuda()
            count = torch.zeros((), dtype=torch.int64, device="cuda")
            got = routed_union(x, table, device_ids, transposed, per_pick, count_into=count)
            # each group of MAX_ROWS tokens reads the experts its picks name
            named = sum(len(set(ids[start : start + MAX_ROWS].reshape(-1).tolist()) - {-1}) for start in range(0, tokens, MAX_ROWS))
            assert int(count) == named
            want = _gathered(x, table, device_ids, transposed, per_pick)
            assert got.dtype == dtype and got.shape == want.shape
            assert not got.isnan().any(), (tokens, per_pick, unpicked)
            assert torch.equal(got[(device_ids.reshape(-1) < 0)], torch.zeros_like(got[(device_ids.reshape(-1) < 0)]))
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            else:  # the float32 sum rounded once: within a unit in the last place of bfloat16
                assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-5).all(), (tokens, per_pick)


@pytest.mark.gpu
def test_a_token_product_does_not_depend_on_its_companions():
    """A token's outputs are the same bits whatever the other tokens picked (or whether they
    are live): a batch row's arithmetic is its own."""
    gen = torch.Generator().manual_seed(1)
    experts, k, tokens = 8, 2, 6
    table = torch.randn(experts, 64, 256, generator=gen).to(torch.bfloat16).cuda()
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16).cuda()
    ids = _ids(tokens, k, experts, gen).cuda()
    first = routed_union(x, table, ids, False, False)
    others = ids.clone()
    others[1:] = _ids(tokens - 1, k, experts, gen).cuda()
    others[3] = -1
    assert torch.equal(routed_union(x, table, others, False, False)[:k], first[:k])


@pytest.mark.gpu
def test_a_token_that_picks_an_expert_twice_gets_it_at_both_picks():
    """A router that names one expert twice for a token (top-k never does; a custom router
    may): the product is at both picks, as per-pick products give it, and the expert is read once."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(4, 48, 64, generator=gen).cuda()
    ids = torch.tensor([[2, 2, 0], [1, 3, 3]]).cuda()
    for per_pick in (False, True):
        x = torch.randn(6 if per_pick else 2, 64, generator=gen).cuda()
        if per_pick:  # a twice-picked expert's vectors are the same (its first product's)
            x[1], x[5] = x[0], x[4]
        count = torch.zeros((), dtype=torch.int64, device="cuda")
        got = routed_union(x, table, ids, False, per_pick, count_into=count)
        torch.testing.assert_close(got, _gathered(x, table, ids, False, per_pick), rtol=1e-5, atol=1e-4)
        assert int(count) == 4


def test_vectors_that_do_not_fit_are_refused_by_shape():
    table, ids = torch.zeros(4, 8, 16), torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"x \(3, 16\) does not fit 2 tokens of 2 picks of a \(4, 8, 16\) table \(one vector a token\)"):
        routed_union(torch.zeros(3, 16), table, ids, False, per_pick=False)
    with pytest.raises(ValueError, match=r"x \(2, 16\) does not fit 2 tokens of 2 picks .* \(one vector a pick\)"):
        routed_union(torch.zeros(2, 16), table, ids, False, per_pick=True)
    with pytest.raises(ValueError, match=r"ids \(4,\) are not \[tokens, k\]"):
        routed_union(torch.zeros(4, 16), table, ids.reshape(-1), False, per_pick=False)


def test_reads_counted_on_the_device_are_settled_once_each():
    """A union call counts its call on the host and hands its kernel the block's device counter
    (made once); ``settle`` adds what the counter gained since the last settle, never writing it."""
    reads: dict[str, ExpertReads] = {}
    with recording_reads(reads):
        counter = routed_experts._device_counter("block", torch.tensor([[3, 1]]), unit_bytes=10)
        assert routed_experts._device_counter("block", torch.tensor([[3, 1]]), unit_bytes=10) is counter
    assert routed_experts._device_counter("block", torch.tensor([[3, 1]]), unit_bytes=10) is None  # nothing records
    r = reads["block"]
    assert (r.calls, r.experts, r.bytes, int(counter)) == (2, 0, 0, 0)
    counter.add_(5)  # as the kernels would
    r.settle()
    assert (r.experts, r.bytes, int(counter)) == (5, 50, 5)
    r.settle()
    assert (r.experts, r.bytes) == (5, 50)
    counter.add_(2)
    r.settle()
    assert (r.experts, r.bytes) == (7, 70)


@pytest.mark.gpu
def test_a_captured_step_reads_the_union_in_place(monkeypatch):
    """Several tokens on the capture's path (``warming_a_graph``), tables on the device: the
    union kernel runs (no per-pick products), its output is the pairs' within rounding, the
    rows not live give 0, and the reads are the live rows' union."""
    gen = torch.Generator().manual_seed(2)
    experts, k, tokens, hidden_size, inner = 8, 2, 4, 256, 96
    hidden = torch.randn(tokens, hidden_size, generator=gen).cuda()
    ids = torch.tensor([[5, 2], [2, 7], [0, 1], [5, 7]]).cuda()
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).cuda()
    gate_up = (torch.randn(experts, 2 * inner, hidden_size, generator=gen) * 0.05).cuda()
    down = (torch.randn(experts, hidden_size, inner, generator=gen) * 0.05).cuda()
    live = torch.tensor([True, True, False, True]).cuda()
    calls = []
    real = routed_experts.routed_union
    monkeypatch.setattr(routed_experts, "routed_union", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    reads: dict[str, ExpertReads] = {}
    with routed_experts.warming_a_graph(), routed_experts.reading_rows(live), recording_reads(reads):
        out = routed_experts.routed_experts(hidden, ids, weights, gate_up, down, None, None, "silu", True, False, False, 0.0, 0.0, "block")
    assert len(calls) == 2
    activate = lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]  # noqa: E731
    want = routed_experts._pairs(hidden, ids, weights, gate_up, down, None, None, activate, False)
    torch.testing.assert_close(out[live], want[live], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    reads["block"].settle()
    assert reads["block"].experts == 3  # 5, 2, 7: row 2's 0 and 1 are not read
