"""(bench/issue_trace.py) For each H2D copy of one profiled prefill forward (planned, 75 %), was the copy engine idle
before it because the host had not issued it yet, or because it waited on a kernel event?"""
import json, os, sys, tempfile, statistics
import torch
from torch.profiler import ProfilerActivity, profile
import hostswap
from hostswap.runtime import Module
from hostswap.bench.weights import llama_program, time_calls

pte, ptd, tokens = llama_program(9, 2048)
tmp = tempfile.mkdtemp()
x = tokens.cuda()
out = os.environ.get("OUT", "/tmp")
for rnd in range(2):
    for depth in (0, 1):
        m = Module(pte, ptd, weight_offload_budget_mb=int(0.75 * 4167720960) / 2**20, device="cuda", prefetch_depth=depth)
        t = time_calls(lambda: m(x), x.device, 30, 3)[0]["latency_s"]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            m(x)
            torch.cuda.synchronize()
        path = os.path.join(tmp, f"t{depth}.json")
        prof.export_chrome_trace(path)
        tr = json.load(open(path))["traceEvents"]
        gpu = [e for e in tr if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "kernel", "gpu_memset")]
        rt = {e["args"].get("correlation"): e for e in tr if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "args" in e}
        t0 = min(e["ts"] for e in gpu)
        h2d = sorted((e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]), key=lambda e: e["ts"])
        kern = sorted((e for e in gpu if e["cat"] == "kernel"), key=lambda e: e["ts"])
        host_gap = wait_gap = 0.0
        lines = []
        prev_end = None
        for i, e in enumerate(h2d):
            launch = rt.get(e["args"].get("correlation"))
            issued = launch["ts"] if launch else None
            if prev_end is not None and e["ts"] - prev_end > 20:
                gap = e["ts"] - prev_end
                host_limited = issued is not None and issued + launch["dur"] > prev_end
                if host_limited:
                    host_gap += min(gap, issued + launch["dur"] - prev_end)
                else:
                    wait_gap += gap
                lines.append(f"  copy {i}: gap {gap/1e3:.3f} ms before it, issued by host at {((issued or 0) - t0)/1e3:.3f} ms, engine free at {(prev_end - t0)/1e3:.3f} ms -> {'host' if host_limited else 'wait'}")
            prev_end = e["ts"] + e["dur"]
        last_kernel_end = max(k["ts"] + k["dur"] for k in kern)
        print(f"round {rnd} d{depth}: median {t*1e3:.2f} ms; {len(h2d)} copies; first copy at {(h2d[0]['ts'] - t0)/1e3:.3f} ms (issued {((rt[h2d[0]['args']['correlation']]['ts']) - t0)/1e3:.3f}); last copy ends {(last_kernel_end - prev_end)/1e3:.3f} ms before last kernel end; gaps: host {host_gap/1e3:.3f} ms, wait {wait_gap/1e3:.3f} ms; fills carried {m.stats['fills_carried']}/{m.stats['forwards']} forwards", flush=True)
        for l in lines:
            print(l)
        m.close()
