"""MoE prefill: a prompt's chunks through the routed experts, against the bytes they must read.

    python bench/moe_prefill.py [--shape many] [--layers 4] [--prompt 512] [--chunk 128] [--budgets floor,25%,50%]

A random bf16 checkpoint of bench/moe.py's shape (``--layers`` of them) is exported with its
experts read in place and ``--chunk`` tokens per prefill call. For the all-resident budget and
each budget asked, a ``Generator`` prefills a ``--prompt``-token prompt (and decodes one token)
``--repeats`` times; a row records the median prefill's ms, and the weight bytes that run
streamed and the expert bytes it read over the bus (each chunk reads the union of its tokens' experts once, those
an expert cache holds from their slots), and its bound: max(the all-resident prefill, those
bytes / pinned H2D bandwidth measured in this run). Each budget is measured twice: as it runs
("grouped": one launch per projection reads every picked expert, kernels/routed_grouped.py)
and with the chunk's experts run one after another as transformers' eager loop runs them
("expert loop": the host learns each expert's tokens, then its products read its rows in
place), the way prefill ran before the grouped kernel. Both give the same first token. Rows
go to ``bench/results/moeprefill_<device>_<shape>.json`` as they are measured. ``--device cpu``
runs the script's paths without a GPU (both modes are the eager loop there; no bound).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoints import write_checkpoint  # noqa: E402
from moe import shape_config  # noqa: E402
from weights import add_row, environment, h2d_bandwidth, result_path  # noqa: E402

import hostswap.kernels.routed_experts as routed_experts  # noqa: E402
from hostswap import llm  # noqa: E402
from hostswap.checkpoint import export_checkpoint  # noqa: E402
from hostswap.runtime.budget import load_floor_on  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402

MODES = ("grouped", "expert loop")


@contextlib.contextmanager
def expert_loop():
    """Eager calls of several tokens in the body run their experts one after another (the host
    learns each one's tokens), as before the grouped kernel; decode steps are untouched."""
    reads_in_place = routed_experts._reads_in_place

    def one_token_or_captured(hidden, gate_up, down):
        if hidden.shape[0] > 1 and not routed_experts._graph_paths(hidden):
            return False
        return reads_in_place(hidden, gate_up, down)

    routed_experts._reads_in_place = one_token_or_captured
    try:
        yield
    finally:
        routed_experts._reads_in_place = reads_in_place


def measure(pte: str, ptd: str, budget_bytes: int, prompt: torch.Tensor, device: torch.device, repeats: int, mode: str) -> dict:
    with contextlib.ExitStack() as stack:
        if mode == "expert loop":
            stack.enter_context(expert_loop())
        g = stack.enter_context(llm.Generator(pte, ptd, weight_offload_budget_mb=budget_bytes / 2**20, device=device))
        runs = []
        for _ in range(repeats):  # the warm-up ran a prefill chunk at load: each of these is steady-state
            out = g.generate(prompt, 2, eos_token_id=[])
            s = g.stats
            runs.append((s["prefill_ms"], s["bytes_streamed_prefill"], s["expert_bytes_prefill"]))
        reads = g.stats["expert_reads"].values()
        median = sorted(runs)[(len(runs) - 1) // 2]  # the median run (the lower middle of an even count)
        ms = median[0]
        return {"prefill_ms": ms, "prefill_runs_ms": [r[0] for r in runs], "bytes_streamed_prefill": median[1], "expert_bytes_prefill": median[2],
                "tokens_per_s": prompt.shape[1] / ms * 1e3, "blocks": len(reads), "resident_blocks": sum(r["resident"] for r in reads),
                "cache_slots": max((r["cache_slots"] for r in reads if not r["resident"]), default=0),
                "first_token": int(out[0, prompt.shape[1]])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="many")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--budgets", default="floor,25%,50%")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=None, help="folder for the checkpoint and program (default: a temporary one)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = shape_config(args.shape)
    config.num_hidden_layers = args.layers
    if args.chunk > args.prompt:
        raise SystemExit(f"--chunk ({args.chunk}) must not exceed --prompt ({args.prompt})")
    result = {"environment": environment(device), "shape": args.shape, "config": config.to_dict(), "prompt_tokens": args.prompt,
              "prefill_chunk": args.chunk, "repeats": args.repeats, "rows": []}
    result["pinned_h2d_bytes_per_s"] = h2d_bandwidth(device, torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()) if device.type == "cuda" else None
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "moeprefill", device, args.shape)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        start = time.perf_counter()
        result["checkpoint"] = write_checkpoint(os.path.join(work, "ckpt"), config)
        pte, ptd = export_checkpoint(os.path.join(work, "ckpt"), os.path.join(work, "routed"), max_seq_len=args.prompt + 2, prefill_chunk=args.chunk)
        result["setup_s"] = time.perf_counter() - start
        schedules = load_weight_schedules(pte)
        decode = schedules["decode"]
        total = decode.total_bytes + sum(b.table_bytes for b in decode.expert_blocks)  # every weight, the expert tables included
        floor = load_floor_on(schedules, device)
        everything = max(max(s.all_resident_budget_bytes for s in schedules.values()), floor)
        fractions = {"floor": floor, "25%": total // 4, "50%": total // 2}
        budgets = [("all resident", everything)] + [(name, max(fractions[name], floor)) for name in args.budgets.split(",") if name]
        prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        bandwidth = result["pinned_h2d_bytes_per_s"]
        resident_ms = None
        for name, budget in budgets:
            row = {"budget": name, "budget_bytes": budget}
            for mode in MODES:
                row[mode] = measure(pte, ptd, budget, prompt, device, args.repeats, mode)
            g = row["grouped"]
            if name == "all resident":
                resident_ms = g["prefill_ms"]
            if bandwidth:
                transfer = (g["bytes_streamed_prefill"] + g["expert_bytes_prefill"]) / bandwidth * 1e3
                row["bound_ms"] = max(transfer, resident_ms)
                row["ratio_to_bound"] = g["prefill_ms"] / row["bound_ms"]
            row["speedup_over_expert_loop"] = row["expert loop"]["prefill_ms"] / g["prefill_ms"]
            row["same_first_token"] = g["first_token"] == row["expert loop"]["first_token"]
            add_row(result, row, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
