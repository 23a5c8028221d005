"""bench/load.py and bench/serve.py run on the CPU, on small models, and write their rows."""

from __future__ import annotations

import json

import pytest

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
