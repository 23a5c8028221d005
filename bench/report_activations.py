"""Markdown table, target checks and a plot from bench/activations.py's JSON files.

    python bench/report_activations.py bench/results/activations_a.json activations_b.json --plot out.png

Several files (parts of one run, made with --only) are read as one table: the first
"no offload (hostswap k=0)" row is the base; a configuration appearing twice keeps its first
row. Bandwidth is the mean of every measurement in the files (each run measures at its start
and end), and the spread is printed.

Transfer-bound step: offloads finish in the forward and reloads start in the backward, so the
copies to host and back cannot overlap one another; and nothing can be copied before layer 0's
forward produced it, nor can layer 0's backward start before its reload. So
``bound = max(no-offload step, bytes / D2H + bytes / H2D + no-offload step / n)``, with the
last term one layer's forward and backward.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

from tabulate import tabulate


def load(paths: list[str]) -> tuple[dict, list[dict], dict]:
    results = [json.load(open(p)) for p in paths]
    rows, seen = [], set()
    for r in results:
        for row in r["rows"]:
            if "deterministic attention" in row["config"]:
                continue  # an earlier attempt (memory-efficient attention), superseded by the math-attention pair
            if row["config"] not in seen:
                seen.add(row["config"])
                rows.append(row)
    bw = {d: [r[k] for r in results for k in (f"pinned_{d}_bytes_per_s", f"pinned_{d}_bytes_per_s_end") if r.get(k)] for d in ("d2h", "h2d")}
    return results[0], rows, bw


def transfer_bound(base: dict, theory: float, layers: int, d2h: float, h2d: float) -> float:
    return max(base["step_s"], theory / d2h + theory / h2d + base["step_s"] / layers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("json", nargs="+")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    first, all_rows, bw = load(args.json)
    a, env = first["args"], first["environment"]
    d2h, h2d = statistics.mean(bw["d2h"]), statistics.mean(bw["h2d"])
    rows = {x["config"]: x for x in all_rows}
    base = rows["no offload (hostswap k=0)"]
    n = a["layers"]
    print(f"{env['gpu']}, torch {env['torch']}: {n} decoder blocks (hidden {a['hidden']}, SwiGLU {a['intermediate']}, "
          f"SDPA), bf16, batch {a['batch']} x {a['seq']} tokens; median of {a['steps']} steps; pinned D2H {d2h / 1e9:.1f} GB/s "
          f"({min(bw['d2h']) / 1e9:.1f}-{max(bw['d2h']) / 1e9:.1f}), H2D {h2d / 1e9:.1f} GB/s ({min(bw['h2d']) / 1e9:.1f}-{max(bw['h2d']) / 1e9:.1f}), "
          f"{len(bw['d2h'])} measurements\n")
    table = []
    for x in all_rows:
        if "error" in x:
            table.append([x["config"], "", "", "", "", "", "", x["error"].splitlines()[0][:70]])
            continue
        theory = x.get("theoretical_saving_bytes") or 0
        hostswap = x["config"].startswith("hostswap") or x["config"].startswith("no offload (hostswap")
        math = "math attention" in x["config"]
        own_base = rows.get("no offload (hostswap k=0), math attention") if math else base
        saved = own_base["peak_bytes"] - x["peak_bytes"] if hostswap and own_base else None
        bound = transfer_bound(own_base, theory, n, d2h, h2d) if hostswap and theory and own_base else None
        note = f"peak after {x['peak_after_point']}" if x.get("peak_after_point") else ""
        table.append([
            x["config"], f"{x['step_s'] * 1e3:.1f}", f"{x['peak_bytes'] / 2**30:.2f}", f"{theory / 2**30:.2f}" if theory else "",
            f"{saved / theory:.2f}" if saved is not None and theory else "", f"{x['step_s'] / bound:.2f}" if bound else "",
            {True: "yes", False: "no", None: "(reference)"}[x["bitwise"]] + f" vs {x['bitwise_vs']}", note,
        ])
    print(tabulate(table, headers=["configuration", "step ms", "peak GiB", "theoretical saving GiB", "saved / theory", "step / transfer-bound", "bitwise", "note"], tablefmt="github"))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for pattern, label in ((r"hostswap k=(\d+)", "hostswap (default schedule)"), (r"hostswap k=(\d+) reload_ahead=1", "hostswap reload_ahead=1")):
            pts = []
            for x in all_rows:
                m = re.fullmatch(pattern, x["config"])
                if m and "error" not in x:
                    pts.append((int(m.group(1)), x["step_s"] * 1e3, x["peak_bytes"] / 2**30))
            pts = sorted([(0, base["step_s"] * 1e3, base["peak_bytes"] / 2**30)] + pts)
            ax1.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        for name, marker in (("save_on_cpu(pin_memory) first", "s"), ("reload_ahead=2", "v"), ("hostswap custom dict", "^"), ("checkpoint others", "D"), ("PyTorch AOT activation offloading", "x")):
            for x in all_rows:
                if name in x["config"] and "error" not in x and "math" not in x["config"]:
                    k = n // 2
                    ax1.plot([k], [x["peak_bytes"] / 2**30], marker, label=x["config"])
                    ax2.plot([k], [x["step_s"] * 1e3], marker, label=x["config"])
        ks = sorted({int(m.group(1)) for x in all_rows if (m := re.fullmatch(r"hostswap k=(\d+)", x["config"])) and "error" not in x})
        per_k = {k: rows[f"hostswap k={k}"]["theoretical_saving_bytes"] for k in ks}
        ax1.plot([0] + ks, [base["peak_bytes"] / 2**30] + [(base["peak_bytes"] - per_k[k]) / 2**30 for k in ks], "k:", label="no-offload peak - theoretical saving")
        ax2.plot([0] + ks, [base["step_s"] * 1e3] + [transfer_bound(base, per_k[k], n, d2h, h2d) * 1e3 for k in ks], "k:", label="transfer-bound step")
        ax1.set_xlabel("offloaded layers k")
        ax1.set_ylabel("peak GPU memory of a step (GiB)")
        ax2.set_xlabel("offloaded layers k")
        ax2.set_ylabel("step time (ms)")
        ax1.legend(fontsize=6)
        ax2.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
