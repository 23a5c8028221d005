"""Where a streamed prefill forward spends its time: copy engine against compute, from torch.profiler.

For each configuration: median latency, the copy engine's busy time and achieved bandwidth
while busy, idle time inside its span, how long after the forward's first GPU event the first
copy starts (head) and how long the forward runs after the last copy ends (tail: compute that
has no copy left to hide behind). latency ~ head + copy busy + tail when the copy engine never
idles, which is the floor for a forward that starts and ends synchronized.

    python bench/profile_stream.py            # GPU machine, 9-layer model, 2048 tokens
"""
import os, sys, time, statistics, tempfile
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hostswap
from hostswap.models import llama_decoder
from hostswap.runtime import Module
from torch.profiler import profile, ProfilerActivity

model = llama_decoder(9, max_seq=2048)
tokens = torch.randint(0, 32000, (1, 2048), generator=torch.Generator().manual_seed(1))
tmp = tempfile.mkdtemp()
pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, (tokens,))), os.path.join(tmp, "m"))
del model
x = tokens.cuda()
src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True); dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
for _ in range(3): dst.copy_(src, non_blocking=True)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): dst.copy_(src, non_blocking=True)
torch.cuda.synchronize(); bw = 5 * (1 << 30) / (time.perf_counter() - t); print(f"pinned H2D {bw/1e9:.1f} GB/s")
del src, dst
def timeline(m, label):
    for _ in range(3): m(x)
    torch.cuda.synchronize(); ts = []
    for _ in range(15):
        t = time.perf_counter(); m(x); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    med = statistics.median(ts) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m(x); torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    h2d = [e for e in ev if "HtoD" in e.name]
    comp = [e for e in ev if "HtoD" not in e.name]
    t0 = min(e.time_range.start for e in ev); t1 = max(e.time_range.end for e in ev)
    def busy(es):
        total, end = 0, None
        for e in es:
            s, f = e.time_range.start, e.time_range.end
            if end is None or s >= end: total += f - s; end = f
            elif f > end: total += f - end; end = f
        return total
    copy_busy, comp_busy = busy(h2d), busy(comp)
    if not h2d:
        print(f"{label}: median {med:.2f} ms; profiled span {(t1-t0)/1e3:.2f} ms; compute busy {comp_busy/1e3:.2f} ms", flush=True)
        return
    nbytes = sum(m.schedule.weight_bytes[m.schedule.probe_weight[p]] for p in m.pool.layout.fill_offset)
    print(f"{label}: median {med:.2f} ms; profiled span {(t1-t0)/1e3:.2f} ms; H2D busy {copy_busy/1e3:.2f} ms ({nbytes/2**20:.0f} MiB, {nbytes/copy_busy*1e6/1e9:.1f} GB/s while busy; bytes/pinned-bw {nbytes/bw*1e3:.2f} ms); "
          f"compute busy {comp_busy/1e3:.2f} ms; first H2D at {(h2d[0].time_range.start-t0)/1e3:.2f} ms; last H2D ends {(t1-h2d[-1].time_range.end)/1e3:.2f} ms before the end; "
          f"H2D idle inside its span {((h2d[-1].time_range.end-h2d[0].time_range.start)-copy_busy)/1e3:.2f} ms", flush=True)
probe = Module(pte, ptd, weight_offload_budget_mb=100000, device="cuda"); total = probe.schedule.total_bytes
timeline(probe, "all-resident"); probe.close()
for depth in (1, 4):
    for frac in (0.5, 0.75):
        m = Module(pte, ptd, weight_offload_budget_mb=int(frac * total) / 2**20, device="cuda", prefetch_depth=depth)
        timeline(m, f"d{depth} {frac:.0%}"); m.close()
m = Module(pte, ptd, weight_offload_budget_mb=int(0.75 * total) / 2**20, device="cuda", cuda_graph=True)
timeline(m, "d1 75% cuda_graph"); m.close()
