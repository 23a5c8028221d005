"""bench/report.py's target checks, on synthetic rows (no GPU, no benchmark run)."""

import importlib.util
import pathlib

# bench/ is scripts beside the package, not part of the installed one: load the file itself.
_spec = importlib.util.spec_from_file_location("bench_report", pathlib.Path(__file__).parents[1] / "bench" / "report.py")
_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_report)
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
    """docs/benchmarks.md and the README's result tables are what bench/report.py renders from
    bench/results: never edited by hand, never left behind a new result file."""
    stale = [path for path, text in _report.render(draw_plots=False).items() if pathlib.Path(path).read_text() != text]
    assert not stale, f"run python bench/report.py: {stale}"


def test_result_files_are_named_by_benchmark_and_device():
    names = sorted(p.name for p in (pathlib.Path(__file__).parents[1] / "bench" / "results").glob("*.json"))
    assert names, "no benchmark results"
    assert all(n.split("_")[0] in _report.SECTIONS for n in names), names
