"""Streamed decode split over GPUs: each rank streams its tensor-parallel shard over its own link.

    python bench/tensor_parallel.py --worlds 1,2,4            # a GPU host with 4 GPUs
    python bench/tensor_parallel.py --worlds 1,2 --device cpu --layers 1 --hidden 256 --tokens 4   # the paths, on gloo

A random bf16 transformers Llama is exported once per world size N (``llm.export(...,
tensor_parallel=N)``, N = 1 the plain program). Each N runs under ``torch.distributed.run``
with one process per GPU. Every rank gets the same share of its own weights as budget (its
floor, or 50 % of its shard), generates ``--tokens`` greedy tokens after a short prompt, and
reports decode ms/token, the bytes it streamed per token and the pinned host-to-device
bandwidth of its link measured with every rank copying at once (as they do while decoding).
A row's bound is the slowest rank's streamed bytes per token over its link's bandwidth; its
speed-up is its tokens/s over one GPU's at the same budget share. Tokens are compared with one
GPU's (a bf16 all-reduce sums in another order than one matmul, so they may part; the row says
where). Rows go to ``bench/results/tp_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from weights import add_row, environment, h2d_bandwidth, result_path  # noqa: E402

from hostswap import llm  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402
from hostswap.schedules.weight_schedule import load_floor_bytes  # noqa: E402
from hostswap.tensor_parallel import init_from_environment, rank_path  # noqa: E402

MB = 2**20
SHARES = {"floor": None, "50%": 0.5}


def model(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda" if device == "cuda" else "cpu"):
        m = LlamaForCausalLM(config).to(torch.bfloat16)  # random init on the GPU: seconds
    return m.cpu().eval()


def budget_mb(pte: str, share: float | None) -> float:
    schedules = load_weight_schedules(pte)
    floor = load_floor_bytes(schedules)
    weights = schedules[llm.DECODE].resident_bytes
    return (floor if share is None else max(floor, share * weights)) / MB


def run_rank(args) -> None:
    """One rank of one world size: every budget share, rank 0 writes the rows."""
    import torch.distributed as dist

    rank, world = init_from_environment(args.device)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    path = rank_path(args.prefix, rank) if world > 1 else args.prefix
    prompt = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    rows = []
    for name, share in SHARES.items():
        mb = budget_mb(path + ".pte", share)
        with llm.Generator(path + ".pte", path + ".ptd", weight_offload_budget_mb=mb, device=device) as g:
            tokens = g.generate(prompt, args.tokens)[0, prompt.shape[1]:].tolist()
            ms = g.last.ms_per_token
            streamed = g.stats["bytes_streamed_per_token"] or 0
            graphed = bool(g.module.cuda_graph)
        if device.type == "cuda":  # every link at once, as while decoding
            dist.barrier() if world > 1 else None
            bandwidth = h2d_bandwidth(device, torch.empty(256 * MB, dtype=torch.uint8, pin_memory=True))
        else:
            bandwidth = None
        mine = {"rank": rank, "ms_per_token": ms, "streamed_bytes_per_token": streamed, "h2d_bytes_per_s": bandwidth, "budget_mb": mb}
        everyone = [None] * world
        if world > 1:
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        if rank == 0:
            bound = (max(r["streamed_bytes_per_token"] / r["h2d_bytes_per_s"] for r in everyone) * 1e3
                     if bandwidth else None)
            rows.append({"gpus": world, "budget": name, "ms_per_token": ms, "tokens_per_s": 1e3 / ms, "cuda_graph": graphed,
                         "streamed_mib_per_token_per_rank": max(r["streamed_bytes_per_token"] for r in everyone) / MB,
                         "budget_mib_per_rank": mb, "bound_ms": bound, "ratio_to_bound": ms / bound if bound else None,
                         "h2d_gb_s_per_link": [r["h2d_bytes_per_s"] / 1e9 if r["h2d_bytes_per_s"] else None for r in everyone],
                         "tokens": tokens})
    if rank == 0:
        with open(args.rows, "w") as f:
            json.dump(rows, f)
    if world > 1:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=None, help="default: 2.6875 x hidden (11008 at 4096)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=48, help="new tokens per generation")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--workdir", default=tempfile.gettempdir())
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prefix", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_run:
        run_rank(args)
        return 0
    intermediate = args.intermediate or int(args.hidden * 2.6875)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    path = result_path(args.out, "tp", device)
    result = {"benchmark": "tp", "environment": environment(device), "rows": [],
              "model": {"layers": args.layers, "hidden": args.hidden, "intermediate": intermediate, "heads": args.heads, "kv_heads": args.kv_heads,
                        "vocab": args.vocab, "dtype": "bfloat16", "new_tokens": args.tokens}}
    one_gpu = None
    for world in args.worlds:
        prefix = os.path.join(args.workdir, f"tp{world}", "model")
        started = time.perf_counter()
        m = model(args.layers, args.hidden, intermediate, args.heads, args.kv_heads, args.vocab, args.device)
        llm.export(m, prefix, max_seq_len=args.max_seq_len, prefill_chunk=16, tensor_parallel=world if world > 1 else None)
        del m
        exported = time.perf_counter() - started
        rows_file = prefix + ".rows.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                   os.path.abspath(__file__), "--rank-run", "--prefix", prefix, "--rows", rows_file, "--device", args.device,
                   "--vocab", str(args.vocab), "--tokens", str(args.tokens)]
        run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        if run.returncode != 0:
            add_row(result, {"gpus": world, "error": run.stderr[-8000:]}, path)
            continue
        with open(rows_file) as f:
            for row in json.load(f):
                row["export_s"] = exported
                if world == 1:
                    one_gpu = one_gpu or {}
                    one_gpu[row["budget"]] = row
                reference = (one_gpu or {}).get(row["budget"])
                if reference is not None:
                    row["speedup_over_one_gpu"] = row["tokens_per_s"] / reference["tokens_per_s"]
                    same = [a == b for a, b in zip(row["tokens"], reference["tokens"])]
                    row["tokens_part_from_one_gpu_at"] = None if all(same) else same.index(False)
                add_row(result, row, path, shown={k: v for k, v in row.items() if k != "tokens"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
