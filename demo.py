"""``hostswap demo``: the whole weight path on a built-in decoder-only transformer."""

from __future__ import annotations

import os
import time

import torch


def _step(message: str) -> float:
    print(f"[hostswap demo] {message} ...", flush=True)
    return time.perf_counter()


def _done(start: float) -> None:
    print(f"[hostswap demo]   done in {time.perf_counter() - start:.1f} s", flush=True)


def run_demo(out_dir: str = "out", budget_factor: float = 1.5, device: str | None = None) -> int:
    import hostswap
    from hostswap.models import demo_transformer

    model, args = demo_transformer(seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    t = _step(f"building the demo transformer ({n_params / 1e6:.2f} M parameters) and exporting it")
    expected = model(*args)
    ep = torch.export.export(model, args)
    _done(t)
    t = _step("applying the weight-offload pass")
    ep = hostswap.apply_weight_offload(ep)
    assert torch.equal(ep.module()(*args), expected), "probed program differs from the model"
    _done(t)
    t = _step("lowering with ExecuTorch and saving (the slow step)")
    pte, ptd = hostswap.save(ep, os.path.join(out_dir, "demo"), progress=lambda m: print(f"[hostswap demo]   {m}", flush=True))
    _done(t)
    schedule = hostswap.schedules.load_weight_schedule(pte)
    budget = int(schedule.floor_bytes * budget_factor)
    print(f"\n$ hostswap inspect {pte} --budget-mb {budget / 2**20:.2f}\n")
    print(schedule.table(budget))
    try:
        from hostswap.runtime import Module  # noqa: F401
    except ImportError:
        return 0
    from hostswap.demo_run import run_loaded

    return run_loaded(pte, ptd, budget, args, expected, device)
