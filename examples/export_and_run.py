"""End to end on a model of your own: export, pass, save, inspect, run under a budget.

    python -m hostswap.examples.export_and_run [--device cuda] [--out out/example]
"""

import argparse

import torch

import hostswap


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="out/example")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    ).eval()
    x = torch.randn(8, 256)

    ep = hostswap.apply_weight_offload(torch.export.export(model, (x,)))
    pte, ptd = hostswap.save(ep, args.out)
    schedule = hostswap.schedules.load_weight_schedule(pte)
    print(schedule.table())

    budget_mb = schedule.floor_bytes / 2**20  # the smallest budget that loads
    m = hostswap.runtime.Module(pte, data_path=ptd, weight_offload_budget_mb=budget_mb, device=args.device)
    y = m(x.to(args.device))
    with torch.no_grad():
        expected = model.to(args.device)(x.to(args.device))
    ok = torch.allclose(y, expected, rtol=1e-4, atol=1e-5)
    print(f"budget {budget_mb:.2f} MB of {schedule.total_bytes / 2**20:.2f} MB of weights; matches plain PyTorch: {ok}")
    print(m.stats)
    m.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
