"""bench/load.py and bench/serve.py run on the CPU, on small models, and write their rows."""

from __future__ import annotations

import json

import pytest
import torch

import bench_scripts


def test_load_bench_times_each_part_of_a_load(tmp_path):
    load = bench_scripts.load("load")
    assert load.main(["--layers", "2,3", "--repeat", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "load_cpu.json").read_text())["rows"]
    assert [(r["layers"], r["budget"]) for r in rows] == [(n, b) for n in (2, 3) for b in ("floor", "50%", "all")]
    for r in rows:
        assert r["load_s"] > 0 and r["parse_s"] > 0 and r["layout_s"] >= 0 and r["weights"] == 3 + 9 * r["layers"]


def test_serve_bench_counts_the_servers_tokens_against_the_python_api(tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    serve = bench_scripts.load("serve")
    assert serve.main(["--layers", "1", "--clients", "1,3", "--new-tokens", "4", "--prompt", "8", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "serve_cpu.json").read_text())["rows"]
    assert [r["clients"] for r in rows] == [1, 3]
    for r in rows:
        # every completion ran to max_tokens (no end-of-sequence token) and streamed its words
        assert r["python"]["tokens_per_s"] > 0 and r["server"]["tokens_per_s"] > 0 and r["server"]["words_per_completion_min"] == 4


def test_moe_bench_skews_the_routers_of_a_written_checkpoint_in_place(tmp_path):
    """bench/moe.py's skewed router: column 0 of the embeddings, of each post-attention norm
    and of each router are rewritten in the shards; every other byte stays as written."""
    from safetensors import safe_open

    moe = bench_scripts.load("moe")
    checkpoints = bench_scripts.load("checkpoints")
    config = moe.shape_config("tiny")
    folder = tmp_path / "ckpt"
    checkpoints.write_checkpoint(folder, config, sync=False)

    def tensors():
        out = {}
        for shard in folder.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                out.update({name: f.get_tensor(name) for name in f.keys()})
        return out

    before = tensors()
    told = moe.skew_routers(str(folder), config, exponent=2.0)
    after = tensors()
    assert set(after) == set(before)
    changed = {"model.embed_tokens.weight"} | {f"model.layers.{i}.{n}" for i in range(config.num_hidden_layers)
                                               for n in ("post_attention_layernorm.weight", "mlp.gate.weight")}
    for name, value in after.items():
        if name not in changed:
            assert torch.equal(value.view(torch.int16), before[name].view(torch.int16)), name
            continue
        assert torch.equal(value[..., 1:].view(torch.int16), before[name][..., 1:].view(torch.int16)), name  # only column 0
    assert torch.all(after["model.embed_tokens.weight"][:, 0] == torch.tensor(told["channel"]).to(torch.bfloat16))
    assert torch.all(after["model.layers.0.post_attention_layernorm.weight"][0] == 1)
    bias = after["model.layers.1.mlp.gate.weight"][:, 0].float()
    ranks = torch.tensor(told["popularity_rank"])
    assert torch.equal(torch.argsort(bias, descending=True, stable=True), torch.argsort(ranks, stable=True))  # the most popular biased most


def test_expert_guess_trace_counts_the_next_blocks_picks_it_finds(tmp_path):
    """bench/expert_guess.py on a tiny Mixtral: shares in [0, 1], the guess made before and
    after a layer's experts counted over the same picks; the result file renders."""
    guess = bench_scripts.load("expert_guess")
    row = guess.main(["--shape", "tiny", "--tokens", "6", "--out", str(tmp_path)])
    assert row["decode_steps"] == 5
    assert json.loads((tmp_path / "guess_cpu_tiny.json").read_text()) == row
    section = bench_scripts.load("report").guess_section([str(tmp_path / "guess_cpu_tiny.json")], None)
    assert "**tiny**: 2 layers, 4 experts, top-2; 5 decode steps" in section and section.count("| held ") == 4  # 2 slot counts, 2 policies
    for key in ("guess_found", "guess_after_experts_found", "same_as_previous_token"):
        assert 0.0 <= row[key] <= 1.0, (key, row)
    assert row["guess_found"] > 0  # two of four experts: a guess finds some of them
    # the cache replay: each slot count and policy with no guess, the guess as built and the guess held
    assert [(r["slots"], r["policy"], r["guess"]) for r in row["cache"]] == [(s, p, g) for s in (2, 3) for p in ("lfu", "lru")
                                                                           for g in ("none", "lacking", "held")]
    for r in row["cache"]:
        assert 0.0 <= r["hit_rate"] <= 1.0 and (r["prefetched_per_lookup"] == 0) == (r["guess"] == "none"), r
    # experts on disk: host caches of 2 and 3 slots, alone and behind a device cache of 2, each policy
    assert [(r["device_slots"], r["host_slots"], r["policy"]) for r in row["host_cache"]] == [(d, h, p) for d in (0, 2) for h in (2, 3) for p in ("lfu", "lru")]
    for r in row["host_cache"]:
        assert 0.0 <= r["disk_reads_per_block_token"] <= 2 and (r["host_hit_rate"] is None or 0.0 <= r["host_hit_rate"] <= 1.0), r
    # a cold cache reads the first step's picks: at least top-k a block over the 5 steps
    assert all(r["disk_reads_per_block_token"] * 5 >= 2 for r in row["host_cache"])
    assert "| experts from disk per block and token " in section
    with pytest.raises(SystemExit, match="--shape must be mixtral, many or tiny, got 'big'"):
        guess.main(["--shape", "big"])
    with pytest.raises(SystemExit, match="--slots must be 2 to 3 and --prefetch 1 to 2, got \\[4\\] and 1"):
        guess.main(["--shape", "tiny", "--tokens", "2", "--slots", "4"])
    with pytest.raises(SystemExit, match="--host-slots must be 2 to 4, got \\[1\\]"):
        guess.main(["--shape", "tiny", "--tokens", "2", "--host-slots", "1"])


def test_the_guess_keeps_the_predicted_cached_experts_where_the_lacking_one_evicts_them():
    from hostswap.runtime.expert_cache import ExpertCache

    guess = bench_scripts.load("expert_guess")
    cache = ExpertCache("block", 8, 8, 3, 2, torch.device("cpu"), prefetch=1)
    tables = (torch.zeros(8, 1, 1), torch.zeros(8, 1, 1), None)
    cache.lookup(torch.tensor([[2, 3]]), tables)
    cache.lookup(torch.tensor([[0, 1]]), tables)  # holds 0, 1 and 3 (3 least recently used)
    scores = torch.tensor([0.0, 0.0, 0.0, 9.0, 0.0, 5.0, 0.0, 8.0])
    # lacking: the best missing expert alone, which would evict 3, the predicted pick
    assert guess.lacking_guess(cache, scores).tolist() == [7]
    # held (the cache's own guess): 3 (cached) comes along as a hit, 7 the one missing; 5, missing too, gives way
    assert cache.guess(scores).tolist() == [3, 7]
    cache.prefetch(cache.guess(scores))
    assert sorted(e for e in cache.expert_of.tolist() if e < 8) == [1, 3, 7]  # 0, the least recently used apart from 3, went


def test_moe_batch_bench_measures_each_budget_with_its_caches_and_with_them_withheld(tmp_path):
    """bench/moe_batch.py on the tiny shape on the CPU: an all-resident row, then each budget with
    its caches and with them withheld (the context restores the placement after), with both
    slots decoding and with one, its empty row's experts read or not; the result file renders."""
    import hostswap.runtime.module as runtime_module

    moe_batch = bench_scripts.load("moe_batch")
    place = runtime_module.place_experts
    with moe_batch.caches_withheld():
        assert runtime_module.place_experts(None, 0, None) == (frozenset(), {})
    assert runtime_module.place_experts is place
    reading = runtime_module.reading_rows
    with moe_batch.every_row_read():
        assert runtime_module.reading_rows is not reading
    assert runtime_module.reading_rows is reading
    from hostswap.kernels import routed_experts

    pairs, counter = routed_experts._pairs, routed_experts._device_counter
    with moe_batch.per_pick_products():
        assert routed_experts._pairs is not pairs and routed_experts._device_counter is not counter
    assert (routed_experts._pairs, routed_experts._device_counter) == (pairs, counter)
    assert moe_batch.main(["--shape", "tiny", "--layers", "2", "--batches", "2", "--live", "all,1", "--budgets", "75%", "--new-tokens", "3",
                           "--prompt", "5", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "moebatch_cpu.json").read_text())["rows"]
    assert [(r["live"], r["budget"], r["mode"], r["rows_read"]) for r in rows] == [
        (2, "all", "all resident", "live rows"), (2, "75%", "cache", "live rows"), (2, "75%", "in place", "live rows"),
        (2, "75%", "in place, per pick", "live rows"), (1, "75%", "cache", "live rows"), (1, "75%", "cache", "every row"),
        (1, "75%", "in place", "live rows"), (1, "75%", "in place", "every row"), (1, "75%", "in place, per pick", "live rows")]
    assert all(r["ms_per_step"] > 0 and len(r["tokens"]) == r["live"] and r["same_tokens"] for r in rows[1:])
    # one sequence in two slots: its empty row's experts are read only when every row is
    assert rows[6]["expert_bytes_per_step"] < rows[7]["expert_bytes_per_step"] and rows[6]["speedup_over_every_row"] > 0
    assert rows[2]["speedup_over_per_pick"] > 0 and "speedup_over_per_pick" not in rows[7]
    rows = rows[:3]
    assert rows[1]["same_tokens"] and rows[2]["same_tokens"] and rows[1]["speedup_over_in_place"] > 0
    # the budget gives each block a cache of 2 of its 4 experts; withheld, none
    assert rows[1]["cache_slots"] == [2] and rows[2]["cache_slots"] == [] and rows[0]["resident_blocks"] == 2
    # a CPU step is eager: it reads its union in place whatever the caches (the bytes come from the reads, not the lookups)
    assert rows[0]["expert_bytes_per_step"] == 0 and rows[1]["expert_bytes_per_step"] > 0 and rows[2]["expert_bytes_per_step"] > 0
    section = bench_scripts.load("report").moe_batch_section([str(tmp_path / "moebatch_cpu.json")], None)
    assert "tiny shape, 2 layers, 4 experts, top-2" in section and "| in place " in section


def test_moe_prefill_bench_measures_each_budget_grouped_and_expert_by_expert(tmp_path):
    """bench/moe_prefill.py on the tiny shape on the CPU: the all-resident row and the floor's,
    each run as it runs and with its eager calls of several tokens sent down the per-expert
    loop (the context leaves one-token and captured calls alone, and restores the choice
    after); both give the same first token, and the result file renders."""
    from hostswap.kernels import routed_experts

    moe_prefill = bench_scripts.load("moe_prefill")
    real = routed_experts._reads_in_place
    routed_experts._reads_in_place = lambda hidden, gate_up, down: True
    try:
        with moe_prefill.expert_loop():
            table = torch.zeros(2, 4, 4)
            assert routed_experts._reads_in_place(torch.zeros(1, 4), table, table)
            assert not routed_experts._reads_in_place(torch.zeros(3, 4), table, table)
            with routed_experts.warming_a_graph():
                assert routed_experts._reads_in_place(torch.zeros(3, 4), table, table)
        assert routed_experts._reads_in_place(torch.zeros(3, 4), table, table)
    finally:
        routed_experts._reads_in_place = real
    assert moe_prefill.main(["--shape", "tiny", "--layers", "2", "--budgets", "floor", "--prompt", "12", "--chunk", "4", "--repeats", "1",
                             "--device", "cpu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moeprefill_cpu_tiny.json").read_text())
    rows = result["rows"]
    assert [r["budget"] for r in rows] == ["all resident", "floor"] and result["prefill_chunk"] == 4
    for r in rows:
        assert r["same_first_token"] and r["grouped"]["prefill_ms"] > 0 and r["speedup_over_expert_loop"] > 0 and "bound_ms" not in r
    assert rows[0]["grouped"]["resident_blocks"] == 2 and rows[0]["grouped"]["expert_bytes_prefill"] == 0
    # at the floor each of the 3 chunks reads its union of each of the 2 blocks' experts over the bus: at least top-2, at most all 4
    unit = result["config"]["hidden_size"] * result["config"]["intermediate_size"] * 3 * 2
    floor = rows[1]
    assert 3 * 2 * 2 * unit <= floor["grouped"]["expert_bytes_prefill"] == floor["expert loop"]["expert_bytes_prefill"] <= 3 * 2 * 4 * unit
    section = bench_scripts.load("report").moe_prefill_section([str(tmp_path / "moeprefill_cpu_tiny.json")], None)
    assert "**tiny**: mixtral shape, 2 layers, hidden 64, 4 experts, top-2" in section and "a prompt of 12 tokens in chunks of 4" in section


def test_norms_bench_decodes_each_program_at_each_budget(tmp_path):
    """bench/norms.py on a tiny Llama on the CPU: the program of ATen ops, the one with each norm
    one op (two a layer and the final one) and the one with each rotated query and key one op
    too, at both budgets; on the CPU the ops run the same ATen ops, so the tokens are the same;
    the result file renders."""
    from hostswap.passes.fused_rms_norm import FuseRmsNormPass
    from hostswap.passes.fused_rotary import FuseRotaryPass

    norms = bench_scripts.load("norms")
    calls = FuseRmsNormPass.call, FuseRotaryPass.call
    with norms.passes_off(FuseRmsNormPass, FuseRotaryPass):
        assert FuseRmsNormPass().call(None) == 0 and FuseRotaryPass().call(None) == 0
    assert (FuseRmsNormPass.call, FuseRotaryPass.call) == calls
    assert norms.main(["--models", "tiny", "--budgets", "all,floor", "--new-tokens", "3", "--repeats", "1", "--device", "cpu",
                       "--work", str(tmp_path), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "norms_cpu.json").read_text())
    assert result["models"]["tiny"]["calls"] == {"ATen ops": {"hostswap::rms_norm": 0, "hostswap::rotary": 0},
                                                 "norms": {"hostswap::rms_norm": 5, "hostswap::rotary": 0},
                                                 "norms and rotary": {"hostswap::rms_norm": 5, "hostswap::rotary": 4}}
    assert [r["budget"] for r in result["rows"]] == ["all resident", "floor"]
    for r in result["rows"]:
        for mode in ("norms", "norms and rotary"):
            assert r[mode]["first_difference"] is None and r[mode]["tokens"] == r["ATen ops"]["tokens"] and r[mode]["speedup"] > 0
    section = bench_scripts.load("report").norms_section([str(tmp_path / "norms_cpu.json")], None)
    assert "| llama, 2 layers, hidden 64" in section and "| 5 + 4 " in section and "| yes " in section


def test_grouped_attention_bench_decodes_both_programs_at_each_cache_length(tmp_path):
    """bench/grouped_attention.py on a tiny Llama (4 query heads, 2 KV heads) on the CPU: the
    program whose graph repeats the heads and the one reading the grouped cache, at two cache
    lengths; the same tokens (on the CPU the op repeats the heads itself), the repeated heads
    gone from the activation arena, which grows with the cache only where they are planned;
    the result file renders."""
    gqa = bench_scripts.load("grouped_attention")
    assert gqa.main(["--models", "tiny", "--layers", "2", "--max-seq-lens", "96,192", "--budgets", "all", "--new-tokens", "3", "--repeats", "1",
                     "--device", "cpu", "--work", str(tmp_path), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gqa_cpu.json").read_text())
    rows = result["rows"]
    assert [(r["max_seq_len"], r["budget"]) for r in rows] == [(96, "all resident"), (192, "all resident")]
    for r in rows:
        repeated, grouped = r["heads repeated"], r["grouped in place"]
        assert grouped["tokens"] == repeated["tokens"] and grouped["first_difference"] is None and grouped["speedup"] > 0
        assert grouped["activation_arena_bytes"] < repeated["activation_arena_bytes"]
    (short_repeated, short_grouped), (long_repeated, long_grouped) = [
        (r["heads repeated"]["activation_arena_bytes"], r["grouped in place"]["activation_arena_bytes"]) for r in rows]
    # the repeated heads grow with the cache; what is left grows only by the mask's row
    assert long_repeated - short_repeated > 8 * (long_grouped - short_grouped) > 0
    section = bench_scripts.load("report").gqa_section([str(tmp_path / "gqa_cpu.json")], None)
    assert "| llama, 2 layers, 4 query / 2 KV heads | 192 " in section and "| yes " in section


def test_moe_disk_bench_measures_pinned_and_disk_rows_against_the_disk(tmp_path):
    """bench/moe_disk.py on the tiny shape on the CPU: the pinned row, then a host cache of one
    call's picks per block with the tables on disk, its tokens the pinned row's; the result
    file renders."""
    moe_disk = bench_scripts.load("moe_disk")
    assert moe_disk.main(["--shape", "tiny", "--host-shares", "50%", "--new-tokens", "3", "--prompt", "5", "--device", "cpu",
                          "--work", str(tmp_path / "work"), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moedisk_cpu.json").read_text())
    rows = result["rows"]
    assert [(r["gpu_budget"], r["experts"], r["graphed"]) for r in rows] == [("in place", "pinned", False), ("in place", "disk", False),
                                                                            ("25%", "pinned", False), ("25%", "disk", False)]
    assert result["disk_read_bytes_per_s"] > 0 and result["expert_table_bytes"] > 0
    for pinned, disk in (rows[:2], rows[2:]):
        assert pinned["host_cache_bytes"] == 0 and pinned["disk_bytes_per_token"] == 0
        assert disk["same_tokens"] and disk["host_slots"] == [2] and disk["disk_bytes_per_token"] > 0 and disk["ratio_to_series"] > 0
        # measured again evicting the least recently used: the same tokens, its own reads
        other = disk["other_policy"]
        assert other["same_tokens"] and other["disk_bytes_per_token"] > 0 and disk["policy_speedup"] > 0 and "tokens" not in other
    assert (result["expert_cache_policy"], result["other_policy"]) == ("lfu", "lru")
    section = bench_scripts.load("report").moe_disk_section([str(tmp_path / "moedisk_cpu.json")], None)
    assert "tiny shape, 2 layers, 4 experts, top-2" in section and "| on disk " in section and "host caches evict: lfu" in section
    assert "evicting lru instead" in section
