"""Generation with the weights beyond the host budget read from disk, against its three-term bound.

    python bench/disk_tier.py --work /tmp/disk-tier              # Llama 3 8B's shape, 16.06 GB of bf16
    python bench/disk_tier.py --work /tmp/disk-tier --size-gb 2  # a smaller Llama shape

A dense Llama bf16 checkpoint is written straight to safetensors shards (bench/checkpoints.py)
and exported with ``hostswap.llm.export_checkpoint`` (kept in ``--work`` for the next run).
In the same process: the pinned host-to-device bandwidth; the disk's O_DIRECT read bandwidth,
reading the ``.ptd`` itself with ``READERS`` threads (bench/export.py); and decode with every
weight resident on the GPU (the compute term). Then for each GPU budget (the floor, half the
weights) and each host budget (all, half and a quarter of the weights) a ``Generator`` decodes
``--new-tokens`` greedy tokens. A row's bound is max(all-resident ms/token, bytes streamed per
token / pinned bandwidth, bytes read from disk per token / disk bandwidth); bench/report.py
sets each row against it. AirLLM (bench/airllm_peer.py), the disk-streaming peer, runs on the
same checkpoint in a child process when it is installed. Rows go to
``bench/results/tiers_<device>.json`` as they are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import hostswap.llm as llm  # noqa: E402
from hostswap.schedules import load_weight_schedules  # noqa: E402
from checkpoints import llama3_8b, llama_of_size, write_checkpoint  # noqa: E402
from export import read_speed  # noqa: E402
from procfs import memory  # noqa: E402
from weights import environment, h2d_bandwidth, result_path  # noqa: E402

MB = 2**20
GPU_BUDGETS = ("floor", "50%")
HOST_SHARES = (("100%", 1.0), ("50%", 0.5), ("25%", 0.25))
MAX_SEQ_LEN, PREFILL_CHUNK, PROMPT = 64, 16, 16


def prepare(work: str, size_gb: float | None) -> tuple[str, dict]:
    """The exported program in ``work`` (written once, then reused) and how it was made."""
    base, facts_path = os.path.join(work, "model"), os.path.join(work, "model.json")
    if os.path.exists(base + ".pte") and os.path.exists(facts_path):
        return base, json.load(open(facts_path))
    folder = os.path.join(work, "checkpoint")
    config = llama3_8b() if not size_gb else llama_of_size(size_gb * 1e9)
    start = time.perf_counter()
    written = write_checkpoint(folder, config)
    facts = {"checkpoint": written, "checkpoint_write_s": time.perf_counter() - start}
    baseline = memory()["rss"]
    start = time.perf_counter()
    llm.export_checkpoint(folder, base, max_seq_len=MAX_SEQ_LEN, prefill_chunk=PREFILL_CHUNK)
    # the export is this process's first large work: its peak is the process's peak so far
    facts.update(export_s=time.perf_counter() - start, export_peak_rss_bytes=memory()["peak"], rss_before_export_bytes=baseline,
                 config=config.to_dict() if hasattr(config, "to_dict") else str(config))
    json.dump(facts, open(facts_path, "w"), default=str)
    return base, facts


def decode_row(base: str, gpu_mb: float, host_mb, new_tokens: int, prompt: torch.Tensor, device: torch.device) -> dict:
    with llm.Generator(base + ".pte", base + ".ptd", weight_offload_budget_mb=gpu_mb, host_memory_budget_mb=host_mb, device=device) as g:
        g.generate(prompt, new_tokens, eos_token_id=[])
        s, m = g.stats, g.module.stats
        return {"ms_per_token": s["ms_per_token"], "prefill_ms": s["prefill_ms"], "bytes_streamed_per_token": s["bytes_streamed_per_token"],
                "bytes_from_disk_per_token": s["bytes_from_disk_per_token"] or 0, "weight_budget_bytes": m["budget_bytes"],
                "host_budget_bytes": m["host_budget_bytes"], "pinned_host_bytes": m["pinned_host_bytes"], "disk_reads": m["disk_reads"],
                "disk_wait_s": m["disk_wait_seconds"], "graphed": g.module.cuda_graph, "load_s": s["load_s"], "warm_up_s": s["warm_up_s"],
                "gpu_peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None, "tiers": g.module.host_budget.explain(g.module.tiers)}


def run_airllm(folder: str, work: str, new_tokens: int, timeout: float) -> dict:
    script = os.path.join(HERE, "airllm_peer.py")
    out = os.path.join(work, "airllm.json")
    try:
        done = subprocess.run([sys.executable, script, folder, "--work", os.path.join(work, "airllm"), "--new-tokens", str(new_tokens),
                               "--prompt-len", str(PROMPT), "--out", out], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    if os.path.exists(out):
        return json.load(open(out))
    return {"error": (done.stderr or done.stdout)[-2000:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="folder for the checkpoint and the program (kept between runs)")
    parser.add_argument("--size-gb", type=float, default=None, help="checkpoint size (default: Llama 3 8B's shape, 16.06 GB)")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--gpu", default=",".join(GPU_BUDGETS), help="GPU budgets: floor and/or percentages of the weights")
    parser.add_argument("--airllm-tokens", type=int, default=2, help="AirLLM's new tokens (0: skip AirLLM)")
    parser.add_argument("--airllm-timeout", type=float, default=300)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--part", default=None)
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu to try the script (no transfer term)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "tiers", device, args.part)
    result = {"environment": environment(device), "rows": []}

    def save():
        json.dump(result, open(path, "w"), indent=1, default=str)

    base, facts = prepare(args.work, args.size_gb)
    result["checkpoint"] = facts
    schedules = load_weight_schedules(base + ".pte")
    total, floor = schedules["decode"].total_bytes, max(s.floor_bytes for s in schedules.values())
    result.update(weight_bytes=total, floor_bytes=floor)
    if device.type == "cuda":
        pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        result["pinned_h2d_bytes_per_s"] = h2d_bandwidth(device, pinned)
        del pinned
    else:
        result["pinned_h2d_bytes_per_s"] = float("inf")
    result["disk_read_bytes_per_s"], result["disk_read_mode"] = read_speed(base + ".ptd")
    print(f"weights {total / 2**30:.2f} GiB, floor {floor / MB:.0f} MiB; pinned H2D {result['pinned_h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"disk {result['disk_read_bytes_per_s'] / 1e9:.2f} GB/s ({result['disk_read_mode']})", flush=True)
    save()
    prompt = torch.randint(0, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    resident = decode_row(base, total / MB + 64, "auto", args.new_tokens, prompt, device)
    result["all_resident"] = resident
    save()
    print(f"all resident: {resident['ms_per_token']:.2f} ms/token", flush=True)
    for gpu in args.gpu.split(","):
        gpu_bytes = floor if gpu == "floor" else max(floor, total * float(gpu.rstrip("%")) / 100)
        for host, share in HOST_SHARES:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            row = {"gpu_budget": gpu, "host_budget": host, **decode_row(base, gpu_bytes / MB + 1, total * share / MB, args.new_tokens, prompt, device)}
            row["bound_ms"] = 1e3 * max(resident["ms_per_token"] / 1e3, row["bytes_streamed_per_token"] / result["pinned_h2d_bytes_per_s"],
                                        row["bytes_from_disk_per_token"] / result["disk_read_bytes_per_s"])
            result["rows"].append(row)
            save()
            print(f"gpu {gpu} host {host}: {row['ms_per_token']:.1f} ms/token, bound {row['bound_ms']:.1f} ({row['ms_per_token'] / row['bound_ms']:.2f}x); "
                  f"{row['bytes_from_disk_per_token'] / 2**30:.2f} GiB/token from disk; {row['tiers']}", flush=True)
    if args.airllm_tokens:
        result["airllm"] = run_airllm(os.path.join(args.work, "checkpoint"), args.work, args.airllm_tokens, args.airllm_timeout)
        save()
        print(f"airllm: {json.dumps(result['airllm'])[:500]}", flush=True)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
