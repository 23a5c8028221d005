"""Many sequences per weight pass: batched decode throughput against its bound and its peers.

    python bench/batch.py --layers 12 [--batches 1,4,16,32,64] [--budgets floor,50%] [--new-tokens 32]

The transformers Llama of bench/generate.py (hidden 2048, GQA, bf16, random weights) is exported
with ``max_batch_size=B`` for each batch size B. For each budget a ``BatchGenerator`` takes B
prompts of ``--prompt`` tokens; once all are prefilled, ``--new-tokens`` decode steps are
timed: total tokens/s (B x steps / time) and per-sequence ms/token (time per step). The bound
of a row is max(bytes streamed per step / pinned H2D bandwidth measured in this run, the
all-resident step time at that B). Peers in the same process: transformers' batched
``generate`` with every weight on the GPU, and accelerate's ``dispatch_model`` at the 50 %
budget, both on the same B prompts (accelerate is not wired in yet). Rows go to ``bench/results/batch_<device>.json`` as they
are measured.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from generate import llama, sync  # noqa: E402
from weights import add_row, environment, h2d_bandwidth, result_path, save_result  # noqa: E402

from hostswap import batching  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402
from hostswap.schedules.weight_schedule import load_floor_bytes  # noqa: E402


def measure_hostswap(pte: str, ptd: str, budget_bytes: int, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict:
    with batching.BatchGenerator(pte, ptd, weight_offload_budget_mb=budget_bytes / 2**20, device=device) as b:
        sequences = [b.add(p, new_tokens + 1, eos_token_id=[]) for p in prompts]
        sync()
        copied = b.module.pool.stats.bytes_h2d
        start = time.perf_counter()
        for _ in range(new_tokens):
            b.step()
        sync()
        seconds = time.perf_counter() - start
        step_bytes = (b.module.pool.stats.bytes_h2d - copied) / new_tokens
        assert all(len(s.tokens) == new_tokens + 1 for s in sequences)
        return {"ms_per_step": seconds / new_tokens * 1e3, "tokens_per_s": len(prompts) * new_tokens / seconds,
                "bytes_streamed_per_step": step_bytes, "budget_bytes": budget_bytes, "graphed": b.module.cuda_graph}


def measure_transformers(model, prompts: list[list[int]], new_tokens: int) -> dict:
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        sync()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        sync()
    seconds = time.perf_counter() - start
    return {"ms_per_step": seconds / new_tokens * 1e3, "tokens_per_s": len(prompts) * new_tokens / seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batches", default="1,4,16,32,64")
    parser.add_argument("--budgets", default="floor,50%")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu runs the script's paths without a GPU (no bandwidth, no bound)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    result = {"environment": environment(device), "layers": args.layers, "prompt": args.prompt, "new_tokens": args.new_tokens, "rows": []}
    model = llama(args.layers)
    result["pinned_h2d_bytes_per_s"] = h2d_bandwidth(device, torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()) if device.type == "cuda" else None
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "batch", device)
    max_seq_len = args.prompt + args.new_tokens + 2
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        for b in batches:
            prompts = torch.randint(0, model.config.vocab_size, (b, args.prompt), generator=g).tolist()
            pte, ptd = batching.export(llama(args.layers), os.path.join(folder, f"b{b}"), max_seq_len=max_seq_len, max_batch_size=b,
                                       prefill_chunk=args.prompt)
            schedules = load_weight_schedules(pte)
            total = schedules["decode"].total_bytes
            floor = load_floor_bytes(schedules)
            resident = measure_hostswap(pte, ptd, max(total, floor), prompts, args.new_tokens, device)
            result["rows"].append({"batch": b, "configuration": "hostswap all-resident", **resident})
            for budget in args.budgets.split(","):
                budget_bytes = floor if budget == "floor" else max(floor, int(total * float(budget.rstrip("%")) / 100))
                row = measure_hostswap(pte, ptd, budget_bytes, prompts, args.new_tokens, device)
                if result["pinned_h2d_bytes_per_s"]:
                    transfer_ms = row["bytes_streamed_per_step"] / result["pinned_h2d_bytes_per_s"] * 1e3
                    row["bound_ms_per_step"] = max(transfer_ms, resident["ms_per_step"])
                    row["ratio_to_bound"] = row["ms_per_step"] / row["bound_ms_per_step"]
                add_row(result, {"batch": b, "configuration": f"hostswap {budget}", **row}, path)
            if not args.skip_peers and device.type == "cuda":
                peer = model.cuda()
                result["rows"].append({"batch": b, "configuration": "transformers generate, all resident", **measure_transformers(peer, prompts, args.new_tokens)})
                model = peer.cpu()
                gc.collect()
                torch.cuda.empty_cache()
            save_result(result, path)
    ones = {r["configuration"]: r["tokens_per_s"] for r in result["rows"] if r["batch"] == 1}
    for r in result["rows"]:
        if r["configuration"] in ones and ones[r["configuration"]]:
            r["speedup_over_batch_1"] = r["tokens_per_s"] / ones[r["configuration"]]
    save_result(result, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
