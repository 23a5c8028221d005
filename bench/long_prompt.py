"""Long prompts: prefill with a long chunk against the short chunk alone.

    python bench/long_prompt.py [--models dense,many] [--prompts 128,512,2048] [--budgets floor,25%,50%] [--chunk 128] [--long 512]

Each model is a random bf16 checkpoint written straight to safetensors shards: ``dense``, a
transformers Llama of ``--dense-gib`` GiB (bench/checkpoints.py); ``many`` and ``mixtral``,
bench/moe.py's MoE shapes with ``--moe-layers`` layers, their experts read in place. Each is
exported twice from its shards: with ``--chunk`` tokens per prefill call alone, and with a
second prefill method of ``--long`` tokens (hostswap/prefill_chunks.py). For the all-resident
budget and each budget asked, a ``Generator`` of each program prefills each prompt
``--repeats`` times (and decodes one token); a row records the median prefill's ms, the
calls it took, the weight and expert bytes it streamed, its bound (max(the same program's
all-resident prefill of the prompt, those bytes / pinned H2D bandwidth measured in this
run)) and the long program's speed-up over the short one's. ``--host-share S`` adds, for
the MoE models, the floor with the expert tables left on disk behind host caches of that
share of them (``expert_host_cache_mb``, runtime/expert_store.py), where each call reads what
the caches lack from the ``.ptd``; those rows give the bytes read from the disk and the
speed they came at instead of a bound. Rows go to ``bench/results/longprompt_<device>[_<part>].json`` as they are measured.
``--device cpu`` runs the script's paths without a GPU (no bound).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoints import llama_of_size, write_checkpoint  # noqa: E402
from moe import shape_config  # noqa: E402
from weights import add_row, environment, h2d_bandwidth, result_path  # noqa: E402

from hostswap import llm  # noqa: E402
from hostswap.checkpoint import export_checkpoint  # noqa: E402
from hostswap.prefill_chunks import prefill_calls  # noqa: E402
from hostswap.runtime.budget import load_floor_on  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402

PROGRAMS = ("short chunk alone", "with the long chunk")


def model_config(name: str, args):
    if name == "dense":
        return llama_of_size(args.dense_gib * 2**30)
    config = shape_config(name)
    config.num_hidden_layers = args.moe_layers
    return config


def measure(g: llm.Generator, prompt: torch.Tensor, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):  # the warm-up ran each prefill method at load: each of these is steady-state
        disk0 = g.module.stats["expert_disk_bytes_read"]
        out = g.generate(prompt, 2, eos_token_id=[])
        s = g.stats
        # a decode step follows the prefill: its disk reads are counted with it, and are few
        runs.append((s["prefill_ms"], s["bytes_streamed_prefill"], s["expert_bytes_prefill"], s["expert_disk_bytes_read"] - disk0))
    median = sorted(runs)[(len(runs) - 1) // 2]  # the lower middle of an even count
    calls = prefill_calls(prompt.shape[1], g.prefill_chunks, g.max_seq_len)
    return {"prefill_ms": median[0], "prefill_runs_ms": [r[0] for r in runs], "bytes_streamed_prefill": median[1], "expert_bytes_prefill": median[2],
            "disk_bytes": median[3],
            "tokens_per_s": prompt.shape[1] / median[0] * 1e3, "calls": len(calls), "long_calls": sum(c.method == llm.PREFILL_LONG for c in calls),
            "activation_arena_bytes": s["activation_arena_bytes"], "first_token": int(out[0, prompt.shape[1]])}


def run_model(name: str, args, device: torch.device, result: dict, path: str, work: str) -> None:
    config = model_config(name, args)
    prompts = [int(p) for p in args.prompts.split(",")]
    max_seq_len = max(prompts) + 8
    folder = os.path.join(work, name)
    start = time.perf_counter()
    checkpoint = write_checkpoint(os.path.join(folder, "ckpt"), config)
    programs = {
        PROGRAMS[0]: export_checkpoint(os.path.join(folder, "ckpt"), os.path.join(folder, "short"), max_seq_len=max_seq_len, prefill_chunk=args.chunk,
                                       long_prefill_chunk=None),
        PROGRAMS[1]: export_checkpoint(os.path.join(folder, "ckpt"), os.path.join(folder, "long"), max_seq_len=max_seq_len, prefill_chunk=args.chunk,
                                       long_prefill_chunk=args.long),
    }
    shutil.rmtree(os.path.join(folder, "ckpt"))  # the programs have their own .ptd
    setup_s = time.perf_counter() - start
    schedules = load_weight_schedules(programs[PROGRAMS[1]][0])
    decode = schedules["decode"]
    total = decode.total_bytes + sum(b.table_bytes for b in decode.expert_blocks)  # every weight, the expert tables included
    floor = load_floor_on(schedules, device)
    everything = max(max(s.all_resident_budget_bytes for s in schedules.values()), floor)
    fractions = {"floor": floor, "25%": total // 4, "50%": total // 2}
    budgets = [("all resident", everything, {})] + [(b, max(fractions[b], floor), {}) for b in args.budgets.split(",") if b]
    tables = sum(b.table_bytes for b in decode.expert_blocks)
    if args.host_share and tables:
        budgets.append((f"floor, experts on disk ({args.host_share:.0%} cached)", floor, {"expert_host_cache_mb": tables * args.host_share / 2**20}))
    bandwidth = result["pinned_h2d_bytes_per_s"]
    resident: dict[tuple[str, int], float] = {}
    for budget_name, budget, options in budgets:
        measured = {}
        for program, (pte, ptd) in programs.items():
            with llm.Generator(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=device, **options) as g:
                for n in prompts:
                    prompt = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
                    measured[program, n] = measure(g, prompt, args.repeats)
        for n in prompts:
            row = {"model": name, "checkpoint_bytes": checkpoint["bytes"], "setup_s": setup_s, "budget": budget_name, "budget_bytes": budget,
                   "prompt_tokens": n}
            for program in PROGRAMS:
                m = measured[program, n]
                if budget_name == "all resident":
                    resident[program, n] = m["prefill_ms"]
                if m["disk_bytes"]:
                    m["disk_bytes_per_s"] = m["disk_bytes"] / (m["prefill_ms"] / 1e3)
                elif bandwidth:
                    transfer = (m["bytes_streamed_prefill"] + m["expert_bytes_prefill"]) / bandwidth * 1e3
                    m["bound_ms"] = max(transfer, resident[program, n])
                    m["ratio_to_bound"] = m["prefill_ms"] / m["bound_ms"]
                row[program] = m
            row["speedup"] = row[PROGRAMS[0]]["prefill_ms"] / row[PROGRAMS[1]]["prefill_ms"]
            row["same_first_token"] = row[PROGRAMS[0]]["first_token"] == row[PROGRAMS[1]]["first_token"]
            add_row(result, row, path)
            print(f"{name} {budget_name} prompt {n}: {row[PROGRAMS[0]]['prefill_ms']:.1f} -> {row[PROGRAMS[1]]['prefill_ms']:.1f} ms "
                  f"({row['speedup']:.2f}x), calls {row[PROGRAMS[0]]['calls']} -> {row[PROGRAMS[1]]['calls']}", flush=True)
    shutil.rmtree(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,many", help="comma-separated: dense, many, mixtral")
    parser.add_argument("--dense-gib", type=float, default=8.0)
    parser.add_argument("--moe-layers", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", default="128,512,2048")
    parser.add_argument("--chunk", type=int, default=llm.DEFAULT_PREFILL_CHUNK)
    parser.add_argument("--long", type=int, default=512)
    parser.add_argument("--budgets", default="floor,25%,50%")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--host-share", type=float, default=None, help="also the floor with the MoE expert tables on disk, host caches of this share")
    parser.add_argument("--part", default=None, help="a name for this run's result file, beside others of the device")
    parser.add_argument("--work", default=None, help="folder for the checkpoints and programs (default: a temporary one)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = {"environment": environment(device), "prefill_chunk": args.chunk, "long_prefill_chunk": args.long, "repeats": args.repeats, "rows": []}
    result["pinned_h2d_bytes_per_s"] = h2d_bandwidth(device, torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()) if device.type == "cuda" else None
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "longprompt", device, args.part)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        for name in args.models.split(","):
            run_model(name, args, device, result, path, work)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
