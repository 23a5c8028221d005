"""Scan: latency of planned forwards against a forced carry count K (9-layer Llama), next to the
measured decision (runtime/pool.py _decide_carry). Each K is its own Module (capture
included under graph); ratios are to max(all-resident, streamed bytes / pinned bandwidth)
measured in the same process.
Usage: python bench/carry_scan.py [tokens] [graph|eager] [depth:fraction,...]
"""
import os, sys, tempfile, statistics, time
import torch
import hostswap
from hostswap.runtime import Module
from hostswap.runtime.pool import WeightPool
from hostswap.bench.weights import llama_program, h2d_bandwidth, time_calls

tokens_n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
graph = (sys.argv[2] if len(sys.argv) > 2 else "graph") == "graph"
configs = [(int(c.split(":")[0]), float(c.split(":")[1])) for c in (sys.argv[3] if len(sys.argv) > 3 else "1:0.75,2:0.75,1:0.5").split(",")]
pte, ptd, tokens = llama_program(9, tokens_n)
x = tokens.cuda()
bw = h2d_bandwidth(x.device, torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True))
m = Module(pte, ptd, weight_offload_budget_mb=100000, device="cuda")
total = m.schedule.total_bytes
res = time_calls(lambda: m(x), x.device, 30, 3)[0]["latency_s"]
m.close()
print(f"pinned {bw/1e9:.1f} GB/s, all-resident {res*1e3:.2f} ms", flush=True)
orig = WeightPool._decide_carry
results = {}
for rnd in range(2):
    for depth, frac in configs:
        for k in (None, 0, 1, 2, 3, 99):
            if k is None:
                WeightPool._decide_carry = orig
            else:
                WeightPool._decide_carry = lambda self, k=k: setattr(self, "_carry_count", min(k, len(self._carry_order)))
            m = Module(pte, ptd, weight_offload_budget_mb=int(frac * total) / 2**20, device="cuda", prefetch_depth=depth, cuda_graph=graph)
            t = time_calls(lambda: m(x), x.device, 30, 3)[0]["latency_s"]
            K = m.pool._carry_count
            n = len(m.pool._carry_order)
            bound = max(res, m.pool.layout.streamed_bytes / bw)
            key = (depth, frac, "measured" if k is None else k)
            results.setdefault(key, []).append(t / bound)
            print(f"{'graph' if graph else 'eager'} d{depth} {frac:.0%} carried {m.stats['fills_carried']} over {m.stats['forwards']} forwards, k={'measured' if k is None else k} -> K={K}/{n}: {t*1e3:.2f} ms, {t/bound:.3f} of bound", flush=True)
            m.close()
            WeightPool._decide_carry = orig
for key, v in results.items():
    print(key, " ".join(f"{r:.3f}" for r in v))
