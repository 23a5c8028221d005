"""Which host call of an offloaded prefill forward blocks? Accumulated host time per call."""
import os, sys, tempfile, statistics, time, collections
import torch
import hostswap
from hostswap.runtime import Module
from hostswap.bench.weights import llama_program
from hostswap.runtime import pool as poolmod

pte, ptd, tokens = llama_program(9, 2048)
x = tokens.cuda()
total = 4167720960
acc = collections.defaultdict(float)
cnt = collections.defaultdict(int)
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
            cnt[name] += 1
    setattr(cls, name, g)
for n in ("copy", "compute_waits", "copy_waits_for_kernel", "kernel_launched", "begin_forward", "end_forward"):
    wrap(poolmod._Streams, n)
for n in ("acquire",):
    wrap(poolmod.WeightPool, n)
for depth, frac in ((0, 0.75), (1, 0.75)):
    m = Module(pte, ptd, weight_offload_budget_mb=int(frac * total) / 2**20, device="cuda", prefetch_depth=depth)
    print("host tensor pinned:", m.pool.host[0].is_pinned(), flush=True)
    for i in range(25):
        if i == 5:
            acc.clear(); cnt.clear(); hosts = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m(x)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 5:
            hosts.append(t1 - t0)
    print(f"d{depth} {frac:.0%}: host per forward {statistics.median(hosts)*1e3:.2f} ms; per forward: " + ", ".join(f"{k} {v/20*1e3:.2f} ms ({cnt[k]//20})" for k, v in sorted(acc.items(), key=lambda kv: -kv[1])), flush=True)
    # a single copy: does it block the host?
    w = max(range(len(m.pool.host)), key=lambda i: m.pool.host[i].numel())
    src = m.pool.host[w]
    dst = torch.empty_like(src, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter(); dst.copy_(src, non_blocking=True); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"one copy of {src.numel()*src.element_size()/2**20:.0f} MiB: host {1e3*(t1-t):.3f} ms, done {1e3*(t2-t):.3f} ms, pinned {src.is_pinned()}", flush=True)
    m.close()
