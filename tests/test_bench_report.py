"""bench/report.py's target checks, on synthetic rows (no GPU, no benchmark run)."""

import pathlib
import re

import bench_scripts

_report = bench_scripts.load("report")
targets = _report.targets


def _row(config, depth, ratio, policy="planned", budget="75%", workload="prefill"):
    return {"workload": workload, "config": config, "policy": policy, "prefetch_depth": depth, "cuda_graph": False,
            "budget_name": budget, "budget_bytes": 3, "floor_bytes": 1, "bytes_h2d_per_forward": 9,
            "latency_s": ratio * 0.02, "bound_s": 0.02}


def _latency_rows(rows):
    found = {name: (met, detail) for name, met, detail in targets(rows, {"weight_bytes": 10})}
    prefetching = next(v for k, v in found.items() if k.startswith("latency <= 1.10") and "prefetching" in k)
    reference = next(v for k, v in found.items() if k.startswith("depth 0"))
    return prefetching, reference


def test_depth_0_is_reported_beside_the_latency_target_not_inside_it():
    rows = [_row("planned d0", 0, 1.104), _row("planned d1", 1, 1.081), _row("lru d1", 1, 1.03, policy="lru")]
    (met, detail), (ref_met, ref_detail) = _latency_rows(rows)
    assert met and "worst 1.081 (prefill planned d1 75%)" in detail and "misses: none" in detail
    assert not ref_met and "misses: prefill planned d0 75%" in ref_detail


def test_a_prefetching_cell_over_the_target_fails_it():
    rows = [_row("planned d0", 0, 1.05), _row("planned d2", 2, 1.12, budget="50%"), _row("lru d4", 4, 1.2, policy="lru", workload="decode")]
    (met, detail), (ref_met, _) = _latency_rows(rows)
    assert not met and "misses: decode lru d4 75%, prefill planned d2 50%" in detail
    assert ref_met


def test_depth_0_not_run_leaves_its_row_out_and_an_unmeasured_target_fails():
    names = [(name, met) for name, met, _ in targets([_row("planned d1", 1, 1.02)], {"weight_bytes": 10})]
    assert not any(name.startswith("depth 0") for name, _ in names)
    only_d0 = {name: met for name, met, _ in targets([_row("planned d0", 0, 1.02)], {"weight_bytes": 10})}
    assert any(name.startswith("latency <= 1.10") and not met for name, met in only_d0.items())


def test_rendered_results_are_up_to_date():
    """docs/benchmarks.md and the README's headline are what bench/report.py renders from
    bench/results: never edited by hand, never left behind a new result file."""
    rendered = _report.render(draw_plots=False)
    root = pathlib.Path(__file__).parents[1]
    assert {pathlib.Path(path) for path in rendered} == {root / "README.md", root / "docs" / "benchmarks.md"}
    stale = [path for path, text in rendered.items() if pathlib.Path(path).read_text() != text]
    assert not stale, f"run python bench/report.py: {stale}"


def test_the_readme_shows_the_headline_alone():
    """The README holds one generated table, streamed generation's bf16 decode table and plot,
    and one generated sentence each on weights read from disk, MoE and batched decode; every
    other table is in docs/benchmarks.md alone."""
    root = pathlib.Path(__file__).parents[1]
    readme = (root / "README.md").read_text()
    sentences = {"tiers", "moe", "batch"}
    assert set(re.findall(r"<!-- report:(\w+) -->", readme)) == set(_report.README_SECTIONS) == {"generate"} | sentences
    for name in sentences:
        block = readme.split(f"<!-- report:{name} -->")[1].split(f"<!-- /report:{name} -->")[0]
        assert "|" not in block and block.count("\n") <= 3, name  # one sentence, not a second table
    block = readme.split("<!-- report:generate -->")[1].split("<!-- /report:generate -->")[0]
    assert "**decode**" in block and "![generate](bench/results/generate_" in block and "(docs/benchmarks.md)" in block
    assert "quantized" not in block.split("![generate]")[0] and "| target | met | measured |" not in block
    doc = (root / "docs" / "benchmarks.md").read_text()
    for benchmark, title in _report.TITLES.items():
        assert (f"## {title} (" in doc) == bool(_report.result_sets(benchmark)), title  # a section for each benchmark with results


def test_result_files_are_named_by_benchmark_and_device():
    names = sorted(p.name for p in (pathlib.Path(__file__).parents[1] / "bench" / "results").glob("*.json"))
    assert names, "no benchmark results"
    assert all(n.split("_")[0] in _report.SECTIONS for n in names), names


def _generation_run(tmp_path):
    """A synthetic bench/generate.py --quantize int8,int4 result: pinned H2D 50 GB/s, so 1e9
    bytes streamed per token take 20 ms."""
    import json

    def row(config, budget, ms, streamed=0, **extra):
        return {"config": config, "prompt_tokens": 128, "budget_name": budget, "budget_bytes": 2**30, "prefill_ms": 50.0, "ms_per_token": ms,
                "tokens_per_s": 1e3 / ms, "bytes_streamed_per_token": streamed, "new_token_ids": [1, 2, 3], **extra}

    ours = "hostswap planned, decode graphed"

    def q(scheme, budget, ms, streamed, resident):
        total = {"int8": 7 * 2**27, "int4": 3 * 2**27}[scheme]
        return row(ours, budget, ms, streamed, quantize=scheme, all_resident=resident, quantized_total_bytes=total, quantized_floor_bytes=2**26)

    rows = [row("transformers generate, static cache", "100%", 3.0),
            row(ours, "floor", 21.0, 1e9), row(ours, "50%", 10.5, 5e8), row(ours, "100%", 2.0),
            q("int8", "floor", 10.5, 5e8, False), q("int8", "50%", 2.6, 1e8, False), q("int8", "100%", 2.5, 0, True),
            q("int4", "floor", 7.5, 3e8, False), q("int4", "50%", 2.2, 0, True)]
    quality = {"bf16": {"prompt_tokens": 128, "steps": 64, "max_abs_logit_diff": 0.0625, "mean_abs_logit_diff": 0.001, "top1_agreement": 1.0, "reference_max_abs_logit": 4.0},
               "int8": {"prompt_tokens": 128, "steps": 64, "max_abs_logit_diff": 0.25, "mean_abs_logit_diff": 0.02, "top1_agreement": 0.95, "reference_max_abs_logit": 4.0}}
    result = {"environment": {"gpu": "GPU", "torch": "2", "accelerate": None}, "pinned_h2d_bytes_per_s": 50e9,
              "args": {"new_tokens": 128, "peer_tokens": 16}, "model": {"layers": 12, "dtype": "bfloat16", "weight_bytes": 5 * 2**28},
              "rows": rows, "quality": quality, "quantized": {"int8": {"total_bytes": 7 * 2**27}}}
    path = tmp_path / "generate_gpu.json"
    path.write_text(json.dumps(result))
    return str(path)


def test_quantized_rows_get_their_own_table_bound_and_speed_up_over_bf16(tmp_path):
    full = _report.generation_section([_generation_run(tmp_path)], None)
    flat = lambda text: " ".join(text.split())  # noqa: E731
    bf16_table = flat(_report.generation_decode(_report.load_generation([_generation_run(tmp_path)])))
    quantized = flat(full.split("**quantized decode**")[1])
    # the bf16 table is what it was: its rows alone, bounded by bf16 rows alone
    assert bf16_table.count("| Llama 12 layers, 1.25 GiB |") == 2
    assert "| Llama 12 layers, 1.25 GiB | 128 | hostswap planned, decode graphed | 21.0 (1.05) | | 10.5 (1.05) | | 2.0 (1.00) |" in bf16_table
    # int8 floor: 10 ms to stream 5e8 bytes, 21.0 / 10.5 = 2.0 x bf16; 50 %: its own all-resident 2.5 ms bounds it
    assert "| int8, 0.88 GiB | 128 | 10.5 (1.05) 2.0 x | | 2.6 (1.04) 4.0 x | | 2.5 (1.00) 0.8 x R |" in quantized
    assert "| int4, 0.38 GiB | 128 | 7.5 (1.25) 2.8 x | | 2.2 (1.00) 4.8 x R | | |" in quantized
    assert "| bf16 (the program unquantized) | | 128 | 64 | 0.0625 | 0.001 | 4 | 1 |" in quantized
    assert "| int8 | 0.7 | 128 | 64 | 0.25 | 0.02 | 4 | 0.95 |" in quantized
    assert "| int4 | 128 | floor | 1 | | 50 | 7.5 | 133.3 | 286 | 6 | 1.25 | 21 | 2.8 |" in flat(full)
    checks = {name: (met, detail) for name, met, detail in _report.generation_targets(_report.load_generation([_generation_run(tmp_path)]))
              + _report.quantized_targets(_report.load_generation([_generation_run(tmp_path)]))}
    model = "Llama 12 layers, 1.25 GiB"
    assert checks[f"{model}, int8: >= 1.8 x faster than bf16 at the same budget, where bf16 is transfer-bound"] == (
        True, "lowest 2.00 x (prompt 128, floor); floor/128: 2.00, 50%/128: 4.04")  # bf16's 100 % is compute-bound: not counted
    met, detail = checks[f"{model}, int4: >= 3 x faster than bf16 at the same budget, where bf16 is transfer-bound"]
    assert not met and detail.startswith("lowest 2.80 x (prompt 128, floor)")
    assert checks[f"{model}, int4: decode <= 1.10 x bound (quantized bytes) at every budget"] == (False, "worst 1.25 (prompt 128, floor)")
    assert checks[f"{model}, int8: decode <= 1.10 x bound (quantized bytes) at every budget"][0]
    assert checks[f"{model}, int8: the same tokens at every budget"] == (True, "prompt 128: 1 distinct")
    # the bf16 targets see bf16 rows alone
    assert checks[f"{model}: decode <= 1.10 x bound at every budget"] == (True, "worst 1.05 (prompt 128, floor)")
    assert "| target | met | measured |" in full and f"{model}, int4: decode <= 1.10 x bound" in full


def test_the_readme_headline_is_the_bf16_decode_table_at_each_models_shortest_prompt(tmp_path):
    import json

    path = pathlib.Path(_generation_run(tmp_path))
    result = json.loads(path.read_text())
    result["rows"] += [dict(r, prompt_tokens=512) for r in result["rows"] if not r.get("quantize")]
    path.write_text(json.dumps(result))
    flat = lambda text: " ".join(text.split())  # noqa: E731
    headline, full = flat(_report.generation_headline([str(path)])), flat(_report.generation_section([str(path)], None))
    assert "| Llama 12 layers, 1.25 GiB | 128 | hostswap planned, decode graphed | 21.0 (1.05) |" in headline
    assert "| 512 |" not in headline and "quantized" not in headline and "| target |" not in headline
    assert "| Llama 12 layers, 1.25 GiB | 512 | hostswap planned, decode graphed | 21.0 (1.05) |" in full


def _weights_run(tmp_path):
    """A weights result: bf16 plain, all-resident and graphed rows; int8 graphed rows at the
    floor, 50 % and 100 % (all-resident); an int4 row that failed."""
    import json

    def row(config, budget, latency, streamed, bound=None, **extra):
        return {"workload": "decode", "config": config, "policy": None if config == "plain PyTorch" else "planned", "prefetch_depth": 1,
                "cuda_graph": "graph" in config, "budget_name": budget, "budget_bytes": 5, "floor_bytes": 1, "latency_s": latency,
                "bytes_h2d_per_forward": streamed, "bound_s": bound, "max_abs_diff_vs_plain": 0.0, **extra}

    graph = "planned d1 cuda_graph"
    rows = [row("plain PyTorch", "100%", 0.002, 0), row("hostswap all-resident", "100%", 0.002, 0, 0.002), row(graph, "100%", 0.002, 0, 0.002),
            row(graph, "floor", 0.021, 1e9, 0.02), row(graph, "50%", 0.0105, 5e8, 0.01),
            row(graph, "100%", 0.0015, 0, 0.0015, quantize="int8", all_resident=True, max_abs_diff_vs_plain=0.25, top1_agreement_vs_plain=0.5),
            row(graph, "floor", 0.0105, 5e8, 0.01, quantize="int8", all_resident=False, max_abs_diff_vs_plain=0.25, top1_agreement_vs_plain=0.5),
            row(graph, "50%", 0.0018, 5e7, 0.0015, quantize="int8", all_resident=False, max_abs_diff_vs_plain=0.25, top1_agreement_vs_plain=0.5),
            {"workload": "decode", "config": graph, "budget_name": "floor", "budget_bytes": 1, "error": "RuntimeError: x", "quantize": "int4"}]
    result = {"environment": {"gpu": "GPU", "torch": "2.11"}, "model": {"layers": 12, "class": "LlamaForCausalLM", "weight_bytes": 10 * 2**30},
              "pinned_h2d_bytes_per_s": 5e10, "registered_h2d_bytes_per_s": 5e10, "rows": rows, "load": [], "notes": [],
              "quantized": {"int8": {"total_bytes": 5.5 * 2**30, "floor_bytes": 2**27}}}
    path = tmp_path / "weights_gpu.json"
    path.write_text(json.dumps(result))
    return str(path)


def test_weights_quantized_rows_get_their_own_table_bound_speed_up_and_quality(tmp_path):
    full = _report.weights_section([_weights_run(tmp_path)], None)
    flat = lambda text: " ".join(text.split())  # noqa: E731
    bf16_part, quantized = (flat(part) for part in full.split("**decode, quantized**"))
    assert "[int8]" not in bf16_part and "1.5 (1.00)" not in bf16_part  # bf16 tables hold bf16 rows alone
    # floor: 21 / 10.5 = 2.0 x bf16; 50 %: 10.5 / 1.8 = 5.8 x, its bound the scheme's all-resident 1.5 ms; 100 %: all fit
    assert "| int8, 5.50 GiB | planned d1 cuda_graph | 10.5 (1.05) 2.0 x | | 1.8 (1.20) 5.8 x | | 1.5 (1.00) 1.3 x R | 0.25 | 0.5 |" in quantized
    assert "| int4 | planned d1 cuda_graph | fails at load | | | | | | |" in quantized
    checks = {name: (met, detail) for name, met, detail in _report.weights_quantized_targets(
        [r for r in _report.load_weights([_weights_run(tmp_path)])[1] if not r.get("quantize")],
        [r for r in _report.load_weights([_weights_run(tmp_path)])[1] if r.get("quantize")])}
    assert checks["decode, int8: <= 1.10 x bound (quantized bytes) at every streamed budget"] == (False, "worst 1.20 (planned d1 cuda_graph 50%)")
    # bf16 at 100 % streams nothing: not transfer-bound, not counted
    assert checks["decode, int8: >= 1.8 x faster than bf16 at the same budget, where bf16 is transfer-bound"] == (
        True, "lowest 2.00 x (floor); floor: 2.00, 50%: 5.83")
    assert checks["decode, int4: <= 1.10 x bound (quantized bytes) at every streamed budget"] == (False, "not measured: no streamed row")
    assert "decode, int8: >= 1.8 x faster" in full


def test_an_all_resident_moe_figure_measured_without_the_sampling_warm_up_is_flagged(tmp_path):
    """A sampled all-resident MoE row that a load's warm-up did not precede with the sampling
    kernels' first launch bounds its ratios low: the report says so, and only there."""
    import json

    source = pathlib.Path(__file__).parents[1] / "bench" / "results" / "moe_h200_mixtral.json"
    result = json.loads(source.read_text())
    flag = "so a ratio whose bound is this figure reads low"
    for warmed, path in ((False, tmp_path / "moe_cold.json"), (True, tmp_path / "moe_warm.json")):
        result.pop("sampling_warmed_up", None)
        if warmed:
            result["sampling_warmed_up"] = True
        path.write_text(json.dumps(result))
        assert (flag in _report.moe_section([str(path)], None)) == (not warmed)


def test_cached_moe_rows_are_set_against_the_all_resident_step_and_their_misses_in_series():
    """A cached row at 6 ms with 2 ms all resident and 0.2 GB over the bus at 50 GB/s (4 ms):
    1.00 x its serial sum; the compiled row against the compiled all-resident step. Rows whose
    experts are whole on the device, or have no cache, and peers are left out."""
    def run(ms, needed):
        return {"ms_per_token": ms, "bytes_streamed_per_token": 0.0, "needed_expert_bytes_per_token": needed, "cache_slots": 3, "resident_blocks": 0}

    r = {"pinned_h2d_bytes_per_s": 50e9, "all_resident_ms_per_token": 2.0, "all_resident_compiled_ms_per_token": 1.0,
         "rows": [{"routing": "uniform", "routed": run(6.0, 2e8), "routed, compiled": run(6.5, 2e8)},
                  {"routing": "uniform", "routed": {**run(9.0, 0.0), "cache_slots": 0}},
                  {"routing": "uniform", "routed": {**run(2.0, 0.0), "resident_blocks": 2}},
                  {"routing": "peer", "ms_per_token": 50.0}]}
    ratios = _report.moe_serial_ratios(r)
    assert ratios.keys() == {"executor", "compiled"}
    assert abs(ratios["executor"][0] - 1.0) < 1e-9 and abs(ratios["compiled"][0] - 1.3) < 1e-9 and len(ratios["executor"]) == 1
    assert _report.moe_serial_ratios({**r, "pinned_h2d_bytes_per_s": None}) == {}
