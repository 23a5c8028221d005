"""bench/weights.py end to end on a tiny model on the CPU (what CI can run): every
configuration loads and runs, bf16 and int8, in decode and prefill, and the report renders it."""

import json
import subprocess
import sys

import bench_scripts

ROOT = bench_scripts.ROOT
_report = bench_scripts.load("report")


def test_quick_run_measures_every_configuration_and_int8_beside_bf16(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "bench" / "weights.py"), "--quick", "--device", "cpu", "--layers", "2", "--runs", "2", "--warmup", "1",
                    "--only", "planned d1,all-resident", "--skip", "accelerate", "--quantize", "int8", "--out", str(tmp_path),
                    "--workdir", str(tmp_path / "work")], check=True, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp_path / "weights_cpu.json").read_text())
    rows = result["rows"]
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    for workload in ("decode", "prefill"):
        bf16 = {r["budget_name"] for r in rows if r["workload"] == workload and r["config"] == "planned d1" and not r.get("quantize")}
        int8 = {r["budget_name"] for r in rows if r["workload"] == workload and r.get("quantize") == "int8"}
        assert bf16 >= {"floor", "25%", "50%", "75%"} and int8 == {"floor", "25%", "50%", "75%", "100%"}, (workload, bf16, int8)
    quantized = [r for r in rows if r.get("quantize")]
    # streamed rows are bitwise the scheme's own all-resident forward; logits are compared with bf16's
    assert all(r["bitwise_vs_hostswap_resident"] for r in quantized if "bitwise_vs_hostswap_resident" in r)
    assert all(0 <= r["top1_agreement_vs_plain"] <= 1 for r in quantized)
    assert result["quantized"]["int8"]["total_bytes"] < 0.6 * result["model"]["weight_bytes"]
    assert len(result["load"]) == 4  # floor and all-resident, cold and warm page cache
    full = _report.weights_section([str(tmp_path / "weights_cpu.json")], None)
    assert "pinned H2D n/a GB/s" in full and "**decode, quantized**" in full and "**prefill, quantized**" in full
    assert "| int8, " in full and "| target | met | measured |" in full


def test_an_unknown_quantized_configuration_is_refused_before_anything_is_exported(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "weights.py"), "--quick", "--device", "cpu", "--quantize", "int8",
                          "--quantized-configs", "planned d9", "--out", str(tmp_path), "--workdir", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "--quantized-configs ['planned d9']: choose from" in run.stderr and "'planned d1'" in run.stderr
    assert not list((tmp_path / "work").glob("*.pte"))
