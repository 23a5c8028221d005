"""Where a streamed forward spends its time: copy engine against compute, from torch.profiler.

For each configuration: median latency, the copy engine's busy time and achieved bandwidth
while busy, idle time inside its span, how long after the forward's first GPU event the first
copy starts (head) and how long the forward runs after the last copy ends (tail: compute that
has no copy left to hide behind). latency ~ head + copy busy + tail when the copy engine never
idles, which is the floor for a forward that starts and ends synchronized.

    python bench/profile_stream.py                                  # planned d1/d4 at 50/75 %, prefill
    python bench/profile_stream.py --tokens 1 --configs lru:1:0.5   # policy:depth:fraction[:graph][:centred][:late][:nocarry][:minring][:horizon]
    python bench/profile_stream.py --repeat 3 --runs 30 --configs ...  # interleaved rounds: an A/B
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hostswap  # noqa: E402
from hostswap.models import llama_decoder  # noqa: E402
from hostswap.runtime import Module  # noqa: E402
from hostswap.runtime import pool  # noqa: E402
from hostswap.schedules import policies  # noqa: E402
from weights import h2d_bandwidth, time_calls  # noqa: E402  (bench/weights.py, beside this script)


def busy_us(events) -> float:
    """Time covered by the union of the events' intervals (microseconds)."""
    total, end = 0.0, None
    for e in sorted(events, key=lambda e: e.time_range.start):
        start, finish = e.time_range.start, e.time_range.end
        if end is None or start >= end:
            total += finish - start
            end = finish
        elif finish > end:
            total += finish - end
            end = finish
    return total


def timeline(m: Module, x: torch.Tensor, bandwidth: float, label: str, runs: int = 15) -> float:
    timing, _ = time_calls(lambda: m(x), x.device, runs, warmup=3)
    median_ms = timing["latency_s"] * 1e3
    before = m.stats["bytes_h2d"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m(x)
        torch.cuda.synchronize()
    nbytes = m.stats["bytes_h2d"] - before  # a graph replay counts what its captured forward copied
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    h2d = sorted((e for e in events if "HtoD" in e.name), key=lambda e: e.time_range.start)
    compute = [e for e in events if "HtoD" not in e.name]
    t0 = min(e.time_range.start for e in events)
    t1 = max(e.time_range.end for e in events)
    line = f"{label}: median {median_ms:.2f} ms; profiled span {(t1 - t0) / 1e3:.2f} ms; compute busy {busy_us(compute) / 1e3:.2f} ms"
    if h2d:
        copy_busy = busy_us(h2d)
        first, last = h2d[0].time_range.start, max(e.time_range.end for e in h2d)
        line += (
            f"; H2D busy {copy_busy / 1e3:.2f} ms ({nbytes / 2**20:.0f} MiB, {nbytes / copy_busy / 1e3:.1f} GB/s while busy;"
            f" bytes/pinned-bw {nbytes / bandwidth * 1e3:.2f} ms); first H2D at {(first - t0) / 1e3:.2f} ms;"
            f" last H2D ends {(t1 - last) / 1e3:.2f} ms before the end; H2D idle inside its span {((last - first) - copy_busy) / 1e3:.2f} ms"
        )
    print(line, flush=True)
    return median_ms

def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--configs", default="planned:1:0.5,planned:1:0.75,planned:4:0.5,planned:4:0.75,planned:1:0.75:graph",
                   help="comma-separated policy:depth:fraction of the weight bytes[:graph][:centred (the previous spread rule)][:late (first fills at the first probe)][:nocarry (no fills carried into the next forward)][:minring (depth 0 without run-ahead)][:horizon (fills only through the depth horizon, not when their ring bytes are released)]")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the configurations, interleaved")
    p.add_argument("--runs", type=int, default=15, help="timed forwards per configuration and round")
    args = p.parse_args(argv)
    model = llama_decoder(args.layers, max_seq=max(2048, args.tokens))
    tokens = torch.randint(0, 32000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    tmp = tempfile.mkdtemp()
    pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, (tokens,))), os.path.join(tmp, "m"))
    del model
    x = tokens.cuda()
    bw = h2d_bandwidth(x.device, torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True))
    print(f"pinned H2D {bw / 1e9:.1f} GB/s; {args.layers} layers, {args.tokens} tokens")
    m = Module(pte, ptd, weight_offload_budget_mb=100000, device="cuda")
    total = m.schedule.total_bytes
    timeline(m, x, bw, "all-resident")
    m.close()
    medians: dict[str, list[float]] = {}
    spread = policies._spread_streamed
    for config in [c for _ in range(args.repeat) for c in args.configs.split(",")]:
        policy, depth, fraction, *rest = config.split(":")
        graph, centred, late, nocarry, minring, horizon = ("graph" in rest, "centred" in rest, "late" in rest, "nocarry" in rest, "minring" in rest, "horizon" in rest)
        if centred:  # the planner's previous spread rule, for an A/B in one process
            policies._spread_streamed = functools.partial(spread, align="centred")
        if minring:  # depth 0 on its smallest ring, without run-ahead (policies.plan_layout)
            pool.plan_layout = functools.partial(policies.plan_layout, run_ahead=False)
        try:
            m = Module(pte, ptd, weight_offload_budget_mb=int(float(fraction) * total) / 2**20, device="cuda", policy=policy, prefetch_depth=int(depth), cuda_graph=graph)
        finally:
            policies._spread_streamed = spread
            pool.plan_layout = policies.plan_layout
        label = f"{policy} d{depth} {float(fraction):.0%}{' cuda_graph' if graph else ''}{' centred' if centred else ''}{' late' if late else ''}{' nocarry' if nocarry else ''}{' minring' if minring else ''}{' horizon' if horizon else ''}"
        if policy == "planned":
            label += f" [{m.pool.layout.streamed_bytes / 2**20:.0f} MiB streamed]"
        if nocarry and policy == "planned":  # no fills carried from one forward into the next
            m.pool.carry_allowed = False
        if horizon and policy == "planned":  # fills only through the depth horizon, not on release
            m.pool.issue_on_release = False
        pool.EARLY_FIRST_FILLS = not late  # late: the first fills at the first probe, as before
        try:
            medians.setdefault(label, []).append(timeline(m, x, bw, label, args.runs))
        finally:
            pool.EARLY_FIRST_FILLS = True
        if policy == "planned":
            print(f"  {label}: {m.stats['fills_carried']} fills carried over {m.stats['forwards']} forwards ({m.stats['bytes_carried'] / 2**20:.0f} MiB)")
        m.close()
    if args.repeat > 1:  # configurations interleaved, so that drift hits all alike
        for label, values in medians.items():
            print(f"{label}: medians of {len(values)} rounds {', '.join(f'{v:.2f}' for v in values)} ms; median {statistics.median(values):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
