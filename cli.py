"""The ``hostswap`` command: ``inspect`` an emitted schedule, run the ``demo``."""

from __future__ import annotations

import argparse
import json
import sys


def _inspect(args) -> int:
    from hostswap.schedules import ScheduleError, load_weight_schedule

    try:
        schedule = load_weight_schedule(args.pte)
    except (OSError, ValueError, ScheduleError) as e:
        print(f"hostswap inspect: {e}", file=sys.stderr)
        return 2
    budget = None if args.budget_mb is None else int(args.budget_mb * 2**20)
    if args.format == "json":
        print(json.dumps(schedule.to_dict(budget), indent=2))
    else:
        print(schedule.table(budget))
    if args.plot:
        schedule.plot(args.plot, budget)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _demo(args) -> int:
    from hostswap.demo import run_demo

    return run_demo(out_dir=args.out, budget_factor=args.budget_factor, device=args.device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hostswap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print the weight schedule stored in a .pte")
    p.add_argument("pte")
    p.add_argument("--budget-mb", type=float, help="also tell whether this budget loads and what each policy streams")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--plot", metavar="FILE", help="draw weight bytes per kernel with floor and budget lines (.png or .svg)")
    p.set_defaults(func=_inspect)
    d = sub.add_parser("demo", help="export, pass, save and inspect a built-in transformer (then run it)")
    d.add_argument("--out", default="out", help="folder for demo.pte / demo.ptd (default: out)")
    d.add_argument("--budget-factor", type=float, default=1.5, help="budget as a multiple of the floor (default 1.5)")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    d.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
