"""MoE decode with the expert tables on disk, read through a host cache of experts, against the
same program with its tables pinned and against the disk's bound.

    python bench/moe_disk.py --work /tmp/moe-disk [--shape many] [--layers 8] [--host-shares 12.5%,25%,50%]
    python bench/moe_disk.py --shape tiny --device cpu     # the script's paths without a GPU

A random bf16 checkpoint of bench/moe.py's shape is exported once (kept in ``--work``). In the
same process: the pinned host-to-device bandwidth, and the disk's read bandwidth, reading the
``.ptd`` itself with O_DIRECT (bench/export.py's ``read_speed``). The GPU budget holds every
weight but the routed experts (``--gpu-budgets``: "in place", each pick read over the bus from
host memory; or a share of every weight, the rest a device cache of experts). Rows:

- **pinned**: the expert tables pinned whole (where the RAM holds them), decode graphed as by
  default, and eager (as decode runs once experts come from disk);
- **disk**: ``expert_host_cache_mb`` = a share of the expert tables (``--host-shares``): the
  tables stay on disk, each block's slots in pinned host memory filled from the file as its
  router picks, evicted as the default ``expert_cache_policy`` says (the expert asked for least
  often lately); each disk row is measured again with the other policy (the least recently
  used), on the same checkpoint.

Each decodes ``--new-tokens`` tokens from one prompt, sampled at ``--temperature`` with a fixed
seed (greedy decode of random weights soon repeats a few tokens, which route alike and would
flatter a cache). A disk row records ms/token, the bytes read from the disk per token, the host
cache's hit rate (decode and prefill picks since load) and whether its tokens are the pinned
rows'. Its bound is max(pinned eager ms/token, disk bytes per token / disk bandwidth); a block's
picks are known only after its router has run and the host reads them before its products, so
the reads and the rest of the step run in series: each row is also set against that sum.
Rows go to ``bench/results/moedisk_<device>.json`` as they are measured.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoints import write_checkpoint  # noqa: E402
from export import read_speed  # noqa: E402
from moe import OTHER_POLICY, shape_config  # noqa: E402
from weights import add_row, environment, h2d_bandwidth, result_path, save_result  # noqa: E402

from hostswap import llm  # noqa: E402
from hostswap.checkpoint import export_checkpoint  # noqa: E402
from hostswap.runtime.budget import load_floor_on  # noqa: E402
from hostswap.runtime.expert_cache import DEFAULT_POLICY  # noqa: E402
from hostswap.runtime.expert_store import minimum_host_cache_bytes  # noqa: E402
from hostswap.sampling import SamplingParams  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402


def generate(pte: str, ptd: str, budget_bytes: int, prompt: torch.Tensor, new_tokens: int, device: torch.device, temperature: float,
             cuda_graph: bool | None = None, host_cache_bytes: int | None = None, policy: str = DEFAULT_POLICY) -> dict:
    options = {"expert_cache_policy": policy} | ({} if host_cache_bytes is None else {"expert_host_cache_mb": host_cache_bytes / 2**20})
    with llm.Generator(pte, ptd, weight_offload_budget_mb=budget_bytes / 2**20, device=device, cuda_graph=cuda_graph, **options) as g:
        out = g.generate(prompt, new_tokens, eos_token_id=[], sampling=SamplingParams(temperature=temperature, seed=0) if temperature else None)
        s, m = g.stats, g.module.stats
        host = s["expert_host_cache"].values()
        picks = sum(c["hits"] + c["misses"] for c in host)
        reads = s["expert_reads"].values()
        lookups = sum(r["cache_hits"] + r["cache_misses"] for r in reads)
        return {"ms_per_token": s["ms_per_token"], "graphed": g.module.cuda_graph, "budget_bytes": budget_bytes,
                "host_cache_bytes": g.module.expert_host_plan.cache_bytes, "host_slots": sorted({c["slots"] for c in host}),
                "disk_bytes_per_token": s["bytes_from_disk_per_token"] or 0, "expert_bytes_over_bus_per_token": s["expert_bytes_per_token"] or 0,
                "host_hit_rate": sum(c["hits"] for c in host) / picks if picks else None,
                "device_cache_hit_rate": sum(r["cache_hits"] for r in reads) / lookups if lookups else None,
                "disk_reads": m["expert_disk_reads"],
                # the experts' reader while it reads (prefill too): the bytes over the time the calls waited for them
                "reader_bytes_per_s": m["expert_disk_bytes_read"] / m["expert_disk_seconds"] if m["expert_disk_seconds"] else None,
                "tokens": out[0, prompt.shape[1]:].tolist()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="many", help="bench/moe.py's shapes: many, mixtral, tiny")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--gpu-budgets", default="in place,25%", help="'in place' (every weight but the experts) or shares of every weight")
    parser.add_argument("--host-shares", default="12.5%,25%,50%", help="host caches, as shares of the expert tables")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", default=None, help="folder for the checkpoint and program, kept for the next run (default: a temporary one)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = shape_config(args.shape)
    if args.layers:
        config.num_hidden_layers = args.layers
    import tempfile

    scratch = tempfile.TemporaryDirectory()
    work = args.work or scratch.name
    os.makedirs(work, exist_ok=True)
    result = {"environment": environment(device), "shape": args.shape, "layers": config.num_hidden_layers, "prompt": args.prompt,
              "new_tokens": args.new_tokens, "temperature": args.temperature,
              "experts": getattr(config, "num_local_experts", None) or config.num_experts, "top_k": config.num_experts_per_tok,
              "expert_cache_policy": DEFAULT_POLICY, "other_policy": OTHER_POLICY, "rows": []}
    result["pinned_h2d_bytes_per_s"] = h2d_bandwidth(device, torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()) if device.type == "cuda" else None
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "moedisk", device)
    prefix = os.path.join(work, "moe")
    if not os.path.exists(prefix + ".ptd"):
        result["checkpoint"] = write_checkpoint(os.path.join(work, "ckpt"), config)
        export_checkpoint(os.path.join(work, "ckpt"), prefix, max_seq_len=args.prompt + args.new_tokens + 8, prefill_chunk=args.prompt)
    pte, ptd = prefix + ".pte", prefix + ".ptd"
    result["ptd_bytes"] = os.path.getsize(ptd)
    os.sync()  # the export's writes reach the disk first: a read measured beside them reads slower than the disk does
    result["disk_read_bytes_per_s"], result["disk_read_mode"] = read_speed(ptd)
    schedules = load_weight_schedules(pte)
    decode = schedules["decode"]
    blocks = decode.expert_blocks
    tables = sum(b.table_bytes for b in blocks)
    result["expert_table_bytes"] = tables
    total = decode.resident_bytes + tables
    floor = load_floor_on(schedules, device)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    least = minimum_host_cache_bytes(blocks)
    for gpu in args.gpu_budgets.split(","):
        budget = max(floor, decode.resident_bytes if gpu == "in place" else int(total * float(gpu.rstrip("%")) / 100))
        pinned = {}
        for graphed in ((True, False) if device.type == "cuda" else (False,)):
            row = generate(pte, ptd, budget, prompt, args.new_tokens, device, args.temperature, cuda_graph=graphed)
            pinned[graphed] = row
            add_row(result, {"gpu_budget": gpu, "experts": "pinned", "host_share": None, **row}, path,
                    shown={"gpu_budget": gpu, "experts": "pinned", "graphed": graphed, "ms_per_token": row["ms_per_token"]})
        eager = pinned[False]
        for share in args.host_shares.split(","):
            cache = max(least, int(tables * float(share.rstrip("%")) / 100))
            row = generate(pte, ptd, budget, prompt, args.new_tokens, device, args.temperature, host_cache_bytes=cache)
            row["same_tokens"] = row["tokens"] == eager["tokens"]
            disk_ms = row["disk_bytes_per_token"] / result["disk_read_bytes_per_s"] * 1e3
            row["disk_ms_per_token"] = disk_ms
            row["bound_ms_per_token"] = max(eager["ms_per_token"], disk_ms)
            row["ratio_to_bound"] = row["ms_per_token"] / row["bound_ms_per_token"]
            row["ratio_to_series"] = row["ms_per_token"] / (eager["ms_per_token"] + disk_ms)
            row["slowdown_over_pinned_eager"] = row["ms_per_token"] / eager["ms_per_token"]
            if True in pinned:
                row["slowdown_over_pinned_graphed"] = row["ms_per_token"] / pinned[True]["ms_per_token"]
            other = generate(pte, ptd, budget, prompt, args.new_tokens, device, args.temperature, host_cache_bytes=cache, policy=OTHER_POLICY)
            other["same_tokens"] = other.pop("tokens") == eager["tokens"]
            row["other_policy"], row["policy_speedup"] = other, other["ms_per_token"] / row["ms_per_token"]
            add_row(result, {"gpu_budget": gpu, "experts": "disk", "host_share": share, **row}, path,
                    shown={k: v for k, v in row.items() if k != "tokens"} | {"gpu_budget": gpu, "host_share": share})
    save_result(result, path)
    print(f"wrote {path}")
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
