"""Human-readable views of a weight schedule: tables, a JSON-able report and a plot."""

from __future__ import annotations

from tabulate import tabulate

from hostswap.schedules.policies import lru_streamed_bytes, mb_ceil, plan_layout
from hostswap.schedules.schedule_facts import ScheduleFacts
from hostswap.schedules.tiers import plan_tiers

MB = 2**20


def _mb(nbytes: int) -> str:
    return f"{nbytes / MB:.2f}"


def schedule_report(schedule: ScheduleFacts, budget_bytes: int | None = None, host_budget_bytes: int | None = None) -> dict:
    """The schedule as plain data; with ``budget_bytes``, what each policy streams under it, and
    with ``host_budget_bytes`` too, each weight's tier (GPU, pinned host, disk) under both."""
    floor = schedule.floor
    kernel_bytes = schedule.kernel_weight_bytes()
    j = floor.floor_kernel
    report = {
        "summary": {
            "weights": len(schedule.fqns),
            "total_bytes": schedule.total_bytes,
            "bytes_by_dtype": schedule.bytes_by_dtype() if schedule.weight_dtypes else {},
            "probes": schedule.num_probes,
            "kernels": schedule.num_kernels,
            "floor_bytes": floor.floor_bytes,
            "floor_mb": mb_ceil(floor.floor_bytes),
            "lru_window_bytes": floor.lru_bytes,
            "planned_ring_bytes": floor.ring_bytes,
            "pinned_bytes": floor.pinned_bytes,
            "prefetch_depth": schedule.prefetch_depth,
            "pinned": list(schedule.pin),
            "host_read_bytes": sum(schedule.host_read_bytes),
            "host_read": [{"fqn": f, "bytes": b} for f, b in zip(schedule.host_read, schedule.host_read_bytes)],
        },
        "access_order": [
            {
                "probe": p,
                "fqn": schedule.fqns[w],
                "kernel": schedule.probe_kernel[p],
                "op": schedule.kernel_ops[schedule.probe_kernel[p]],
                "bytes": schedule.weight_bytes[w],
                "dtype": schedule.weight_dtypes[w] if schedule.weight_dtypes else None,
            }
            for p, w in enumerate(schedule.probe_weight)
        ],
        "kernel_bytes": kernel_bytes,
        "floor_pair": None
        if j < 0
        else {
            "kernels": [k for k in (j - 1, j) if k >= 0],
            "ops": [schedule.kernel_ops[k] for k in (j - 1, j) if k >= 0],
            "pair_bytes": floor.pair_bytes,
            "headroom_bytes": floor.headroom_bytes,
            "sets_floor": "lru window" if floor.lru_bytes >= floor.ring_bytes else "planned ring",
        },
    }
    if budget_bytes is not None:
        loads = budget_bytes >= floor.floor_bytes
        budget = {"budget_bytes": budget_bytes, "loads": loads}
        if loads:
            layout = plan_layout(schedule, budget_bytes)
            budget.update(
                lru_streamed_bytes_per_forward=lru_streamed_bytes(schedule, budget_bytes),
                planned_streamed_bytes_per_forward=layout.streamed_bytes,
                planned_resident_bytes=layout.resident_bytes,
                planned_ring_bytes=layout.ring_bytes,
            )
            if host_budget_bytes is not None:
                tiers = plan_tiers(schedule, layout, host_budget_bytes)
                budget["tiers"] = {
                    "host_budget_bytes": host_budget_bytes,
                    "gpu_bytes": layout.resident_bytes, "host_bytes": tiers.pinned_bytes,
                    "disk_bytes": sum(schedule.weight_bytes[w] for w in tiers.disk),
                    "host_bytes_per_forward": tiers.pinned_bytes_per_forward, "disk_bytes_per_forward": tiers.disk_bytes_per_forward,
                    "staging_bytes": tiers.staging_bytes, "host_read_bytes": tiers.host_read_bytes,
                    "weights": {schedule.fqns[w]: tiers.tier_of(w) for w in range(len(schedule.fqns))},
                }
        else:
            budget["required_mb"] = mb_ceil(floor.floor_bytes)
        report["budget"] = budget
    return report


def render_tables(schedule: ScheduleFacts, budget_bytes: int | None = None, host_budget_bytes: int | None = None) -> str:
    r = schedule_report(schedule, budget_bytes, host_budget_bytes)
    tier = r.get("budget", {}).get("tiers", {}).get("weights")
    s = r["summary"]
    out = ["Summary"]
    out.append(
        tabulate(
            [
                ["weights", s["weights"]],
                ["total weight bytes", f"{s['total_bytes']} ({_mb(s['total_bytes'])} MB)"],
                *([["  by dtype", ", ".join(f"{d} {_mb(b)} MB" for d, b in s["bytes_by_dtype"].items())]] if s.get("bytes_by_dtype") else []),
                ["probes / kernels", f"{s['probes']} / {s['kernels']}"],
                ["floor", f"{s['floor_bytes']} bytes (budget >= {s['floor_mb']} MB)"],
                ["  lru window / planned ring", f"{s['lru_window_bytes']} / {s['planned_ring_bytes']} bytes"],
                ["  pinned", f"{s['pinned_bytes']} bytes: {', '.join(s['pinned']) or '-'}"],
                ["prefetch depth", s["prefetch_depth"]],
                *([["read in place from host", ", ".join(f"{h['fqn']} ({_mb(h['bytes'])} MB)" for h in s["host_read"]) + ": row gathers, no budget, no copies"]]
                  if s["host_read"] else []),
            ],
            tablefmt="simple",
        )
    )
    pair = r["floor_pair"]
    if pair:
        out.append("\nFloor set by kernels " + " + ".join(f"#{k} {op}" for k, op in zip(pair["kernels"], pair["ops"])))
        out.append(
            f"  pair {pair['pair_bytes']} bytes + prefetch headroom {pair['headroom_bytes']} bytes "
            f"(the {pair['sets_floor']} sets the floor)"
        )
    out.append("\nAccess order")
    out.append(
        tabulate(
            [[a["probe"], a["fqn"], a["kernel"], a["op"], a["dtype"] or "", a["bytes"]] + ([tier[a["fqn"]]] if tier else []) for a in r["access_order"]],
            headers=["probe", "fqn", "kernel", "op", "dtype", "bytes"] + (["tier"] if tier else []),
            tablefmt="simple",
        )
    )
    if "budget" in r:
        b = r["budget"]
        out.append(f"\nBudget {_mb(b['budget_bytes'])} MB")
        if b["loads"]:
            out.append(
                tabulate(
                    [
                        ["lru", b["lru_streamed_bytes_per_forward"], "-"],
                        ["planned", b["planned_streamed_bytes_per_forward"], b["planned_resident_bytes"]],
                    ],
                    headers=["policy", "bytes streamed / forward", "bytes resident"],
                    tablefmt="simple",
                )
            )
            if tier:
                t = b["tiers"]
                out.append(f"\nTiers with {_mb(t['host_budget_bytes'])} MB of pinned host memory for streamed weights")
                out.append(
                    tabulate(
                        [
                            ["gpu (resident)", t["gpu_bytes"], 0],
                            ["host (pinned)", t["host_bytes"], t["host_bytes_per_forward"]],
                            ["disk (.ptd)", t["disk_bytes"], t["disk_bytes_per_forward"]],
                        ],
                        headers=["tier", "weight bytes", "bytes copied / forward"],
                        tablefmt="simple",
                    )
                )
                out.append(f"  pinned besides: staging for disk reads {t['staging_bytes']} bytes, tables read in place {t['host_read_bytes']} bytes")
        else:
            out.append(f"  would NOT load: at least {b['required_mb']} MB required")
    return "\n".join(out)


def plot_schedule(schedule: ScheduleFacts, path: str, budget_bytes: int | None = None) -> None:
    """Weight bytes per kernel in access order, with the floor and budget lines (PNG or SVG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from e
    kernel_bytes = [b / MB for b in schedule.kernel_weight_bytes()]
    floor = schedule.floor
    fig, ax = plt.subplots(figsize=(max(6, min(16, len(kernel_bytes) * 0.12)), 4))
    ax.bar(range(len(kernel_bytes)), kernel_bytes, width=0.9, color="#4C72B0", label="weights read by kernel")
    if floor.floor_kernel >= 0:
        for k in (floor.floor_kernel - 1, floor.floor_kernel):
            if k >= 0:
                ax.bar([k], [kernel_bytes[k]], width=0.9, color="#DD8452")
    ax.axhline(floor.floor_bytes / MB, color="#C44E52", linestyle="--", label=f"floor {floor.floor_bytes / MB:.2f} MB")
    if budget_bytes is not None:
        ax.axhline(budget_bytes / MB, color="#55A868", label=f"budget {budget_bytes / MB:.2f} MB")
    ax.set_xlabel("kernel (execution order; the pair that sets the floor in orange)")
    ax.set_ylabel("MB")
    ax.set_title(f"{len(schedule.fqns)} weights, {schedule.total_bytes / MB:.2f} MB, prefetch depth {schedule.prefetch_depth}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
