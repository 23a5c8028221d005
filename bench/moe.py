"""MoE decode reading only the routed experts, against the all-experts schedule and its bound.

    python bench/moe.py --shape mixtral     # 8 experts, top-2, hidden 4096: about 9 GiB of bf16 weights
    python bench/moe.py --shape many        # 128 experts, top-8, hidden 2048: about 10 GiB
    python bench/moe.py --shape tiny --device cpu   # the script's paths on a CPU, in seconds

A random bf16 checkpoint of the shape is written once (bench/checkpoints.py) and exported twice
from its shards: routed (``hostswap::routed_experts`` reads each token's picked experts in
place from the mapped ``.ptd``) and all-experts (the same kernel with its tables streamed whole,
as every weight is: ``gather_from_host=False``). For each budget (the routed program's floor,
25 % and 50 % of the weights) both generate ``--new-tokens`` greedy tokens from the same prompt;
a row records ms/token, bytes streamed per token, expert bytes read in place per token, and
the routed bound: (streamed + expert bytes per token) / pinned H2D bandwidth measured in the
same run, or the all-resident decode where that is slower. Routing here is the random router of
random weights (nearly uniform popularity); a skewed router is not measured yet. Rows go to
``bench/results/moe_<device>_<shape>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoints import write_checkpoint  # noqa: E402
from weights import add_row, environment, h2d_bandwidth, result_path  # noqa: E402

from hostswap import llm  # noqa: E402
from hostswap.checkpoint import export_checkpoint  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402


def shape_config(shape: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16", bos_token_id=None, eos_token_id=None)
    if shape == "mixtral":  # Mixtral 8x7B's layer, three of them
        return MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=3, num_attention_heads=32,
                             num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, **common)
    if shape == "many":  # Qwen3-MoE's many small experts
        return Qwen3MoeConfig(vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=8,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, **common)
    if shape == "tiny":
        return MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **common)
    raise SystemExit(f"--shape must be mixtral, many or tiny, got {shape!r}")


def generate(pte: str, ptd: str, budget_bytes: int, prompt: torch.Tensor, new_tokens: int, device: torch.device) -> dict:
    with llm.Generator(pte, ptd, weight_offload_budget_mb=budget_bytes / 2**20, device=device) as g:
        out = g.generate(prompt, new_tokens, eos_token_id=[])
        s = g.stats
        return {"ms_per_token": s["ms_per_token"], "bytes_streamed_per_token": s["bytes_streamed_per_token"],
                "expert_bytes_per_token": s["expert_bytes_per_token"] or 0, "graphed": g.module.cuda_graph,
                "tokens": out[0, prompt.shape[1]:].tolist()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--work", default=None, help="folder for the checkpoint and programs (default: a temporary one)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = shape_config(args.shape)
    result = {"environment": environment(device), "shape": args.shape, "config": config.to_dict(), "rows": []}
    result["pinned_h2d_bytes_per_s"] = h2d_bandwidth(device, torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()) if device.type == "cuda" else None
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "moe", device, args.shape)
    max_seq_len = args.prompt + args.new_tokens + 1
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        start = time.perf_counter()
        result["checkpoint"] = write_checkpoint(os.path.join(work, "ckpt"), config)
        programs = {}
        for name, in_place in (("routed", True), ("all experts", False)):
            t = time.perf_counter()
            programs[name] = export_checkpoint(os.path.join(work, "ckpt"), os.path.join(work, name.replace(" ", "_")), max_seq_len=max_seq_len,
                                               prefill_chunk=args.prompt, gather_from_host=in_place)
            result[f"export_{name.replace(' ', '_')}_s"] = time.perf_counter() - t
        result["setup_s"] = time.perf_counter() - start
        routed = load_weight_schedules(programs["routed"][0])
        whole = load_weight_schedules(programs["all experts"][0])
        total = whole["decode"].total_bytes  # every weight, experts included
        floor = max(s.load_floor_bytes for s in routed.values())
        whole_floor = max(s.load_floor_bytes for s in whole.values())
        prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        resident = generate(*programs["routed"], max(total + max(s.expert_scratch_bytes for s in routed.values()), floor), prompt, args.new_tokens, device)
        result["all_resident_ms_per_token"] = resident["ms_per_token"]
        for budget_name, budget in (("floor", floor), ("25%", total // 4), ("50%", total // 2)):
            row = {"budget": budget_name, "budget_bytes": max(budget, floor)}
            for name in programs:
                measured = generate(*programs[name], max(budget, floor, whole_floor if name == "all experts" else 0), prompt, args.new_tokens, device)
                row[name] = measured
            bandwidth = result["pinned_h2d_bytes_per_s"]
            r = row["routed"]
            if bandwidth:
                transfer = (r["bytes_streamed_per_token"] + r["expert_bytes_per_token"]) / bandwidth * 1e3
                row["routed_bound_ms_per_token"] = max(transfer, resident["ms_per_token"])
                row["routed_ratio_to_bound"] = r["ms_per_token"] / row["routed_bound_ms_per_token"]
            row["speedup_over_all_experts"] = row["all experts"]["ms_per_token"] / r["ms_per_token"]
            row["same_tokens"] = r["tokens"] == row["all experts"]["tokens"]
            add_row(result, row, path, shown={k: v for k, v in row.items() if k not in programs} | {n: {k: v for k, v in row[n].items() if k != "tokens"} for n in programs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
