"""The runtime half of ``hostswap demo``: load with a budget, run, compare, print stats."""

from __future__ import annotations

import time

import torch
from tabulate import tabulate


def run_loaded(pte: str, ptd: str, budget_bytes: int, args, expected: torch.Tensor, device: str | None) -> int:
    from hostswap.runtime import Module

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"\n[hostswap demo] loading {pte} with weight_offload_budget_mb={budget_bytes / 2**20:.2f} on {device}")
    rows, ok = [], True
    for policy in ("planned", "lru"):
        t = time.perf_counter()
        m = Module(pte, ptd, weight_offload_budget_mb=budget_bytes / 2**20, device=device, policy=policy)
        load = time.perf_counter() - t
        inputs = [a.to(device) for a in args]
        y = m(*inputs)
        y = m(*inputs)
        err = (y.float().cpu() - expected.float()).abs().max().item()
        close = torch.allclose(y.float().cpu(), expected.float(), rtol=1e-4, atol=1e-4)
        ok &= close
        s = m.stats
        rows.append([policy, f"{load:.2f}", f"{err:.2e}", "yes" if close else "NO", s["hits"], s["misses"], s["evictions"], s["bytes_h2d"], s["prefetches_issued"], s["prefetches_used"], s["prefetches_wasted"], f"{s['stall_seconds'] * 1e3:.2f}", s["peak_weight_bytes"], s["activation_arena_bytes"]])
        m.close()
    print("[hostswap demo] two forwards per policy, compared with plain PyTorch:\n")
    print(tabulate(rows, headers=["policy", "load s", "max |diff|", "matches", "hits", "misses", "evictions", "bytes H2D", "prefetches", "used", "wasted", "stall ms", "peak weight bytes", "activation arena"]))
    return 0 if ok else 1
