"""Human-readable views of a weight schedule: tables, a JSON-able report and a plot."""

from __future__ import annotations

from tabulate import tabulate

from hostswap.schedules.experts import bytes_read_per_call, expert_scratch_bytes, plan_expert_cache, resident_blocks
from hostswap.schedules.policies import lru_streamed_bytes, mb_ceil, plan_layout
from hostswap.schedules.schedule_facts import ScheduleFacts
from hostswap.schedules.tiers import plan_tiers

MB = 2**20


def _mb(nbytes: int) -> str:
    return f"{nbytes / MB:.2f}"


def schedule_report(schedule: ScheduleFacts, budget_bytes: int | None = None, host_budget_bytes: int | None = None,
                    experts_host: dict | None = None) -> dict:
    """The schedule as plain data; with ``budget_bytes``, what each policy streams under it, and
    with ``host_budget_bytes`` too, each weight's tier (GPU, pinned host, disk) under both.
    ``experts_host``: where the routed experts' tables are in host memory (pinned whole, or on
    disk behind host slots), as the runtime plans it; it sets the bytes pinned for tables."""
    floor = schedule.floor
    kernel_bytes = schedule.kernel_weight_bytes()
    j = floor.floor_kernel
    cuda_floor = schedule.floor_bytes + expert_scratch_bytes(tuple(b for b in schedule.expert_blocks if not b.read_in_place_on_cuda))
    report = {
        "summary": {
            "weights": len(schedule.fqns),
            "total_bytes": schedule.total_bytes,
            "bytes_by_dtype": schedule.bytes_by_dtype() if schedule.weight_dtypes else {},
            "probes": schedule.num_probes,
            "kernels": schedule.num_kernels,
            "floor_bytes": schedule.load_floor_bytes,
            "floor_mb": mb_ceil(schedule.load_floor_bytes),
            # where a device reads a decode step's picks in place (CUDA with Triton): no scratch
            "floor_in_place_mb": mb_ceil(cuda_floor) if cuda_floor != schedule.load_floor_bytes else None,
            "lru_window_bytes": floor.lru_bytes,
            "planned_ring_bytes": floor.ring_bytes,
            "pinned_bytes": floor.pinned_bytes,
            "prefetch_depth": schedule.prefetch_depth,
            "pinned": list(schedule.pin),
            "host_read_bytes": sum(schedule.host_read_bytes),
            "host_read": [{"fqn": f, "bytes": b} for f, b in zip(schedule.host_read, schedule.host_read_bytes)],
        },
        "experts": _experts_report(schedule),
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
        scratch = schedule.expert_scratch_bytes  # the budget's share for gathered experts (the split of a device that gathers them)
        loads = budget_bytes >= schedule.load_floor_bytes
        budget = {"budget_bytes": budget_bytes, "loads": loads}
        if loads:
            budget_bytes -= scratch
            layout = plan_layout(schedule, budget_bytes)
            budget.update(
                lru_streamed_bytes_per_forward=lru_streamed_bytes(schedule, budget_bytes),
                planned_streamed_bytes_per_forward=layout.streamed_bytes,
                planned_resident_bytes=layout.resident_bytes,
                planned_ring_bytes=layout.ring_bytes,
            )
            if schedule.expert_blocks:
                slots = plan_expert_cache(schedule.expert_blocks, budget_bytes - schedule.resident_bytes)
                resident = resident_blocks(slots, schedule.expert_blocks)
                budget["resident_expert_blocks"] = sorted(resident)
                budget["expert_cache_slots"] = {b: n for b, n in slots.items() if b not in resident}
                budget["expert_bytes_per_call"] = list(bytes_read_per_call(schedule.expert_blocks, resident))
            if host_budget_bytes is not None:
                tiers = plan_tiers(schedule, layout, host_budget_bytes)
                budget["tiers"] = {
                    "host_budget_bytes": host_budget_bytes,
                    "gpu_bytes": layout.resident_bytes, "host_bytes": tiers.pinned_bytes,
                    "disk_bytes": sum(schedule.weight_bytes[w] for w in tiers.disk),
                    "host_bytes_per_forward": tiers.pinned_bytes_per_forward, "disk_bytes_per_forward": tiers.disk_bytes_per_forward,
                    "staging_bytes": tiers.staging_bytes,
                    "host_read_bytes": tiers.host_read_bytes if experts_host is None else experts_host["host_read_bytes"],
                    "weights": {schedule.fqns[w]: tiers.tier_of(w) for w in range(len(schedule.fqns))},
                }
                if experts_host is not None:
                    budget["tiers"]["experts"] = experts_host
        else:
            budget["required_mb"] = mb_ceil(schedule.load_floor_bytes)
        report["budget"] = budget
    return report


def _experts_report(schedule: ScheduleFacts) -> dict | None:
    """The MoE blocks as units chosen at run time: per block its experts and the bytes one
    call reads; per call of the method, the expert bytes read at the floor (fewest, most)."""
    blocks = schedule.expert_blocks
    if not blocks:
        return None
    return {
        "blocks": [{"block": b.block, "experts": b.num_experts, "top_k": b.top_k, "tokens": b.tokens, "unit_bytes": b.unit_bytes,
                    "units_per_call": list(b.units_per_call), "scratch_bytes": b.scratch_bytes, "tables": list(b.tables)} for b in blocks],
        "scratch_bytes": expert_scratch_bytes(blocks),
        "bytes_per_call_at_floor": list(bytes_read_per_call(blocks)),
        "table_bytes": sum(b.table_bytes for b in blocks),
    }


def _experts_tables(experts: dict) -> list[str]:
    fewest, most = experts["bytes_per_call_at_floor"]
    per_call = _mb(most) if fewest == most else f"{_mb(fewest)} to {_mb(most)}"
    rows = [[b["block"], b["experts"], b["top_k"], b["tokens"], _mb(b["unit_bytes"]), "-".join(map(str, sorted(set(b["units_per_call"])))), _mb(b["scratch_bytes"])]
            for b in experts["blocks"]]
    return ["\nRouted experts (units chosen by the router at run time; read in place from host memory)",
            tabulate(rows, headers=["block", "experts", "top-k", "tokens / call", "MB / expert", "experts read / call", "scratch MB"], tablefmt="simple"),
            f"  expert bytes one call reads at the floor: {per_call} MB (every token's top-k; a chunk reads the union once); "
            f"tables {_mb(experts['table_bytes'])} MB, outside the budget; floor adds {_mb(experts['scratch_bytes'])} MB of scratch where a decode "
            "step gathers its picks (off CUDA; on CUDA with Triton its products read bf16, fp16 or fp32 tables in place and the floor adds none)"]


def render_tables(schedule: ScheduleFacts, budget_bytes: int | None = None, host_budget_bytes: int | None = None, experts_host: dict | None = None) -> str:
    r = schedule_report(schedule, budget_bytes, host_budget_bytes, experts_host)
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
                ["floor", f"{s['floor_bytes']} bytes (budget >= {s['floor_mb']} MB"
                          + (f"; >= {s['floor_in_place_mb']} MB where a decode step reads its experts in place, as on CUDA with Triton)"
                             if s["floor_in_place_mb"] is not None else ")")],
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
    if r["experts"]:
        out += _experts_tables(r["experts"])
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
            if "expert_bytes_per_call" in b:
                fewest, most = b["expert_bytes_per_call"]
                out.append(f"  routed experts: {len(b['resident_expert_blocks'])} of {len(r['experts']['blocks'])} blocks' tables on the device; "
                           f"a call reads {_mb(fewest)}" + (f" to {_mb(most)}" if most != fewest else "") + " MB of experts over the bus"
                           + (" when it misses the cache" if b.get("expert_cache_slots") else ""))
                for block, slots in b.get("expert_cache_slots", {}).items():
                    if slots:
                        out.append(f"  expert cache of {block}: {slots} experts' slots on the device (an expert cache, evicting as expert_cache_policy says)")
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
                if "experts" in t:
                    out.append(f"  routed experts: {t['experts']['explain']}")
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
