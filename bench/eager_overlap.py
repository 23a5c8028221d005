"""Host launch time against synchronised latency of eager forwards of a transformers Llama,
at several budgets and prefetch depths, and whether any op synchronises the host.

    python bench/eager_overlap.py [layers] [prefill tokens]
"""
import os
import statistics
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hostswap  # noqa: E402
from hostswap.bench.weights import hf_llama, host_and_latency  # noqa: E402
from hostswap.runtime import Module  # noqa: E402

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
prefill = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
model = hf_llama(layers)
directory = tempfile.mkdtemp()
programs = {}
for workload, n in (("decode", 1), ("prefill", prefill)):
    ids = torch.randint(0, 32000, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ep = hostswap.apply_weight_offload(torch.export.export(model, (ids,), strict=False))
    programs[workload] = (*hostswap.save(ep, os.path.join(directory, workload)), ids.cuda())
    print(f"{workload}: saved", flush=True)
for workload, (pte, ptd, x) in programs.items():
    schedule = hostswap.schedules.load_weight_schedule(pte)
    total = schedule.total_bytes
    for label, budget, depth in (("100%", total + 2**20, 1), ("50%", total // 2, 1), ("50%", total // 2, 4), ("floor", schedule.floor_bytes, 1)):
        m = Module(pte, ptd, weight_offload_budget_mb=budget / 2**20, device="cuda", prefetch_depth=depth)
        hosts, latencies = [], []
        for i in range(15):
            host, latency = host_and_latency(lambda: m(x))
            if i >= 5:
                hosts.append(host)
                latencies.append(latency)
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m(x)
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("default")
        syncs = sorted({str(w.message).splitlines()[0][:90] for w in caught})
        ring = m.pool.layout.ring_bytes if hasattr(m.pool, "layout") else None
        print(f"{workload} {label} d{depth}: host {statistics.median(hosts) * 1e3:.2f} ms, latency {statistics.median(latencies) * 1e3:.2f} ms, "
              f"streamed {m.pool.layout.streamed_bytes / 2**20:.0f} MiB, ring {ring / 2**20:.0f} MiB, kernels {schedule.num_kernels}, "
              f"instructions {len(m._executors['forward'].instructions)}, syncing ops {len(caught)} {syncs[:3]}", flush=True)
        m.close()
