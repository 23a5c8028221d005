"""Which expert a device cache evicts (runtime/expert_cache.py, ``POLICIES``): the one its
router picked least often lately (lfu, the default) or the least recently used (lru), on
worked examples; the pick counts' halving; the slots a batched step's group holds; bad values."""

from __future__ import annotations

import pytest
import torch

from hostswap.runtime import Module
from hostswap.runtime.expert_cache import HALF_LIFE, ExpertCache

EXPERTS, K = 8, 2
TABLES = (torch.arange(EXPERTS, dtype=torch.float32).view(EXPERTS, 1, 1).expand(EXPERTS, 2, 1).contiguous(),
          torch.arange(EXPERTS, dtype=torch.float32).view(EXPERTS, 1, 1).contiguous(), None)


def _cache(slots: int, policy: str = "lfu", **kw) -> ExpertCache:
    return ExpertCache("model.layers.0.mlp.experts", EXPERTS, 3 * 4, slots, K, torch.device("cpu"), policy=policy, **kw)


def _held(cache: ExpertCache) -> list[int]:
    return sorted(e for e in cache.expert_of.tolist() if e < EXPERTS)


def _look(cache: ExpertCache, *ids: int, recent: int = 0) -> torch.Tensor:
    slots, _ = cache.lookup(torch.tensor([ids]), TABLES, recent=recent)
    # whatever the policy, each pick's slot holds that expert's rows
    assert cache.tables[0][slots].reshape(-1, 2)[:, 0].tolist() == list(map(float, ids))
    return slots


@pytest.mark.parametrize("policy,kept", [("lfu", [0, 3, 4]), ("lru", [2, 3, 4])])
def test_a_miss_evicts_the_expert_picked_least_often_or_the_least_recently_used(policy, kept):
    cache = _cache(3, policy)
    _look(cache, 0, 1)
    _look(cache, 0, 2)  # holds 0, 1, 2; 0 picked twice, 1 and 2 once; 1 read longest ago, then 0 (a hit is stamped before a miss)
    _look(cache, 3, 4)  # two misses, no hit held
    # lfu: 1 and 2, picked once, go (1 first, the older); lru: 1 and 0, the least recently used
    assert _held(cache) == kept
    assert cache.uses.tolist() == [2, 1, 1, 1, 1, 0, 0, 0, 0] and cache.policy == policy


def test_an_empty_slot_and_an_unread_guess_go_before_any_expert_a_lookup_read():
    cache = _cache(4, prefetch=1)
    for _ in range(3):
        _look(cache, 0, 1)  # two slots empty
    _look(cache, 2, 3)  # the misses take the empty slots, though 0 and 1 are the favourites either way
    assert _held(cache) == [0, 1, 2, 3]
    cache.prefetch(torch.tensor([5, 0]))  # 5 guessed: it evicts 2 (picked once, older than 3)
    assert _held(cache) == [0, 1, 3, 5] and cache.uses[5] == 0  # a guess counts no pick
    _look(cache, 6, 0)  # the unread guess goes first, before 3 (read, picked as often)
    assert _held(cache) == [0, 1, 3, 6]


def test_the_pick_counts_are_halved_every_half_life_calls():
    cache = _cache(3, half_life=4)
    for call in range(1, 9):
        _look(cache, 0, 1 + call % 2)  # 0 with 2, then 0 with 1, in turn
        if call == 3:
            assert cache.uses[:3].tolist() == [3, 1, 2]
        if call == 4:  # halved, then the call's picks: (3 >> 1) + 1, (1 >> 1) + 1, 2 >> 1
            assert cache.uses[:3].tolist() == [2, 1, 1]
    assert cache.uses[:3].tolist() == [3, 2, 1]  # call 8: (5, 2, 3) halved, then 0 and 1 counted
    assert ExpertCache("b", EXPERTS, 12, 3, K, torch.device("cpu")).half_life == HALF_LIFE


def test_the_counts_keep_their_pace_with_a_guess_between_lookups():
    """A guess before each lookup ticks the clock too: the halving falls on guesses as well, so
    it comes every half_life calls however the lookups and guesses interleave."""
    for fills in (1, 2):  # an odd or even number of calls before decode
        cache = _cache(3, prefetch=1, half_life=4)
        for _ in range(fills):
            cache.fill(torch.tensor([0, 1]), TABLES)
        for _ in range(100):
            cache.prefetch(torch.tensor([0, 1]))
            _look(cache, 0, 1)
        # two picks of each every four calls, halved once: the counts stay at a few, not 100
        assert 1 <= cache.uses[0] == cache.uses[1] <= 4 and cache.uses[2:].sum() == 0, (fills, cache.uses.tolist())


def test_a_lookup_holds_the_slots_its_groups_calls_before_it_stamped():
    """A batched step looks its tokens up one after another and reads their slots after the
    group's last lookup: no lookup of the group may evict an expert another one placed, even
    one the policy would evict first."""
    for recent, kept in ((0, [0, 1, 4, 5]), (1, [2, 3, 4, 5])):
        cache = _cache(4)
        for _ in range(3):
            _look(cache, 0, 1)  # the favourites
        _look(cache, 2, 3)  # the group's first token: picked once each
        _look(cache, 4, 5, recent=recent)  # its second: lfu evicts 2 and 3 unless the group holds them
        assert _held(cache) == kept, recent


def test_a_batched_step_through_a_small_cache_reads_each_tokens_own_experts():
    """The batched path (kernels/routed_experts.py, one group of slots // k tokens at a time)
    against each token's experts read from the tables, with favourites that the lfu policy
    would keep over a token's rare picks."""
    from hostswap.kernels import routed_experts as ops

    torch.manual_seed(0)
    hidden, inner, tokens = 4, 3, 6
    gate_up, down = torch.randn(EXPERTS, 2 * inner, hidden), torch.randn(EXPERTS, hidden, inner)
    act = lambda h: torch.nn.functional.silu(h[..., :inner]) * h[..., inner:]  # noqa: E731
    cache = ExpertCache("block", EXPERTS, (2 * inner * hidden + hidden * inner) * 4, 4, K, torch.device("cpu"))
    for _ in range(5):
        cache.lookup(torch.tensor([[0, 1]]), (gate_up, down, None, None))
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [2, 5], [1, 6]])
    weights = torch.rand(tokens, K)
    x = torch.randn(tokens, hidden)
    got = ops._cached_pairs(x, ids, weights, (gate_up, down, None, None), cache, act, False)
    want = torch.stack([sum(w * (act(x[t] @ gate_up[e].T) @ down[e].T) for e, w in zip(ids[t].tolist(), weights[t])) for t in range(tokens)])
    torch.testing.assert_close(got, want.to(got.dtype))


def test_bad_policy_and_bad_group_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"expert_cache_policy must be one of \('lfu', 'lru'\), got 'fifo'"):
        _cache(3, "fifo")
    # refused before the program is read: no file is needed to name a bad value
    with pytest.raises(ValueError, match=r"expert_cache_policy must be one of \('lfu', 'lru'\), got 'LRU'"):
        Module(tmp_path / "missing.pte", weight_offload_budget_mb=10, device="cpu", expert_cache_policy="LRU")
    cache = _cache(4)  # 4 slots of 2 picks: a group of 2 tokens, the second holding the first's slots
    _look(cache, 0, 1, recent=1)
    with pytest.raises(ValueError, match=r"the expert cache of model.layers.0.mlp.experts holds the slots of at most 1 calls before a lookup, not 2"):
        _look(cache, 2, 3, recent=2)
