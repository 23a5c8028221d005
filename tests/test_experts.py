"""MoE models read only the experts their router picks.

Each architecture is a transformers model from a tiny random-init config, exported with
``hostswap.llm.export``: its experts modules call ``hostswap::routed_experts``, whose stacked
tables are read in place (row gathers) instead of streamed whole. Greedy tokens must equal
transformers' with a static cache (fp32, CPU) at the floor and with everything resident;
logits must be bitwise those of the exported program and of the all-experts schedule (the
same kernel with its tables streamed whole).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings

import pytest
import torch

import hostswap
import hostswap.llm as llm
from hostswap.experts import UnroutedExpertsWarning, route_experts
from hostswap.kernels.routed_experts import ExpertIndexError
from hostswap.passes.routed_experts import routed_experts
from hostswap.runtime.expert_cache import PREFETCH, ExpertCache
from hostswap.schedules.experts import ExpertBlock, bytes_read_per_call, plan_expert_cache, resident_blocks
from hostswap.schedules.policies import BudgetError
from hostswap.schedules.serialization import load_weight_schedules

from real_models import VOCAB, _decoder_common
from test_generation import transformers_greedy

MB = 2**20
MAX_SEQ_LEN, CHUNK = 30, 4


def _mixtral():
    import transformers as T

    return T.MixtralForCausalLM(T.MixtralConfig(**_decoder_common(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)))


def _qwen2_moe():
    import transformers as T

    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**_decoder_common(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)))


def _qwen3_moe():
    import transformers as T

    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**_decoder_common(
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)))


def _olmoe():
    import transformers as T

    return T.OlmoeForCausalLM(T.OlmoeConfig(**_decoder_common(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, eos_token_id=None)))


def _gpt_oss():
    import transformers as T

    # transposed tables with biases, interleaved gate/up and a clamped gate
    return T.GptOssForCausalLM(T.GptOssConfig(**_decoder_common(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"])))


def _deepseek_v3():
    import transformers as T

    # latent attention (its cache holds the compressed latent and the rotary key, of their own
    # widths), grouped routing with a score correction, a shared expert and a dense first layer
    config = _decoder_common(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                             topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16)
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**config | {"num_hidden_layers": 3}))  # two routed blocks: one guesses the other


# Lowering rounds an op of gpt-oss' decode step differently from the traced program (by about
# 6e-8, outside the experts: the routed and all-experts programs agree bitwise there too).
LOWERED_DIFFERENTLY = {"gpt-oss"}
MOE = {"Mixtral": _mixtral, "Qwen2-MoE": _qwen2_moe, "Qwen3-MoE": _qwen3_moe, "OLMoE": _olmoe, "gpt-oss": _gpt_oss, "DeepSeek-V3": _deepseek_v3}


class ExportedMoE:
    def __init__(self, name: str, directory, gather_from_host: bool = True):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        MOE[name]().save_pretrained(directory)
        self.name, self.directory = name, directory
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        self.programs, constants = llm.export_programs(model, max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK, gather_from_host=gather_from_host)
        self.reference = {m: ep.module() for m, ep in self.programs.items()}
        self.pte, self.ptd = hostswap.save(self.programs, os.path.join(directory, "model"), constant_methods=constants)
        self.schedules = load_weight_schedules(self.pte)
        decode = self.schedules["decode"]
        self.floor = hostswap.schedules.load_floor_bytes(self.schedules)
        # every streamed weight and every expert table on the device
        scratch = max(s.expert_scratch_bytes for s in self.schedules.values())
        self.everything = decode.resident_bytes + sum(b.table_bytes for b in decode.expert_blocks) + scratch
        # every streamed weight on the device and room for top_k + 1 experts of each block: a cache
        self.cache_slots = decode.expert_blocks[0].top_k + 1 if decode.expert_blocks else 0
        self.cached = decode.resident_bytes + sum(self.cache_slots * b.unit_bytes for b in decode.expert_blocks) + scratch

    def transformers_tokens(self, prompt: torch.Tensor, new: int) -> torch.Tensor:
        from transformers import AutoModelForCausalLM

        return transformers_greedy(AutoModelForCausalLM.from_pretrained(self.directory).eval(), prompt, new, MAX_SEQ_LEN)


_exported: dict[tuple[str, bool], ExportedMoE] = {}


def _get(name: str, tmp_path_factory, gather_from_host: bool = True) -> ExportedMoE:
    key = (name, gather_from_host)
    if key not in _exported:
        _exported[key] = ExportedMoE(name, tmp_path_factory.mktemp(f"{name}-{gather_from_host}"), gather_from_host)
    return _exported[key]


@pytest.fixture(scope="module", params=list(MOE))
def moe(request, tmp_path_factory):
    return _get(request.param, tmp_path_factory)


def _prompt(n: int, random_state: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(random_state))


def test_every_experts_module_is_routed_and_its_tables_read_in_place(moe):
    for schedule in moe.schedules.values():
        assert schedule.expert_blocks, "no routed experts in the program"
        tables = {t for b in schedule.expert_blocks for t in b.tables}
        assert tables <= set(schedule.host_read) and not tables & set(schedule.fqns)
        assert all("routed_experts" not in op for op in schedule.kernel_ops)  # it reads no probed weight
    decode = moe.schedules["decode"]
    for b in decode.expert_blocks:
        assert b.tokens == 1 and b.gathers_pairs and b.scratch_bytes == b.top_k * b.unit_bytes
    prefill = moe.schedules["prefill"]
    assert all(b.tokens == CHUNK for b in prefill.expert_blocks)


@pytest.mark.parametrize("budget", ["floor", "cache", "cache-lru", "everything"])
def test_greedy_tokens_equal_transformers(moe, budget):
    prompt = _prompt(7)
    expected = moe.transformers_tokens(prompt, 12)
    mb = {"floor": moe.floor, "cache": moe.cached, "cache-lru": moe.cached, "everything": moe.everything}[budget] / MB
    policy = "lru" if budget == "cache-lru" else "lfu"  # which expert a cache evicts changes no output
    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=mb, device="cpu", expert_cache_policy=policy) as g:
        out = g.generate(prompt, 12, eos_token_id=[])
        assert torch.equal(out, expected), (out.tolist(), expected.tolist())
        s = g.stats
        blocks = moe.schedules["decode"].expert_blocks
        per_token = sum(b.top_k * b.unit_bytes for b in blocks)  # each token's top-k, in every layer
        # each of the prompt's chunks reads, of each block, the union of its tokens' picks: top-k to all of them (none where
        # resident), and a cache's fill brings the chunk's last row's experts in
        chunks = -(-prompt.shape[1] // CHUNK)
        least, most = (sum(b.top_k * b.unit_bytes for b in blocks), sum(b.table_bytes for b in blocks)) if budget != "everything" else (0, 0)
        assert chunks * least <= s["expert_bytes_prefill"] <= chunks * (most + per_token)
        if budget == "floor":
            assert g.module.resident_experts == frozenset()
            assert s["expert_bytes_per_token"] == per_token
            assert all(r["misses"] == r["experts"] > 0 and r["hits"] == 0 and r["filled"] == 0 for r in s["expert_reads"].values())
        elif budget.startswith("cache"):
            assert g.module.resident_experts == frozenset() and set(g.module.expert_caches) == {b.block for b in blocks}
            for r in s["expert_reads"].values():
                assert r["cache_slots"] == moe.cache_slots and r["cache_policy"] == policy and r["hits"] > 0
                # over the bus: the misses, and the experts each prefill chunk's last row brought in
                assert r["hits"] + r["misses"] == r["experts"] and r["bytes"] == (r["misses"] + r["filled"]) * blocks[0].unit_bytes
                assert r["filled"] > 0
                assert r["prefetch"] is None and r["prefetched"] == r["prefetch_hits"] == 0  # no guess unless asked for
            assert 0 < s["expert_bytes_per_token"] < per_token
            assert re.search(rf"expert cache: {moe.cache_slots} experts a block on the device, {policy}, \d+% of decode lookups hit", g.summary()), g.summary()
        else:
            assert g.module.resident_experts == {b.block for b in blocks}
            assert s["expert_bytes_per_token"] == 0
            assert all(r["hits"] == r["experts"] > 0 and r["misses"] == 0 for r in s["expert_reads"].values())


def test_with_the_guess_each_block_prefetches_the_next_and_the_tokens_stay(moe):
    prompt = _prompt(7)
    top_k = moe.schedules["decode"].expert_blocks[0].top_k
    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=moe.cached / MB, device="cpu", expert_prefetch=True) as g:
        assert torch.equal(g.generate(prompt, 12, eos_token_id=[]), moe.transformers_tokens(prompt, 12))
        for i, (block, r) in enumerate(g.stats["expert_reads"].items()):
            assert r["hits"] + r["misses"] == r["experts"]
            # over the bus: the misses, every guessed expert brought in and the prefill's fills
            assert r["bytes"] == (r["misses"] + r["prefetched"] + r["filled"]) * moe.schedules["decode"].expert_blocks[0].unit_bytes
            # the block before guesses every block but the first; a guess a lookup read is a hit
            assert r["prefetch"] == f"{PREFETCH}, 1 per step" and (r["prefetched"] > 0) == (i > 0), (block, r)
            assert 0 <= r["prefetch_hits"] <= min(r["prefetched"], r["cache_hits"])
            # at most one copy a decode step (the prefill's fill made the cache): a guess whose
            # predicted top-k is all cached copies nothing
            assert r["prefetched"] <= (r["cache_hits"] + r["cache_misses"]) // top_k, (block, r)
        assert re.search(r"of decode lookups hit since load, \d+% of \d+ guessed experts read\)", g.summary()), g.summary()
    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=moe.cached / MB, device="cpu", expert_prefetch=top_k) as g:
        assert torch.equal(g.generate(prompt, 12, eos_token_id=[]), moe.transformers_tokens(prompt, 12))
        assert all(r["prefetch"].endswith(f", {top_k} per step") for r in g.stats["expert_reads"].values())
    for bad in ("yes", -1, 1.5):
        with pytest.raises(ValueError, match=f"expert_prefetch must be True, False or a number of experts \\(0 or more\\), got {re.escape(repr(bad))}"):
            llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=moe.cached / MB, device="cpu", expert_prefetch=bad)
    for budget in (moe.floor, moe.cached):  # no cache at the floor: refused all the same
        with pytest.raises(ValueError, match=f"expert_prefetch asks {top_k + 1} guessed experts per block; .* picks {top_k} per token"):
            llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=budget / MB, device="cpu", expert_prefetch=top_k + 1)


@pytest.mark.parametrize("budget", ["in place", "cache"])
def test_compiled_decode_reads_routed_experts_in_place_and_through_a_cache(moe, budget):
    """Decode compiled into one inductor graph (runtime/compiled_method.py) with the routed
    experts' op inside it: read in place from host memory (every other weight resident), or
    through the cache with the guess prefetching. The tokens stay transformers'."""
    from hostswap.runtime.compiled_method import CompiledExecutor

    decode = moe.schedules["decode"]
    scratch = max(s.expert_scratch_bytes for s in moe.schedules.values())
    mb = (decode.resident_bytes + scratch if budget == "in place" else moe.cached) / MB
    prompt = _prompt(7)
    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=mb, device="cpu", compiled=(llm.DECODE,), expert_prefetch=budget == "cache") as g:
        assert isinstance(g.module._probed[llm.DECODE].executor, CompiledExecutor)
        assert bool(g.module.expert_caches) == (budget == "cache") and not g.module.resident_experts
        out = g.generate(prompt, 12, eos_token_id=[])
        reads = g.stats["expert_reads"].values()
    assert torch.equal(out, moe.transformers_tokens(prompt, 12)), out.tolist()
    assert all(r["experts"] > 0 and r["hits"] + r["misses"] == r["experts"] for r in reads)
    assert all((r["cache_hits"] > 0) == (budget == "cache") for r in reads)


def test_compiled_refuses_a_budget_that_streams_other_weights_and_names_the_one_that_holds_them(moe):
    with pytest.raises(ValueError, match=r"compiled needs every weight but routed experts resident.*needs ([0-9.]+) MiB to hold them") as refused:
        llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=moe.floor / MB, device="cpu", compiled=(llm.DECODE,))
    need = float(re.search(r"needs ([0-9.]+) MiB to hold them", str(refused.value)).group(1))
    # the budget named holds them (the experts stay in host memory): far below every expert table
    assert need * MB < moe.everything
    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=need, device="cpu", compiled=(llm.DECODE,)) as g:
        assert not g.module.pool.streamed_weights() and not g.module.resident_experts


def test_generate_command_takes_expert_prefetch_and_policy_and_names_a_bad_value(moe, capsys):
    from hostswap import cli

    top_k = moe.schedules["decode"].expert_blocks[0].top_k
    common = ["generate", moe.pte, "--budget-mb", str(moe.cached / MB), "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "6", "--device", "cpu"]
    assert cli.main([*common, "--expert-prefetch", "1"]) == 0
    assert re.search(r"of decode lookups hit since load, (\d+% of \d+ guessed experts read|no guessed expert copied)\)", capsys.readouterr().err)
    # either eviction: the same tokens; a policy not offered is refused by argparse, naming the choices
    assert cli.main([*common, "--expert-cache-policy", "lru"]) == 0
    lru = capsys.readouterr()
    assert cli.main(common) == 0
    lfu = capsys.readouterr()
    assert lru.out == lfu.out and ", lru, " in lru.err and ", lfu, " in lfu.err
    with pytest.raises(SystemExit):
        cli.main([*common, "--expert-cache-policy", "fifo"])
    err = capsys.readouterr().err
    assert "--expert-cache-policy: invalid choice: 'fifo'" in err and "lfu" in err and "lru" in err
    assert cli.main([*common, "--expert-prefetch", str(top_k + 1)]) == 2
    assert f"hostswap generate: expert_prefetch asks {top_k + 1} guessed experts per block" in capsys.readouterr().err
    # decode compiled, the experts' op inside its graph: the same tokens as the executor's run here
    assert cli.main([*common, "--expert-prefetch", "1", "--compiled"]) == 0
    compiled = capsys.readouterr()
    assert cli.main(common) == 0
    assert compiled.out == capsys.readouterr().out
    at_floor = [*common[:3], str(moe.floor / MB), *common[4:]]
    assert cli.main([*at_floor, "--compiled"]) == 2
    assert "hostswap generate: compiled needs every weight but routed experts resident" in capsys.readouterr().err


def test_a_guess_is_the_predicted_top_k_with_at_most_n_experts_the_cache_lacks():
    experts, k, slots = 8, 2, 4
    gate_up, down = torch.randn(experts, 6, 3), torch.randn(experts, 3, 3)
    cache = ExpertCache("block", experts, (6 * 3 + 3 * 3) * 4, slots, k, torch.device("cpu"), prefetch=1)
    held = lambda: sorted(e for e in cache.expert_of.tolist() if e < experts)  # noqa: E731
    cache.lookup(torch.tensor([[5, 1]]), (gate_up, down, None))
    cache.lookup(torch.tensor([[2, 0]]), (gate_up, down, None))  # holds 0, 1, 2, 5; 5 and 1 least recently used
    scores = torch.tensor([0.0, 1.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0])
    # 5 (cached) and 3 (the best scored missing one); 7, missing too, gives way to no other missing one
    assert cache.guess(scores).tolist() == [5, 3]
    stamp = cache.last_use[cache.slot_of[5]].item()
    cache.prefetch(cache.guess(scores))
    # 3 took the least recently used slot that 5, predicted, does not hold: 1's
    assert held() == [0, 2, 3, 5] and cache.counts()[2] == 1
    # the cached pick kept its slot and its stamp (a guess stamps nothing it found) and is no guess
    assert cache.last_use[cache.slot_of[5]].item() == stamp and not cache.fresh[cache.slot_of[5]]
    # the lookup's miss evicts the older unread guess before an expert a lookup read
    cache.lookup(torch.tensor([[5, 6]]), (gate_up, down, None))
    assert held() == [0, 2, 5, 6]
    # at most N missing whatever the scores, each pick once
    for seed in range(5):
        guess = cache.guess(torch.randn(experts, generator=torch.Generator().manual_seed(seed))).tolist()
        assert len(set(guess)) == k and len(set(guess) - set(held())) <= 1
    # two missing asked for: the two best scored missing experts, even above cached ones
    two = ExpertCache("block", experts, (6 * 3 + 3 * 3) * 4, slots, k, torch.device("cpu"), prefetch=2)
    two.lookup(torch.tensor([[0, 1]]), (gate_up, down, None))
    assert two.guess(torch.tensor([5.0, 0.0, 0.0, 9.0, 0.0, 0.0, 8.0, 0.0])).tolist() == [3, 6]
    two.prefetch(two.guess(torch.tensor([5.0, 0.0, 0.0, 9.0, 0.0, 0.0, 8.0, 0.0])))
    assert sorted(e for e in two.expert_of.tolist() if e < experts) == [0, 1, 3, 6] and two.counts()[2] == 2


def test_logits_bitwise_equal_to_the_exported_program_and_the_all_experts_schedule(moe, tmp_path_factory):
    """Step by step through the shared cache: the program torch.export traced, and the same
    model exported with its expert tables streamed whole (the static schedule)."""
    ids = _prompt(CHUNK, random_state=3)
    steps = [("prefill", ids, torch.arange(CHUNK)), ("decode", ids[:, :1], torch.tensor([CHUNK])), ("decode", ids[:, 1:2], torch.tensor([CHUNK + 1]))]
    for ep in moe.programs.values():
        llm.reset_state(ep)
    with torch.no_grad():
        expected = [moe.reference[m](input_ids=x, cache_position=p) for m, x, p in steps]
    whole = _get(moe.name, tmp_path_factory, gather_from_host=False)
    assert not any(s.expert_blocks for s in whole.schedules.values())
    assert {t for b in moe.schedules["decode"].expert_blocks for t in b.tables} <= set(whole.schedules["decode"].fqns)
    outputs = {}
    for exported in (moe, whole):
        with llm.Generator(exported.pte, exported.ptd, weight_offload_budget_mb=exported.floor / MB, device="cpu") as g:
            outputs[exported] = [g.module.run_method(method, [x, p])[0] for method, x, p in steps]
    for (method, _, _), routed, streamed, want in zip(steps, outputs[moe], outputs[whole], expected):
        assert torch.equal(routed, streamed), (method, (routed - streamed).abs().max().item())
        if moe.name in LOWERED_DIFFERENTLY:
            torch.testing.assert_close(routed, want, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(routed, want), (method, (routed - want).abs().max().item())


def test_prefill_reads_the_union_of_its_chunk_and_decode_each_pick(tmp_path_factory):
    """Counted by the kernel: a chunk (4 tokens, top-2 of 4 experts: the grouped path) reads
    each expert it routes to once; a decode step its top-k, in every layer."""
    moe = _get("Mixtral", tmp_path_factory)
    blocks = moe.schedules["prefill"].expert_blocks
    assert not any(b.gathers_pairs for b in blocks) and all(b.gathers_pairs for b in moe.schedules["decode"].expert_blocks)

    def reads_of(g, method, inputs) -> dict[str, tuple[int, int, int]]:
        before = {k: dataclasses.replace(r) for k, r in g.module.expert_reads.items()}
        g.module.run_method(method, inputs)
        return {k: (r.calls - before[k].calls, r.experts - before[k].experts, r.bytes - before[k].bytes) for k, r in g.module.expert_reads.items()}

    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=moe.floor / MB, device="cpu") as g:
        chunk = reads_of(g, "prefill", [_prompt(CHUNK), torch.arange(CHUNK)])
        assert set(chunk) == {b.block for b in blocks}
        for b in blocks:
            calls, experts, nbytes = chunk[b.block]
            assert calls == 1 and b.top_k <= experts <= b.num_experts < CHUNK * b.top_k and nbytes == experts * b.unit_bytes
        step = reads_of(g, "decode", [_prompt(1), torch.tensor([CHUNK])])
        assert step == {b.block: (1, b.top_k, b.top_k * b.unit_bytes) for b in blocks}


def test_floor_is_the_non_expert_floor_plus_one_layers_picks_and_named_when_short(tmp_path_factory):
    moe = _get("Mixtral", tmp_path_factory)
    decode = moe.schedules["decode"]
    (first, *_) = decode.expert_blocks
    unit = first.unit_bytes
    # Mixtral: gate_up [4, 256, 64] and down [4, 64, 128], fp32: one expert is 96 KiB
    assert unit == (2 * 128 * 64 + 64 * 128) * 4 and first.num_experts == 4 and first.top_k == 2
    assert decode.expert_scratch_bytes == 2 * unit
    assert decode.load_floor_bytes == decode.floor_bytes + 2 * unit
    assert bytes_read_per_call(decode.expert_blocks) == (2 * 2 * unit, 2 * 2 * unit)  # two layers, top-2
    short = (moe.floor - 1) / MB
    with pytest.raises(BudgetError, match=rf"at least {moe.floor} bytes .*one MoE layer's routed experts: {2 * unit} bytes"):
        llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=short, device="cpu")
    report = decode.to_dict(budget_bytes=moe.floor)
    assert report["experts"]["bytes_per_call_at_floor"] == [4 * unit, 4 * unit]
    assert report["budget"]["loads"] and report["budget"]["resident_expert_blocks"] == []
    table = decode.table(budget_bytes=moe.everything)
    assert "Routed experts" in table and "model.layers.1.mlp.experts" in table
    assert report["summary"]["floor_in_place_mb"] == -(-decode.floor_bytes // MB)
    assert f">= {report['summary']['floor_in_place_mb']} MB where a decode step reads its experts in place, as on CUDA with Triton)" in table
    assert "2 of 2 blocks' tables on the device; a call reads 0.00 MB" in table
    assert max(s.all_resident_budget_bytes for s in moe.schedules.values()) == moe.everything
    cached = decode.to_dict(budget_bytes=moe.cached)["budget"]
    assert cached["resident_expert_blocks"] == [] and cached["expert_cache_slots"] == {b.block: moe.cache_slots for b in decode.expert_blocks}
    assert f"expert cache of model.layers.1.mlp.experts: {moe.cache_slots} experts' slots" in decode.table(budget_bytes=moe.cached)


def test_the_floor_adds_the_gathered_picks_only_on_a_device_that_gathers_them(tmp_path_factory, monkeypatch):
    """A block's tables carry their dtype from export to the loaded schedule; a decode step on
    CUDA with Triton reads float tables' picks in place, so the floor there adds no scratch.
    Off CUDA, without Triton, or tables of another dtype (or none known), it does."""
    from hostswap.kernels import routed_gemv
    from hostswap.schedules.experts import shared_dtype

    moe = _get("Mixtral", tmp_path_factory)
    assert all(b.dtype == "float32" for s in moe.schedules.values() for b in s.expert_blocks)
    assert shared_dtype(["bfloat16", "bfloat16"]) == "bfloat16" and shared_dtype(["bfloat16", "float32"]) == "" and shared_dtype([]) == ""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not routed_gemv.reads_in_place_on(cpu, "bfloat16")
    monkeypatch.setattr(routed_gemv, "triton_available", lambda: True)
    assert routed_gemv.reads_in_place_on(cuda, "bfloat16") and routed_gemv.reads_in_place_on(cuda, "float32")
    assert not routed_gemv.reads_in_place_on(cuda, "int8") and not routed_gemv.reads_in_place_on(cuda, "")
    decode = moe.schedules["decode"]
    # the floor a device loads with: the non-expert floor on CUDA with Triton, plus the scratch elsewhere
    assert hostswap.runtime.load_floor_on(moe.schedules, cuda) == max(s.floor_bytes for s in moe.schedules.values()) == moe.floor - decode.expert_scratch_bytes
    assert hostswap.runtime.load_floor_on(moe.schedules, cpu) == moe.floor
    assert decode.to_dict()["summary"]["floor_in_place_mb"] == -(-decode.floor_bytes // MB)
    monkeypatch.setattr(routed_gemv, "triton_available", lambda: False)
    assert not routed_gemv.reads_in_place_on(cuda, "bfloat16")
    assert hostswap.runtime.load_floor_on(moe.schedules, cuda) == moe.floor
    # on the CPU the floor at load keeps the scratch (the floor test above refuses a byte less)
    with llm.Generator(moe.pte, moe.ptd, weight_offload_budget_mb=moe.floor / MB, device="cpu") as g:
        assert g.module.expert_scratch_bytes == moe.schedules["decode"].expert_scratch_bytes > 0


def test_experts_take_the_same_slots_in_every_block_up_to_whole_tables():
    blocks = tuple(ExpertBlock(f"b{i}", (f"t{i}",), 2, 1, 8, 100) for i in range(3))
    assert plan_expert_cache(blocks, 599) == {"b0": 0, "b1": 0, "b2": 0}  # fewer than top-2 each: no cache
    assert plan_expert_cache(blocks, 600) == {"b0": 2, "b1": 2, "b2": 2}
    assert plan_expert_cache(blocks, 2399) == {"b0": 7, "b1": 7, "b2": 7}
    slots = plan_expert_cache(blocks, 2400)
    assert slots == {"b0": 8, "b1": 8, "b2": 8} and resident_blocks(slots, blocks) == {"b0", "b1", "b2"}
    mixed = (ExpertBlock("small", ("s",), 2, 1, 4, 100), ExpertBlock("large", ("l",), 2, 1, 16, 100))
    assert plan_expert_cache(mixed, 1400) == {"small": 4, "large": 10}  # the small block whole, the rest to the large one
    assert bytes_read_per_call(blocks, frozenset({"b0", "b1"})) == (200, 200)
    chunk = ExpertBlock("c", ("t",), 2, 16, 8, 100)  # 16 tokens: the union of their picks, no scratch
    assert not chunk.gathers_pairs and chunk.scratch_bytes == 0 and chunk.units_per_call == (2, 8)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_expert_cache_evicts_as_its_policy_says_and_holds_the_experts_rows(policy):
    """The device-side cache against a plain reference of its policy (lru: least recently used;
    lfu: fewest picks lately, counts halved every 8 calls here, least recently used among
    equals), step by step over random picks (skewed, so that hits and evictions both happen),
    with a guess prefetched before most steps (part right, part wrong) and a prefill's fill
    before some: same hits, same experts held, each slot's rows the expert's rows of the
    tables, and the guesses and fills counted."""
    import collections

    experts, k, slots, half_life = 16, 4, 6, 8
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(experts, 6, 3, generator=gen), torch.randn(experts, 3, 3, generator=gen)
    unit = (6 * 3 + 3 * 3) * 4
    cache = ExpertCache("block", experts, unit, slots, k, torch.device("cpu"), prefetch=True, policy=policy, half_life=half_life)
    lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # held experts, least recently used first
    fresh: set[int] = set()  # experts a guess brought in that no lookup has read yet
    uses = [0] * experts  # picks lately: every call ticks the clock and halves them on a multiple of half_life; a lookup or fill counts
    clock = 0
    popularity = torch.tensor([1.0 / (e + 1) for e in range(experts)])
    hits = prefetched = prefetch_hits = filled = 0

    def use(ids, guess=False):  # the reference; returns the misses
        nonlocal clock, uses
        clock += 1
        uses = [u >> 1 for u in uses] if clock % half_life == 0 else uses
        if not guess:
            for e in ids:
                uses[e] += 1
        for e in ids:  # a lookup's hits are refreshed; a guess refreshes nothing
            if e in lru and not guess:
                lru.move_to_end(e)
                fresh.discard(e)
        missed = [e for e in ids if e not in lru]
        for e in missed:
            if len(lru) == slots:  # unread guesses go first (oldest first), then as the policy says
                order = list(lru)
                rest = sorted((v for v in order if v not in fresh), key=lambda v: (uses[v] if policy == "lfu" else 0, order.index(v)))
                victim = next(v for v in [*(v for v in order if v in fresh), *rest] if v not in ids)
                fresh.discard(victim)
                del lru[victim]
            lru[e] = None
            if guess:
                fresh.add(e)
        return missed

    for step in range(200):
        ids = torch.multinomial(popularity, k, generator=gen)
        if step % 10 == 5:  # a prefill chunk's last row: used as a lookup uses, counted apart
            last = torch.randperm(experts, generator=gen)[:k]
            cache.fill(last, (gate_up, down, None))
            filled += len(use(last.tolist()))
        if step % 4 != 3 and step > 0:  # a guess: two of the picks and two others
            others = [e for e in torch.randperm(experts, generator=gen).tolist() if e not in ids.tolist()][:2]
            guess = ids.tolist()[:2] + others
            cache.prefetch(torch.tensor(guess))
            prefetched += len(use(guess, guess=True))
        target, _ = cache.lookup(ids.view(1, k), (gate_up, down, None))
        hits += sum(e in lru for e in ids.tolist())
        prefetch_hits += sum(e in fresh for e in ids.tolist())
        use(ids.tolist())
        assert sorted(e for e in cache.expert_of.tolist() if e < experts) == sorted(lru), step
        assert torch.equal(cache.tables[0][target], gate_up[ids]) and torch.equal(cache.tables[1][target], down[ids])
        held = cache.expert_of.tolist()
        assert all(cache.slot_of[e].item() == (held.index(e) if e in held else -1) for e in range(experts))
        assert {held[s] for s in range(slots) if cache.fresh[s]} == fresh, step
    assert cache.counts() == (hits, 200 * k - hits, prefetched, prefetch_hits, filled) and 0 < hits < 200 * k and 0 < prefetch_hits < prefetched
    assert 0 < filled <= 20 * k
    with pytest.raises(ValueError, match="needs top_k \\(4\\) to 15 slots, not 3"):
        ExpertCache("block", experts, unit, 3, k, torch.device("cpu"))


def test_each_block_guesses_the_next_blocks_experts_with_its_norm_and_router():
    """The guess a routed block hands the kernel is the next block's router, through the next
    block's input norm, applied to this layer's residual stream, for every architecture."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):  # the routed-experts calls: (block, next_logits, next_block)
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is routed_experts:
                a = list(args) + [None, ""][len(args) - 14:]
                self.seen.append((a[13], a[14], a[15]))
            return func(*args, **(kwargs or {}))

    for name, make in MOE.items():
        torch.manual_seed(0)
        model = make().eval()
        routed = route_experts(model)
        assert routed.unguessed == {}, (name, routed.unguessed)
        layers = model.model.layers
        residuals = {}
        for i, layer in enumerate(layers):
            layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a, i=i: residuals.__setitem__(i, a[0].detach().clone()))
        with torch.no_grad(), Calls() as calls:
            model(_prompt(5))
        assert [c[0] for c in calls.seen] == list(routed.routed), name
        for i, (block, logits, following) in enumerate(calls.seen):
            if i == len(calls.seen) - 1:
                assert logits is None and following == "", name  # the last block guesses nothing
                continue
            here, there = (int(b.split(".")[2]) for b in (block, calls.seen[i + 1][0]))  # model.layers.<L>.mlp.experts
            nxt = layers[there]
            router = getattr(nxt.mlp, "gate", None) or nxt.mlp.router
            x = type(nxt.post_attention_layernorm).forward(nxt.post_attention_layernorm, residuals[here].reshape(5, -1))
            expected = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
            assert following == f"model.layers.{there}.mlp.experts" and torch.equal(logits, expected), name


def test_a_block_whose_router_cannot_be_found_is_not_guessed():
    model = _mixtral().eval()
    layer = model.model.layers[1]
    layer.mlp.score = torch.nn.Linear(layer.mlp.gate.weight.shape[1], layer.mlp.gate.weight.shape[0], bias=False)  # two candidates
    routed = route_experts(model)
    assert routed.unguessed == {"model.layers.1.mlp.experts": "no single module beside it scores its 4 experts"}
    model = _mixtral().eval()
    del model.model.layers[0].post_attention_layernorm
    assert route_experts(model).unguessed == {
        "model.layers.1.mlp.experts": "no input norm (post_attention_layernorm) found for its layer or the one before"}


def test_an_expert_index_out_of_range_is_refused_naming_the_block():
    torch.manual_seed(0)
    hidden = torch.randn(3, 8)
    gate_up, down = torch.randn(4, 32, 8), torch.randn(4, 8, 16)
    weights = torch.full((3, 2), 0.5)
    args = ("silu", True, False, False, 0.0, 0.0, "model.layers.5.mlp.experts")
    for bad in (4, -1):  # -1 would wrap to the last expert under Python indexing
        for tokens in (1, 3):  # the pair path and the grouped path
            ids = torch.tensor([[0, bad], [2, 1], [1, 3]])[:tokens]
            with pytest.raises(ExpertIndexError, match=rf"router of model.layers.5.mlp.experts picked an expert outside 0..3.*\(expert {bad}\)"):
                routed_experts(hidden[:tokens], ids, weights[:tokens], gate_up, down, None, None, *args)


def test_a_corrupted_router_stops_generation_with_the_block_named(tmp_path):
    """A router whose picks run past the experts: the program refuses, never reading another
    expert's rows."""
    model = _mixtral().eval()
    router = model.model.layers[1].mlp.gate
    original = router.forward

    def corrupted(hidden_states):
        logits, scores, indices = original(hidden_states)
        return logits, scores, indices + router.num_experts - 1  # every pick but expert 0 runs past the last

    router.forward = corrupted
    pte, ptd = llm.export(model, tmp_path / "m", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    floor = hostswap.schedules.load_floor_bytes(load_weight_schedules(pte))
    with llm.Generator(pte, ptd, weight_offload_budget_mb=floor / MB, device="cpu", warm_up=False) as g:
        with pytest.raises(ExpertIndexError, match=re.escape("router of model.layers.1.mlp.experts picked an expert outside 0..3")):
            g.generate(_prompt(7), 4, eos_token_id=[])


def test_experts_the_kernel_cannot_run_keep_the_all_experts_schedule_with_a_warning(tmp_path):
    model = _mixtral().eval()
    odd = model.model.layers[0].mlp.experts
    odd.act_fn = torch.nn.Tanh()  # an activation the kernel does not have
    with pytest.warns(UnroutedExpertsWarning, match=r"MoE experts 'model.layers.0.mlp.experts' \(MixtralExperts\) keep the all-experts schedule: its gate matches none"):
        routed = route_experts(model)
    assert set(routed.routed) == {"model.layers.1.mlp.experts"} and set(routed.kept) == {"model.layers.0.mlp.experts"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnroutedExpertsWarning)
        pte, ptd = llm.export(model, tmp_path / "m", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    decode = load_weight_schedules(pte)["decode"]
    assert [b.block for b in decode.expert_blocks] == ["model.layers.1.mlp.experts"]
    assert "model.model.layers.0.mlp.experts.gate_up_proj" in decode.fqns  # streamed whole, as every weight
    prompt = _prompt(7)
    with torch.no_grad():
        expected = model(prompt).logits
    with llm.Generator(pte, ptd, weight_offload_budget_mb=hostswap.schedules.load_floor_bytes(load_weight_schedules(pte)) / MB, device="cpu") as g:
        (logits,) = g.module.run_method("prefill", [prompt[:, :CHUNK], torch.arange(CHUNK)])
    torch.testing.assert_close(logits[0], expected[0, :CHUNK], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["Mixtral", "Qwen2-MoE", "DeepSeek-V3"])
def test_streamed_export_of_a_checkpoint_routes_the_same_experts(name, tmp_path, tmp_path_factory):
    """From the safetensors checkpoint without loading the model: the same expert blocks,
    weights and tokens as the in-memory export. The checkpoints store one linear per expert
    (Mixtral's ``block_sparse_moe.experts.<e>.w1``, ...), as the published ones do: the stacked
    tables are built by transformers' own conversion mapping, one table at a time."""
    from hostswap.checkpoint import export_checkpoint
    from hostswap.runtime.ptd import PtdFile

    moe = _get(name, tmp_path_factory)
    pte, ptd = export_checkpoint(moe.directory, tmp_path / "streamed", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    streamed = load_weight_schedules(pte)
    assert {m: s.expert_blocks for m, s in streamed.items()} == {m: s.expert_blocks for m, s in moe.schedules.items()}
    with PtdFile(moe.ptd) as a, PtdFile(ptd) as b:
        assert a.index.checksums == b.index.checksums
    prompt = _prompt(7)
    with llm.Generator(pte, ptd, weight_offload_budget_mb=moe.floor / MB, device="cpu") as g:
        assert torch.equal(g.generate(prompt, 8, eos_token_id=[]), moe.transformers_tokens(prompt, 8))


def test_streamed_export_refuses_a_constant_tracing_cannot_know(tmp_path, tmp_path_factory):
    """gpt-oss' forward creates scalar tensors: traced without weights they have no value, and
    the export says so (naming one) instead of failing inside ExecuTorch."""
    from hostswap.checkpoint import export_checkpoint
    from hostswap.passes.lowering import UntracedConstantError

    moe = _get("gpt-oss", tmp_path_factory)
    with pytest.raises(UntracedConstantError, match=r"method 'prefill' creates a tensor in its forward \('model.model.lifted_tensor_\d'.*export the loaded model"):
        export_checkpoint(moe.directory, tmp_path / "streamed", max_seq_len=MAX_SEQ_LEN, prefill_chunk=CHUNK)
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_three_ways_through_agree():
    """Pairs (gathered rows, batched matmuls), grouped (the union, eager loop) and dense (every
    expert over every token, weighted; a captured batched decode) compute the same function:
    within fp32 rounding of one another on the same routing, gated and plain, with biases and
    transposed tables."""
    from hostswap.kernels.routed_experts import _dense, _grouped, _pairs, gate

    torch.manual_seed(0)
    tokens, hidden_size, inner, experts, k = 3, 16, 24, 4, 2
    hidden = torch.randn(tokens, hidden_size)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k), dim=-1)
    for gated, transposed, biased in ((True, False, False), (True, True, True), (False, False, True)):
        width = 2 * inner if gated else inner
        gate_up = torch.randn(experts, hidden_size, width) if transposed else torch.randn(experts, width, hidden_size)
        down = torch.randn(experts, inner, hidden_size) if transposed else torch.randn(experts, hidden_size, inner)
        biases = (torch.randn(experts, width), torch.randn(experts, hidden_size)) if biased else (None, None)
        activate = lambda x, g=gated: gate(x, "silu", g, False, 0.0, 0.0)  # noqa: E731
        tables = (gate_up, down, *biases)
        pairs = _pairs(hidden, ids, weights, *tables, activate, transposed)
        grouped, read = _grouped(hidden, ids, weights, *tables, activate, transposed, tables[0].shape[0])
        dense = _dense(hidden, ids, weights, *tables, activate, transposed)
        assert read == len(torch.unique(ids))
        torch.testing.assert_close(grouped, pairs, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(dense, pairs, atol=1e-4, rtol=1e-5)


def test_two_modules_in_two_threads_read_their_own_expert_caches(tmp_path_factory):
    """The kernel finds its Module's caches and read counters per thread: two MoE models whose
    blocks have the same names, decoding at once in two threads, each give the tokens they
    give alone and count only their own reads."""
    import threading

    models = [_get(name, tmp_path_factory) for name in ("Qwen3-MoE", "OLMoE")]
    assert {b.block for b in models[0].schedules["decode"].expert_blocks} == {b.block for b in models[1].schedules["decode"].expert_blocks}
    prompt = _prompt(5)
    generators = [llm.Generator(m.pte, m.ptd, weight_offload_budget_mb=m.cached / MB, device="cpu") for m in models]
    try:
        def reads(g):
            return sum(r["experts"] for r in g.stats["expert_reads"].values())

        alone = [g.generate(prompt, 10, eos_token_id=[]) for g in generators]  # the first call reads a little more (warm-up)
        first = [reads(g) for g in generators]
        assert all(torch.equal(g.generate(prompt, 10, eos_token_id=[]), out) for g, out in zip(generators, alone))
        per_call = [reads(g) - f for g, f in zip(generators, first)]
        results, errors = [None, None], []
        barrier = threading.Barrier(2)

        def run(i):
            try:
                barrier.wait()
                results[i] = [generators[i].generate(prompt, 10, eos_token_id=[]) for _ in range(3)]
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i, g in enumerate(generators):
            assert all(torch.equal(out, alone[i]) for out in results[i])
            assert reads(g) == first[i] + 4 * per_call[i]
    finally:
        for g in generators:
            g.close()


def test_a_captured_batched_step_off_cuda_reads_every_expert_once():
    """Where products are not read in place (off CUDA), a call of several tokens on the
    capture's path cannot learn its union: every expert is read once, whatever the rows pick,
    and the output is the pairs'. (On CUDA it reads the union: tests/test_routed_union.py.)"""
    from hostswap.kernels.routed_experts import _pairs, gate, recording_reads, routed_experts, warming_a_graph

    gen = torch.Generator().manual_seed(0)
    experts, k, tokens, hidden_size, inner = 8, 2, 3, 6, 4
    gate_up, down = torch.randn(experts, 2 * inner, hidden_size, generator=gen), torch.randn(experts, hidden_size, inner, generator=gen)
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    ids, weights = torch.tensor([[0, 1], [1, 0], [0, 2]]), torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    reads = {}
    with warming_a_graph(), recording_reads(reads):
        out = routed_experts(hidden, ids, weights, gate_up, down, None, None, "silu", True, False, False, 0.0, 0.0, "block")
    activate = lambda x: gate(x, "silu", True, False, 0.0, 0.0)  # noqa: E731
    torch.testing.assert_close(out, _pairs(hidden, ids, weights, gate_up, down, None, None, activate, False), atol=1e-5, rtol=1e-5)
    assert (reads["block"].calls, reads["block"].experts, reads["block"].on_device) == (1, experts, None)


@pytest.mark.parametrize("tokens", [1, 3, 5])
def test_a_captured_batched_step_runs_its_pairs_from_the_cache(tokens):
    """A batched decode step's path without host syncs (``warming_a_graph`` takes it on any
    device) through a block's cache of 5 slots for top-2 of 8: tokens looked up in turn, two at
    a time (the slots hold 2 tokens' picks), each pair multiplied from its slot. The output is
    the pairs read from the tables; the cache counts a lookup per token, an expert two tokens of
    one group pick is copied once, and every slot holds its expert's rows."""
    from hostswap.kernels.routed_experts import _pairs, gate, recording_reads, routed_experts, using_caches, warming_a_graph

    experts, k, slots, hidden_size, inner = 8, 2, 5, 6, 4
    gen = torch.Generator().manual_seed(tokens)
    gate_up, down = torch.randn(experts, 2 * inner, hidden_size, generator=gen), torch.randn(experts, hidden_size, inner, generator=gen)
    cache = ExpertCache("block", experts, (2 * inner * hidden_size + hidden_size * inner) * 4, slots, k, torch.device("cpu"))
    activate = lambda x: gate(x, "silu", True, False, 0.0, 0.0)  # noqa: E731
    reads = {}
    for step in range(4):
        hidden = torch.randn(tokens, hidden_size, generator=gen)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
        if tokens > 1:
            ids[1] = ids[0].flip(0)  # the second token picks the first one's experts: hits within a group
        weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
        before = cache.counts()
        with warming_a_graph(), using_caches({"block": cache}), recording_reads(reads):
            out = routed_experts(hidden, ids, weights, gate_up, down, None, None, "silu", True, False, False, 0.0, 0.0, "block")
        torch.testing.assert_close(out, _pairs(hidden, ids, weights, gate_up, down, None, None, activate, False), atol=1e-5, rtol=1e-5)
        hits, misses = (a - b for a, b in zip(cache.counts()[:2], before[:2]))
        assert hits + misses == tokens * k
        if tokens > 1:
            assert hits >= k  # the second token's picks: the first one's, copied in by its lookup
        held = cache.expert_of.tolist()
        assert all(torch.equal(cache.tables[0][s], gate_up[e]) and torch.equal(cache.tables[1][s], down[e]) for s, e in enumerate(held) if e < experts)
    assert reads["block"].experts == 4 * tokens * k
