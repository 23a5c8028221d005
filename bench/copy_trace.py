"""Where does the copy engine idle in an offloaded forward? A CUDA-event trace, no profiler.

For every ring copy of a forward: when the host issued it, when it started and ended on the
copy stream, and when the kernel whose bytes it overwrites ended (timing events). An idle gap
of the copy engine before a copy is put down to the host (the copy started as soon as it
was issued), to the ring slot (it started as soon as the kernel it waited for ended) or to
neither. Compute-stream stalls on copies come from the pool's own stall events.
Usage: copy_trace.py [tokens] [policy:depth:fraction[:horizon] ...]   (default prefill, planned d0/d1 75 %)
HS_ROUNDS: rounds over the configurations (interleaved); :horizon issues fills only through the
depth horizon (pool.issue_on_release off), for the A/B.
"""
import os, statistics, sys, time, collections
import torch
from hostswap.runtime import Module
from hostswap.runtime import pool as poolmod
from hostswap.bench.weights import llama_program

tokens_n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
configs = [c.split(":") for c in (sys.argv[2:] or ["planned:0:0.75", "planned:1:0.75"])]
pte, ptd, tokens = llama_program(int(os.environ.get("HS_LAYERS", 9)), tokens_n)
x = tokens.cuda()
total = 4167720960
TOL = 0.02  # ms: "started as soon as"

state = {"copies": []}
_copy = poolmod._Streams.copy
def traced_copy(self, dst, src):
    start = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(self.copy_stream):
        start.record(self.copy_stream)
        dst.copy_(src, non_blocking=True)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.copy_stream)
    state["copies"].append([time.perf_counter(), start, end, state.pop("waits", -1), src.numel() * src.element_size()])
    return end
poolmod._Streams.copy = traced_copy
_wait = poolmod._Streams.copy_waits_for_kernel
def traced_wait(self, kernel):
    state["waits"] = kernel
    return _wait(self, kernel)
poolmod._Streams.copy_waits_for_kernel = traced_wait

def ms(ref, ev):
    return ref.elapsed_time(ev)

summary = collections.defaultdict(list)
for rnd in range(int(os.environ.get("HS_ROUNDS", 2))):
    for policy, depth, frac, *rest in configs:
        depth, frac = int(depth), float(frac)
        m = Module(pte, ptd, weight_offload_budget_mb=int(frac * total) / 2**20, device="cuda", prefetch_depth=depth, policy=policy)
        if "horizon" in rest:
            m.pool.issue_on_release = False
        name = f"{policy} d{depth} {frac:.0%}{' horizon' if 'horizon' in rest else ''}"
        streams = m.pool.streams
        streams.kernel_events = [torch.cuda.Event(enable_timing=True) for _ in streams.kernel_events]
        rows = collections.defaultdict(list)
        for i in range(25):
            state["copies"] = []
            streams._stall_pairs.clear()
            torch.cuda.synchronize()
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            h0 = time.perf_counter()
            m(x)
            h1 = time.perf_counter()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            if i < 5:
                continue
            lat = ms(ref, end)
            copies = state["copies"]
            prev_end, gaps = 0.0, collections.Counter()
            busy = 0.0
            for j, (h, s, e, k, nbytes) in enumerate(copies):
                hs, ss, es = (h - h0) * 1e3, ms(ref, s), ms(ref, e)
                ks = ms(ref, streams.kernel_events[k]) if k >= 0 else None
                busy += es - ss
                gap = ss - prev_end
                if gap > TOL:
                    if hs >= ss - TOL - 0.05:  # issue latency of ~50 us
                        cause = "host"
                    elif ks is not None and ks >= ss - TOL:
                        cause = "slot"
                    else:
                        cause = "other"
                    gaps[cause] += gap
                prev_end = max(prev_end, es)
            stalls = sum(ms(b, a) for b, a in streams._stall_pairs)
            streams._stall_pairs.clear()
            rows["latency"].append(lat)
            rows["host"].append((h1 - h0) * 1e3)
            rows["busy"].append(busy)
            rows["first"].append(ms(ref, copies[0][1]) if copies else 0.0)
            rows["tail"].append(lat - prev_end)
            rows["stall"].append(stalls)
            for c in ("host", "slot", "other"):
                rows["gap_" + c].append(gaps[c])
            rows["copies"].append(len(copies))
            rows["bytes"].append(sum(c[4] for c in copies) / 2**20)
        med = {k: statistics.median(v) for k, v in rows.items()}
        bw = med["bytes"] * 2**20 / (med["busy"] / 1e3) / 1e9 if med["busy"] else 0
        summary[name].append(med["latency"])
        print(f"round {rnd} {name}: latency {med['latency']:.2f} ms, host {med['host']:.2f} ms; {med['copies']:.0f} copies {med['bytes']:.0f} MiB, copy busy {med['busy']:.2f} ms ({bw:.1f} GB/s); "
              f"first copy at {med['first']:.2f} ms, idle gaps: host {med['gap_host']:.2f}, slot {med['gap_slot']:.2f}, other {med['gap_other']:.2f} ms; "
              f"tail after last copy {med['tail']:.2f} ms; compute stalls {med['stall']:.2f} ms", flush=True)
        m.close()
for name, v in summary.items():
    print(f"{name}: medians {', '.join(f'{x:.2f}' for x in v)} ms; median {statistics.median(v):.2f} ms", flush=True)
