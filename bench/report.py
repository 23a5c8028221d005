"""Markdown tables, target checks and a plot from bench/weights.py's JSON files.

    python bench/report.py bench/results/weights_decode_*.json bench/results/weights_prefill_*.json \
        --plot bench/results/weights.png
"""

from __future__ import annotations

import argparse
import json

from tabulate import tabulate

BUDGET_ORDER = ["floor", "25%", "50%", "75%", "100%"]


def load(paths: list[str]) -> tuple[list[dict], list[dict]]:
    results = [json.load(open(p)) for p in paths]
    rows = [dict(row, pinned_bw=r["pinned_h2d_bytes_per_s"]) for r in results for row in r["rows"]]
    return results, rows


def _ms(seconds):
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def latency_table(rows: list[dict], workload: str) -> str:
    configs = list(dict.fromkeys(r["config"] for r in rows if r["workload"] == workload))
    table = []
    for config in configs:
        cells = [config]
        for budget in BUDGET_ORDER:
            row = next((r for r in rows if r["workload"] == workload and r["config"] == config and r["budget_name"] == budget), None)
            if row is None:
                cells.append("")
            elif "error" in row:
                cells.append("fails at load")
            else:
                ratio = f" ({row['latency_s'] / row['bound_s']:.2f})" if row.get("bound_s") else ""
                cells.append(f"{_ms(row['latency_s'])}{ratio}")
        table.append(cells)
    return tabulate(table, headers=["configuration", *BUDGET_ORDER], tablefmt="github")


def targets(rows: list[dict], model: dict) -> list[tuple[str, bool, str]]:
    out = []
    ok = [r for r in rows if "error" not in r]
    hostswap = [r for r in ok if r.get("policy") in ("planned", "lru")]
    streaming = [r for r in hostswap if r["budget_name"] != "100%" and r.get("bound_s")]
    # Depth 0 issues each copy at its own kernel's probe: the "no prefetch, synchronous copies
    # only" alternative the design rejects as unusable. The target is hostswap's
    # prefetching design (lru, and planned at depth >= 1, with or without cuda_graph); depth 0
    # is measured against the same bound and reported beside it, not folded into it.
    for name, group, is_target in (("latency <= 1.10 x max(all-resident, streamed / pinned bandwidth), prefetching configurations",
                                    [r for r in streaming if r.get("prefetch_depth") != 0], True),
                                   ("depth 0, the no-prefetch reference, against the same bound",
                                    [r for r in streaming if r.get("prefetch_depth") == 0], False)):
        if not group:
            if is_target:  # an unmeasured target is unmet; a reference not run is left out
                out.append((name, False, "not measured"))
            continue
        worst = max(group, key=lambda r: r["latency_s"] / r["bound_s"])
        misses = [r for r in group if r["latency_s"] > 1.10 * r["bound_s"]]
        out.append((name, not misses,
                    f"worst {worst['latency_s'] / worst['bound_s']:.3f} ({worst['workload']} {worst['config']} {worst['budget_name']}); "
                    f"misses: {', '.join(sorted({r['workload'] + ' ' + r['config'] + ' ' + r['budget_name'] for r in misses})) or 'none'}"))
    total = model["weight_bytes"]
    planned = [r for r in hostswap if r["policy"] == "planned" and r["budget_name"] != "100%"]
    excess = [r["bytes_h2d_per_forward"] / (total - (r["budget_bytes"] - r["floor_bytes"])) for r in planned]
    out.append(("planned streams <= total - (budget - floor), within 1 %", max(excess) <= 1.01, f"largest ratio {max(excess):.4f}"))
    # planned vs lru at the same depth and budget: speed-up >= 0.9 x (lru bytes / planned bytes)
    pairs = []
    for r in ok:
        if r.get("policy") == "lru" and r["workload"] == "decode" and r["budget_name"] != "100%" and r.get("warm_pool", True) and r["bytes_h2d_per_forward"]:
            twin = next((q for q in ok if q.get("policy") == "planned" and not q.get("cuda_graph") and q["workload"] == "decode"
                         and q["budget_name"] == r["budget_name"] and q.get("prefetch_depth") == r.get("prefetch_depth")), None)
            if twin and twin["bytes_h2d_per_forward"]:
                pairs.append((r, twin, (r["latency_s"] / twin["latency_s"]) / (r["bytes_h2d_per_forward"] / twin["bytes_h2d_per_forward"])))
    if pairs:
        worst = min(pairs, key=lambda p: p[2])
        detail = "; ".join(f"d{r['prefetch_depth']} {r['budget_name']}: {r['latency_s'] / t['latency_s']:.2f} x faster, bytes {r['bytes_h2d_per_forward'] / t['bytes_h2d_per_forward']:.2f} x" for r, t, _ in pairs)
        out.append(("planned beats lru in decode, speed-up >= 0.9 x bytes_lru / bytes_planned", worst[2] >= 0.9, f"lowest speed-up / bytes ratio {worst[2]:.2f}: {detail}"))
    else:
        out.append(("planned beats lru in decode, speed-up >= 0.9 x bytes_lru / bytes_planned", False, "not measured: no lru row below the total budget"))
    for workload in ("decode", "prefill"):
        plain = next((r for r in ok if r["workload"] == workload and r["config"] == "plain PyTorch"), None)
        resident = next((r for r in ok if r["workload"] == workload and r["config"] == "hostswap all-resident"), None)
        graph = next((r for r in ok if r["workload"] == workload and r["config"] == "planned d1 cuda_graph" and r["budget_name"] == "100%"), None)
        if plain and resident:
            out.append((f"{workload}: all-resident hostswap <= 1.10 x plain PyTorch", resident["latency_s"] <= 1.10 * plain["latency_s"], f"{resident['latency_s'] / plain['latency_s']:.3f}"))
        if plain and graph:
            out.append((f"{workload}: cuda_graph=True faster than plain PyTorch", graph["latency_s"] < plain["latency_s"], f"{graph['latency_s'] / plain['latency_s']:.3f}"))
        for budget in BUDGET_ORDER[:-1]:
            # accelerate's dispatch_model, or its cpu_offload where no module fits the budget
            acc = next((r for r in ok if r["workload"] == workload and r["config"].startswith("accelerate") and r["budget_name"] == budget), None)
            ours = [r for r in ok if r["workload"] == workload and r["budget_name"] == budget and r.get("policy") == "planned" and r.get("prefetch_depth") == 1 and not r.get("cuda_graph")]
            if acc and ours:
                out.append((f"{workload} at {budget}: >= 3 x faster than {acc['config']} at the same GPU memory", acc["latency_s"] >= 3 * ours[0]["latency_s"], f"{acc['latency_s'] / ours[0]['latency_s']:.1f} x"))
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 4.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload and "error" not in r and r["budget_name"] in BUDGET_ORDER]
        for config in dict.fromkeys(r["config"] for r in mine):
            if config.startswith("lru d") and config != "lru d1":
                continue
            pts = sorted(((r["budget_bytes"] / 2**30 if r["budget_bytes"] else 0.0, r["latency_s"] * 1e3) for r in mine if r["config"] == config))
            if config.startswith("accelerate"):
                ax.plot(*zip(*pts), "x--", label=config)
            elif len(pts) == 1:
                ax.plot(*zip(*pts), "s", label=config)
            else:
                ax.plot(*zip(*pts), "o-", label=config)
        bound = sorted((r["budget_bytes"] / 2**30, r["bound_s"] * 1e3) for r in mine if r["config"] == "planned d1" and r.get("bound_s"))
        if bound:
            ax.plot(*zip(*bound), "k:", linewidth=2, label="physical bound (planned d1 bytes / pinned H2D)")
        ax.set_yscale("log")
        ax.set_xlabel("GPU memory for weights (GiB)")
        ax.set_ylabel("latency per forward (ms, log)")
        ax.set_title(f"{workload}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("json", nargs="+")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    results, rows = load(args.json)
    env = results[0]["environment"]
    model = results[0]["model"]
    print(f"{env.get('gpu')}, torch {env['torch']}, accelerate {env.get('accelerate')}; "
          f"{model['layers']}-layer {model.get('class', 'Llama-style decoder')}, {model['weight_bytes'] / 2**30:.2f} GiB of bf16 weights; "
          f"pinned H2D {', '.join('%.1f' % (r['pinned_h2d_bytes_per_s'] / 1e9) for r in results)} GB/s, "
          f"registered .ptd {', '.join('%.1f' % (r.get('registered_h2d_bytes_per_s', 0) / 1e9) for r in results)} GB/s (one figure per run)\n")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        print(f"**{workload}**: median ms per forward (ratio to the physical bound)\n")
        print(latency_table(rows, workload))
        print()
    print("| target | met | measured |\n|---|---|---|")
    for name, met, detail in targets(rows, model):
        print(f"| {name} | {'yes' if met else 'no'} | {detail} |")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
