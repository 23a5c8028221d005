"""Where the host time of an all-resident decode goes: plain PyTorch against hostswap.

Decode at batch 1 is bound by the host (one launch per operator), so the two are compared
by operator and launch counts and by CPU time per operator, from torch.profiler.

    python bench/profile_overhead.py --layers 2
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hostswap  # noqa: E402
from hostswap.models import llama_decoder  # noqa: E402
from hostswap.runtime import Module  # noqa: E402


def measure(name: str, fn, runs: int = 50, sort_by: str = "self_cpu_time_total") -> None:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(runs):
        fn()
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t) / runs
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")) / 10
    aten = [e for e in events if e.key.startswith(("aten::", "hostswap::", "dim_order_ops::"))]
    print(f"\n== {name}: {per_call * 1e3:.2f} ms per forward, {launches:.0f} kernel launches per forward")
    print(events.table(sort_by=sort_by, row_limit=18))
    print(f"CUDA kernel time per forward: {sum(e.self_device_time_total for e in events) / 10 / 1e3:.2f} ms")
    print(f"aten-level calls per forward: {sum(e.count for e in aten) / 10:.0f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1, help="1: decode (host-bound); 2048: prefill (device-bound, sorted by CUDA time)")
    args = p.parse_args(argv)
    model = llama_decoder(args.layers, max_seq=max(2048, args.tokens))
    tokens = torch.randint(0, 32000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    sort_by = "self_cpu_time_total" if args.tokens == 1 else "self_cuda_time_total"
    with tempfile.TemporaryDirectory() as tmp:
        pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, (tokens,))), os.path.join(tmp, "m"))
        x = tokens.cuda()
        plain = torch.export.export(copy.deepcopy(model).cuda(), (x,)).module()
        with torch.no_grad():
            measure("plain PyTorch (ep.module())", lambda: plain(x), sort_by=sort_by)
        del plain
        m = Module(pte, ptd, weight_offload_budget_mb=100_000, device="cuda")
        print(f"\nhostswap: {sum(1 for i in m._executors['forward'].instructions if i[0] == 'kernel' and i[5] is None)} kernels, "
              f"{m._executors['forward'].elided_copies} copies run as views")
        measure("hostswap all-resident", lambda: m(x), sort_by=sort_by)
        m.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
