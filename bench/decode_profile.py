"""Where a streamed decode step spends its time: the copy engine's gaps, fill by fill.

    python bench/decode_profile.py --layers 12 --budgets floor,75%
    python bench/decode_profile.py --layers 12 --quantize int8 --budgets floor,289MiB

A transformers Llama (the one bench/generate.py uses) is exported with ``hostswap.llm.export``
and, for each budget (floor, a share of the program's weight bytes, or MiB), loaded with a
``Generator``: decode is timed (ms per token against bytes streamed / pinned H2D bandwidth of
this run), then a few graphed decode steps are traced with ``torch.profiler``. From the
trace, per replay: the time the copy engine was busy and the bandwidth while busy, the time
kernels ran, and every gap between two weight copies, attributed to the fill it precedes
(weight, bytes, the kernel the fill waits for). A gap before a fill that waits for no kernel
of its forward is the forward's boundary (the compute after the last copy, then the next
replay's start); a gap before a fill that waits for a kernel is compute the ring made the copy
wait for. The rows and the largest gaps go to ``bench/results/decode_profile_<device>.json``,
and each budget's trace to ``<traces>/decode_profile_<budget>.json.gz`` (a temporary folder
unless ``--traces`` names one), for chrome://tracing or Perfetto.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import sys
import tempfile
import time

import torch

KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclasses.dataclass(frozen=True)
class Fill:
    """One ring fill of a forward, in issue order."""

    weight: str
    nbytes: int
    waits_for_kernel: int  # -1: waits for no kernel of its own forward


def _union_us(intervals) -> float:
    total, current = 0.0, None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    return total + (current[1] - current[0] if current else 0.0)


def replay_timeline(trace_events: list[dict], fills: list[Fill]) -> dict:
    """What the GPU did in the traced graph replays (Chrome-trace events of ``torch.profiler``).

    GPU work is attributed to replays through the correlation id of its ``cudaGraphLaunch``.
    Host-to-device copies are taken as the ring fills in issue order, ``fills`` per replay;
    each gap before a copy is charged to the fill that copy makes. Times in microseconds.
    """
    launches = {e["args"]["correlation"] for e in trace_events if e.get("ph") == "X" and e.get("name") == "cudaGraphLaunch"}
    gpu = sorted((e for e in trace_events if e.get("ph") == "X" and e.get("cat") in KERNEL_CATEGORIES
                  and e.get("args", {}).get("correlation") in launches), key=lambda e: e["ts"])
    if not launches or not gpu:
        raise ValueError("the trace holds no GPU work of a graph replay: trace graphed decode steps with CUDA activity")
    copies = [e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]]
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    replays = len(launches)
    if len(copies) != replays * len(fills):
        raise ValueError(f"{len(copies)} host-to-device copies in {replays} replays, but the layout issues {len(fills)} fills per forward")
    gaps: dict[int, list[float]] = {}
    for i, (before, after) in enumerate(zip(copies, copies[1:])):
        gaps.setdefault((i + 1) % len(fills), []).append(after["ts"] - before["ts"] - before["dur"])
    copy_busy = _union_us((e["ts"], e["ts"] + e["dur"]) for e in copies)
    copied = sum(e.get("args", {}).get("bytes", 0) for e in copies)
    per_fill = []
    for index, values in gaps.items():
        fill = fills[index]
        per_fill.append({"fill": index, "weight": fill.weight, "bytes": fill.nbytes, "waits_for_kernel": fill.waits_for_kernel,
                         "mean_gap_us": sum(values) / len(values)})
    per_fill.sort(key=lambda g: -g["mean_gap_us"])
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    boundary = sum(g["mean_gap_us"] for g in per_fill if g["waits_for_kernel"] < 0)
    return {
        "replays": replays,
        "span_us_per_replay": span / replays,
        "copies_per_replay": len(copies) / replays,
        "copy_busy_us_per_replay": copy_busy / replays,
        "copy_bytes_per_s_while_busy": copied / copy_busy * 1e6 if copy_busy else None,
        "kernel_busy_us_per_replay": _union_us((e["ts"], e["ts"] + e["dur"]) for e in kernels) / replays,
        "copy_gap_us_per_replay": sum(g["mean_gap_us"] for g in per_fill),
        "gap_before_unwaited_fills_us_per_replay": boundary,
        "gaps": per_fill,
    }


def layout_fills(module) -> list[Fill]:
    """The ring fills of a loaded planned ``Module``'s forward, in issue order: one copy each."""
    pool, schedule = module.pool, module.schedule
    layout = pool.layout
    return [Fill(schedule.fqns[schedule.probe_weight[p]], schedule.weight_bytes[schedule.probe_weight[p]], layout.fill_waits_for[p])
            for p in sorted(layout.fill_offset)]


def budget_bytes(name: str, schedule) -> int:
    if name == "floor":
        return schedule.floor_bytes
    if name.endswith("MiB"):
        return max(schedule.floor_bytes, int(float(name[:-3]) * 2**20))
    if name.endswith("%"):
        share = float(name[:-1]) / 100
        return schedule.total_bytes + 2**20 if share >= 1 else max(schedule.floor_bytes, int(share * schedule.total_bytes))
    raise ValueError(f"budget {name!r}: give floor, a share such as 75%, or MiB such as 289MiB")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--quantize", choices=("int8", "int4"))
    p.add_argument("--budgets", type=lambda v: v.split(","), default=["floor", "75%"], help="floor, shares (75%%) or MiB (289MiB)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="new tokens of the timed generation")
    p.add_argument("--traced-tokens", type=int, default=9, help="new tokens of the traced generation")
    p.add_argument("--show", type=int, default=12, help="largest gaps printed per budget")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--workdir", default=tempfile.gettempdir())
    p.add_argument("--traces", help="folder for the traces (default: a new temporary one)")
    args = p.parse_args(argv)
    for name in args.budgets:
        if not (name == "floor" or name.endswith("%") or name.endswith("MiB")):
            p.error(f"--budgets: {name!r} is not floor, a share such as 75%, or MiB such as 289MiB")
    if not torch.cuda.is_available():
        print("bench/decode_profile.py traces graphed decode on a CUDA device", file=sys.stderr)
        return 2

    # run as a script: the package and the sibling benchmarks (only then, so that a test can
    # load this file for its trace reading without either on the path)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hostswap
    import hostswap.llm as llm
    from generate import llama
    from weights import environment, h2d_bandwidth, result_path

    device = torch.device("cuda")
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {message}", flush=True)

    pinned = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    bandwidth = h2d_bandwidth(device, pinned)
    del pinned
    model = llama(args.layers)
    if args.quantize:
        model = llm.quantize(model, args.quantize)
    programs, constants = llm.export_programs(model, max_seq_len=args.prompt + args.tokens + args.traced_tokens, progress=lambda m: log(f"export: {m}"))
    del model
    pte, ptd = hostswap.save(programs, os.path.join(tempfile.mkdtemp(dir=args.workdir), "llama"), constant_methods=constants)
    del programs
    schedule = hostswap.schedules.load_weight_schedule(pte, llm.DECODE)
    prompt = torch.randint(0, 32000, (1, args.prompt), generator=torch.Generator().manual_seed(args.prompt))
    os.makedirs(args.out, exist_ok=True)
    traces = args.traces or tempfile.mkdtemp(dir=args.workdir, prefix="decode_profile_")
    os.makedirs(traces, exist_ok=True)
    result = {"environment": environment(device), "args": vars(args), "pinned_h2d_bytes_per_s": bandwidth, "rows": []}
    log(f"pinned H2D {bandwidth / 1e9:.1f} GB/s; {schedule.total_bytes / 2**20:.0f} MiB of weights, floor {schedule.floor_bytes / 2**20:.0f} MiB")
    for name in args.budgets:
        budget = budget_bytes(name, schedule)
        with llm.Generator(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=device) as g:
            g.generate(prompt, 4)
            g.generate(prompt, args.tokens)
            stats = g.stats
            streamed = stats["bytes_streamed_per_token"] or 0
            row = {"budget_name": name, "budget_bytes": budget, "ms_per_token": stats["ms_per_token"], "bytes_streamed_per_token": streamed,
                   "transfer_ms_per_token": streamed / bandwidth * 1e3}
            fills = layout_fills(g.module)
            if fills:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                    g.generate(prompt, args.traced_tokens)
                trace = os.path.join(traces, f"decode_profile_{name.replace('%', 'pct')}.json")
                prof.export_chrome_trace(trace)
                with open(trace) as f:
                    text = f.read()
                with gzip.open(trace + ".gz", "wt") as z:
                    z.write(text)
                os.remove(trace)
                timeline = replay_timeline(json.loads(text)["traceEvents"], fills)
                row.update({k: v for k, v in timeline.items() if k != "gaps"}, largest_gaps=timeline["gaps"][: args.show], trace=trace + ".gz")
        result["rows"].append(row)
        ratio = row["ms_per_token"] / row["transfer_ms_per_token"] if streamed else None
        log(f"{name}: {row['ms_per_token']:.2f} ms/token, {streamed / 2**20:.0f} MiB streamed per token" + (f" ({ratio:.3f} of the transfer time)" if ratio else ""))
        if fills:
            log(f"   per replay: {row['copies_per_replay']:.0f} copies busy {row['copy_busy_us_per_replay'] / 1e3:.2f} ms at "
                f"{row['copy_bytes_per_s_while_busy'] / 1e9:.1f} GB/s; kernels {row['kernel_busy_us_per_replay'] / 1e3:.2f} ms; copy engine idle "
                f"{row['copy_gap_us_per_replay'] / 1e3:.2f} ms, of it {row['gap_before_unwaited_fills_us_per_replay'] / 1e3:.2f} ms before fills that wait for no kernel")
            for gap in row["largest_gaps"]:
                log(f"      {gap['mean_gap_us']:8.1f} us before {gap['weight']} ({gap['bytes'] / 2**20:.2f} MiB, waits for kernel {gap['waits_for_kernel']})")
    path = result_path(args.out, "decode_profile", device, args.quantize)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
