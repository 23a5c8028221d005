"""bench/export.py end to end at a few MB on the CPU, and bench/checkpoints.py's shards as
transformers and safetensors read them."""

import json
import subprocess
import sys

import torch

import bench_scripts

ROOT = bench_scripts.ROOT
checkpoints, report = bench_scripts.load("checkpoints"), bench_scripts.load("report")


def test_checkpoint_shards_load_in_transformers_with_the_configs_shapes(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = checkpoints.llama_of_size(4e6)
    info = checkpoints.write_checkpoint(tmp_path / "ckpt", config, shard_bytes=1e6)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert info["shards"] == len(shards) > 1 and index["metadata"]["total_size"] == info["bytes"] == checkpoints.checkpoint_bytes(config)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    params = dict(model.named_parameters())
    assert set(params) == set(index["weight_map"]) == set(checkpoints.tensor_shapes(config))
    for shard in shards:
        with safe_open(tmp_path / "ckpt" / shard, "pt") as f:
            for name in f.keys():
                stored = f.get_tensor(name)
                assert stored.dtype == torch.bfloat16 and tuple(stored.shape) == tuple(params[name].shape), name
                assert torch.equal(stored, params[name]) and 0.01 < stored.float().std() < 0.03, name
    # the preset is Llama 3 8B's shape
    assert checkpoints.checkpoint_bytes(checkpoints.llama3_8b()) == 16_060_522_496


def test_the_benchmark_measures_both_paths_and_the_report_renders_them(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "bench" / "export.py"), "--size-gb", "0", "--small-gb", "0.003", "--disk-gb", "0.05",
                    "--max-seq-len", "16", "--work", str(tmp_path / "work"), "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp_path / "export_cpu.json").read_text())
    disk = result["disk"]
    assert disk["write_bytes_per_s"] > 0 and disk["read_bytes_per_s"] > 0 and disk["read_mode"] in ("O_DIRECT", "buffered, pages dropped with posix_fadvise first")
    rows = result["rows"]
    assert [(r["checkpoint"], r["path"]) for r in rows] == [("llama-0.003gb", "streamed"), ("llama-0.003gb", "in-memory")]
    for r in rows:
        assert "error" not in r, r
        assert r["checkpoint_bytes"] == result["checkpoints"][r["checkpoint"]]["bytes"]
        assert 0 < r["trace_lower_s"] and 0 < r["write_s"] and r["trace_lower_s"] + r["write_s"] + (r["load_s"] or 0) <= r["seconds"]
        assert 0 < r["baseline_rss_bytes"] <= r["peak_rss_bytes"] < 8 * 2**30
        assert r["ptd_bytes"] >= r["checkpoint_bytes"] and r["pte_bytes"] > 0
        if "write_call_bytes" in r:  # /proc/self/io where readable: the export wrote the .ptd
            assert r["write_call_bytes"] >= r["ptd_bytes"]
    assert rows[1]["load_s"] > 0 and rows[0]["load_s"] is None
    assert not (tmp_path / "work" / "llama-0.003gb").exists()  # deleted once measured
    text = report.export_section([str(tmp_path / "export_cpu.json")], None)
    assert "O_DIRECT" in text or "buffered" in text
    assert text.count("| llama-0.003gb (") == 2 and "| in-memory |" in text
