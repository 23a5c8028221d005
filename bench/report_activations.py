"""Markdown table, target checks and a plot from bench/activations.py's JSON.

    python bench/report_activations.py bench/results/activations_*.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import re

from tabulate import tabulate


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    r = json.load(open(args.json))
    a, env = r["args"], r["environment"]
    d2h, h2d = r["pinned_d2h_bytes_per_s"], r["pinned_h2d_bytes_per_s"]
    rows = {x["config"]: x for x in r["rows"]}
    base = rows["no offload (hostswap k=0)"]
    print(f"{env['gpu']}, torch {env['torch']}, {env['date'][:10]}: {a['layers']} decoder blocks (hidden {a['hidden']}, SwiGLU {a['intermediate']}, "
          f"SDPA), bf16, batch {a['batch']} x {a['seq']} tokens; median of {a['steps']} steps; pinned D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s\n")
    table = []
    for x in r["rows"]:
        if "error" in x:
            table.append([x["config"], "", "", "", "", "", "", x["error"][:60]])
            continue
        theory = x.get("theoretical_saving_bytes") or 0
        hostswap = x["config"].startswith("hostswap") or x["config"].startswith("no offload (hostswap")
        saved = base["peak_bytes"] - x["peak_bytes"] if hostswap else None
        transfer = theory / d2h + theory / h2d
        bound = max(base["step_s"], transfer) if hostswap and theory else None
        table.append([
            x["config"], f"{x['step_s'] * 1e3:.1f}", f"{x['peak_bytes'] / 2**30:.2f}", f"{theory / 2**30:.2f}" if theory else "",
            f"{saved / theory:.2f}" if saved is not None and theory else "", f"{x['step_s'] / bound:.2f}" if bound else "",
            {True: "yes", False: "no", None: "(reference)"}[x["bitwise"]] + f" vs {x['bitwise_vs']}", "",
        ])
    print(tabulate(table, headers=["configuration", "step ms", "peak GiB", "theoretical saving GiB", "saved / theory", "step / transfer-bound", "bitwise", "note"], tablefmt="github"))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ks, steps, peaks = [], [], []
        for x in r["rows"]:
            m = re.fullmatch(r"hostswap k=(\d+)", x["config"]) or (re.fullmatch(r"no offload \(hostswap k=0\)", x["config"]) and re.match(r".*k=(\d+)", x["config"]))
            if m and "error" not in x:
                ks.append(int(m.group(1)))
                steps.append(x["step_s"] * 1e3)
                peaks.append(x["peak_bytes"] / 2**30)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        ax1.plot(ks, peaks, "o-", label="hostswap (default schedule)")
        ax2.plot(ks, steps, "o-", label="hostswap (default schedule)")
        for name, marker in (("save_on_cpu(pin_memory) first", "s"), ("hostswap custom dict", "^"), ("checkpoint others", "D"), ("PyTorch AOT activation offloading", "x")):
            for x in r["rows"]:
                if name in x["config"] and "error" not in x:
                    k = a["layers"] // 2 if "AOT" not in x["config"] else 0
                    ax1.plot([k], [x["peak_bytes"] / 2**30], marker, label=x["config"])
                    ax2.plot([k], [x["step_s"] * 1e3], marker, label=x["config"])
        theory = [base["peak_bytes"] / 2**30 - (rows[f"hostswap k={k}"]["theoretical_saving_bytes"] / 2**30 if k else 0) for k in ks]
        ax1.plot(ks, theory, "k:", label="no-offload peak - theoretical saving")
        transfer = [max(base["step_s"], (rows[f"hostswap k={k}"]["theoretical_saving_bytes"] * (1 / d2h + 1 / h2d)) if k else 0) * 1e3 for k in ks]
        ax2.plot(ks, transfer, "k:", label="transfer-bound step")
        ax1.set_xlabel("offloaded layers k")
        ax1.set_ylabel("peak GPU memory of a step (GiB)")
        ax2.set_xlabel("offloaded layers k")
        ax2.set_ylabel("step time (ms)")
        ax1.legend(fontsize=7)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
