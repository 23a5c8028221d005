"""MoE decode reading only the routed experts, against the all-experts schedule and its bound.

    python bench/moe.py --shape mixtral     # 8 experts, top-2, hidden 4096: about 9 GiB of bf16 weights
    python bench/moe.py --shape many        # 128 experts, top-8, hidden 2048: about 10 GiB
    python bench/moe.py --shape tiny --device cpu   # the script's paths on a CPU, in seconds

A random bf16 checkpoint of the shape is written once (bench/checkpoints.py) and exported twice
from its shards: routed (``hostswap::routed_experts`` reads each token's picked experts in
place from the mapped ``.ptd``) and all-experts (the same kernel with its tables streamed whole,
as every weight is: ``gather_from_host=False``). For each budget (the routed program's floor,
25 % and 50 % of the weights) both generate ``--new-tokens`` tokens from the same prompt, sampled
at ``--temperature`` with a fixed seed (greedy decode of random weights soon repeats a few
tokens, and repeated tokens route alike, which would flatter an expert cache);
a row records ms/token, bytes streamed per token, expert bytes read in place per token, and
the routed bound: (streamed + expert bytes per token) / pinned H2D bandwidth measured in the
same run, or the all-resident decode where that is slower. Where the budget leaves room
beyond the streamed weights, experts take it (whole tables, or a device cache per block), and
a row records the decode steps' cache hit rate. Where a row has a cache it is measured twice:
as it is by default, and with each block's guess at the next block's experts prefetched
(``expert_prefetch=--prefetch``: the next block's predicted top-k, at most that many of it
missing from its cache); the row records how many prefetched experts a lookup then read. Such
a row is also measured with the cache evicting the least recently used expert
(``expert_cache_policy="lru"``) instead of the default, the one picked least often lately. The routed bound counts the
experts a token needed over the bus (its misses, prefetched or not), not wrong guesses. On a
GPU, a row whose budget holds every weight but the routed experts is also measured with decode
compiled into one TorchInductor graph (``compiled=("decode",)``, the experts' op inside it),
against the same bound with the compiled all-resident decode in place of the executor's.

Peers, on the same checkpoint and budgets (``--peers``, on a GPU): accelerate
(``from_pretrained`` with ``device_map`` for ``max_memory`` = the budget, its offloaded layers
moved to the GPU by its hooks at every forward) and AirLLM (bench/airllm_peer.py in a
subprocess: one decoder layer's file at a time from the page cache). Both read every expert
of every layer for every token; they decode greedily, which costs them the same as sampling.

Routing is measured twice. **Uniform**: the random router of random weights, which spreads the
picks nearly evenly. **Skewed** (``skew_routers``): the same checkpoint with its routers biased
toward a Zipf-like expert popularity, then exported again (routed only). The bias rides on one
hidden channel: column 0 of the embeddings is set to a constant ``0.02 * sqrt(hidden)`` (as
large as the rest of a row together), each layer's post-attention norm passes that channel
with weight 1, and column 0 of each router becomes ``-exponent * noise * ln(rank_e) / x0``, where
``rank_e`` is expert ``e``'s place in a random order of popularity, ``x0`` the channel's value
after the norm and ``noise`` the standard deviation of the rest of the router's logits, both
worked out from the random weights' scale (std 0.02). A token's logits are then the bias plus
the token's own noise: popular experts win most steps, the others now and then, and tokens
that repeat route alike. Rows go to ``bench/results/moe_<device>_<shape>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
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
from hostswap.checkpoint import export_checkpoint, read_safetensors_header  # noqa: E402
from hostswap.sampling import SamplingParams  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402
from hostswap.runtime.budget import load_floor_on  # noqa: E402
from hostswap.runtime.expert_cache import DEFAULT_POLICY, POLICIES  # noqa: E402


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


OTHER_POLICY = next(p for p in POLICIES if p != DEFAULT_POLICY)  # the expert caches' eviction measured beside the default
WEIGHT_STD = 0.02  # bench/checkpoints.py draws every value, norms included, from N(0, 0.02)


def _patch(folder: str, name: str, change) -> None:
    """Rewrite tensor ``name`` of the safetensors checkpoint in ``folder`` in place: ``change``
    takes its values (float32) and returns the new ones, stored back in the tensor's dtype."""
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"][name]
    stored = read_safetensors_header(os.path.join(folder, shard), shard, folder)[name]
    with open(os.path.join(folder, shard), "r+b") as f:
        f.seek(stored.offset)
        values = torch.frombuffer(bytearray(f.read(stored.nbytes)), dtype=stored.dtype).view(stored.shape).float()
        changed = change(values).to(stored.dtype).contiguous()
        f.seek(stored.offset)
        f.write(changed.view(torch.uint8).numpy().tobytes())


def skew_routers(folder: str, config, exponent: float, seed: int = 0) -> dict:
    """Bias every router of the random checkpoint in ``folder`` toward a Zipf-like popularity
    (the module docstring says how); returns what was set."""
    hidden, experts = config.hidden_size, getattr(config, "num_local_experts", None) or config.num_experts
    channel = WEIGHT_STD * math.sqrt(hidden)  # the constant: as large as the other channels together
    rms = math.sqrt((channel**2 + (hidden - 1) * WEIGHT_STD**2) / hidden)
    x0 = channel / rms  # the channel after a norm of weight 1
    # the rest of a router logit: hidden-1 products of a router weight and a normed value (x / rms * norm weight)
    noise = math.sqrt(hidden - 1) * WEIGHT_STD * (WEIGHT_STD / rms) * WEIGHT_STD
    rank = torch.randperm(experts, generator=torch.Generator().manual_seed(seed)) + 1
    bias = -exponent * noise * torch.log(rank.double()).float()

    def column0(value):
        def change(t):
            t[..., 0] = value
            return t
        return change

    _patch(folder, "model.embed_tokens.weight", column0(channel))
    for layer in range(config.num_hidden_layers):
        _patch(folder, f"model.layers.{layer}.post_attention_layernorm.weight", column0(1.0))
        _patch(folder, f"model.layers.{layer}.mlp.gate.weight", column0(bias / x0))
    return {"exponent": exponent, "channel": channel, "noise": noise, "popularity_rank": rank.tolist()}


def generate(pte: str, ptd: str, budget_bytes: int, prompt: torch.Tensor, new_tokens: int, device: torch.device, temperature: float = 0.0,
             expert_prefetch: int = 0, compiled: bool = False, policy: str = DEFAULT_POLICY) -> dict:
    with llm.Generator(pte, ptd, weight_offload_budget_mb=budget_bytes / 2**20, device=device, expert_prefetch=expert_prefetch,
                       compiled=(llm.DECODE,) if compiled else False, expert_cache_policy=policy) as g:
        out = g.generate(prompt, new_tokens, eos_token_id=[], sampling=SamplingParams(temperature=temperature, seed=0) if temperature else None)
        s = g.stats
        reads = s["expert_reads"].values()
        lookups = sum(r["cache_hits"] + r["cache_misses"] for r in reads)
        prefetched = sum(r["prefetched"] for r in reads)
        # over the bus since load: misses and prefetches; of those, a token needed the misses and the prefetches it read
        moved = sum(r["misses"] + r["prefetched"] for r in reads)
        needed = sum(r["misses"] + r["prefetch_hits"] for r in reads)
        per_token = s["expert_bytes_per_token"] or 0
        return {"ms_per_token": s["ms_per_token"], "bytes_streamed_per_token": s["bytes_streamed_per_token"],
                "expert_bytes_per_token": per_token, "needed_expert_bytes_per_token": per_token * needed / moved if moved else 0,
                "graphed": g.module.cuda_graph,
                "resident_blocks": sum(r["resident"] for r in reads), "cache_slots": max((r["cache_slots"] for r in reads if not r["resident"]), default=0),
                "cache_hit_rate": sum(r["cache_hits"] for r in reads) / lookups if lookups else None,
                "prefetched_per_lookup": prefetched / lookups if lookups else None,
                "prefetch_used_rate": sum(r["prefetch_hits"] for r in reads) / prefetched if prefetched else None,
                "compiled": compiled, "warm_up_s": s["warm_up_s"],
                "tokens": out[0, prompt.shape[1]:].tolist()}


def accelerate_peer(checkpoint: str, budget_bytes: int, prompt: torch.Tensor, new_tokens: int) -> dict:
    """accelerate's offload: ``max_memory`` = the budget on GPU 0, the rest on the CPU, moved
    by its hooks at every forward (every expert of an offloaded layer)."""
    import gc

    from generate import transformers_generate
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="auto",
                                                 max_memory={0: budget_bytes, "cpu": 2**40}).eval()
    try:
        on_gpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
        prefill_s, per_token_s, tokens = transformers_generate(model, prompt.to("cuda"), new_tokens)
        return {"config": "accelerate device_map", "budget_bytes": budget_bytes, "weights_on_gpu_bytes": on_gpu,
                "ms_per_token": per_token_s * 1e3, "prefill_ms": prefill_s * 1e3, "new_tokens": new_tokens}
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def airllm_peer(checkpoint: str, work: str, prompt: torch.Tensor, new_tokens: int) -> dict:
    """AirLLM in its own process (bench/airllm_peer.py): one decoder layer on the GPU at a time."""
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "airllm_peer.py")
    done = subprocess.run([sys.executable, script, checkpoint, "--work", work, "--new-tokens", str(new_tokens),
                           "--prompt-ids", ",".join(map(str, prompt[0].tolist()))], capture_output=True, text=True, timeout=900)
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"config": "AirLLM", "error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    keep = ("ms_per_token", "first_token_s", "split_seconds", "gpu_peak_bytes", "error", "timing")
    return {"config": "AirLLM", **{k: result[k] for k in keep if k in result}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="sampled decode (seeded); 0: greedy")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--skew", type=float, default=1.0, help="the skewed router's exponent, in units of the logit noise (0: no skewed rows)")
    parser.add_argument("--work", default=None, help="folder for the checkpoint and programs (default: a temporary one)")
    parser.add_argument("--peers", default="accelerate,airllm", help="peers to measure on a GPU (comma-separated; empty: none)")
    parser.add_argument("--peer-tokens", type=int, default=6, help="new tokens per peer measurement")
    parser.add_argument("--prefetch", type=int, default=1, help="missing experts a block's guess may prefetch per step in the rows measured again with the guess (0: none)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = shape_config(args.shape)
    if not 0 <= args.prefetch <= config.num_experts_per_tok:
        raise SystemExit(f"--prefetch must be 0 to the shape's top-k ({config.num_experts_per_tok}), got {args.prefetch}")
    result = {"environment": environment(device), "shape": args.shape, "config": config.to_dict(), "temperature": args.temperature,
              "expert_prefetch": args.prefetch, "expert_cache_policy": DEFAULT_POLICY, "other_policy": OTHER_POLICY, "rows": []}
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
        floor = load_floor_on(routed, device)  # the least budget that loads on this device
        whole_floor = load_floor_on(whole, device)
        prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        everything = max(total + max(s.expert_scratch_bytes for s in routed.values()), floor)
        resident = generate(*programs["routed"], everything, prompt, args.new_tokens, device, args.temperature)
        result["all_resident_ms_per_token"] = resident["ms_per_token"]
        if device.type == "cuda":  # decode compiled into one inductor graph (the experts' op inside it): the bound of the compiled rows
            result["all_resident_compiled_ms_per_token"] = generate(*programs["routed"], everything, prompt, args.new_tokens, device, args.temperature,
                                                                    compiled=True)["ms_per_token"]
        result["sampling_warmed_up"] = True  # the Generator's warm-up launched the sampling kernels: the first sampled decode is steady-state too
        budgets = (("floor", floor), ("25%", total // 4), ("50%", total // 2))
        bandwidth = result["pinned_h2d_bytes_per_s"]

        def with_other_policy(row, program, budget):
            """A row with a cache is measured again with the caches evicting as the other policy says."""
            r = row["routed"]
            if r["cache_slots"] and not r["resident_blocks"]:
                other = row[f"routed, {OTHER_POLICY}"] = generate(*program, budget, prompt, args.new_tokens, device, args.temperature, policy=OTHER_POLICY)
                row["policy_speedup"] = other["ms_per_token"] / r["ms_per_token"]  # the default's over the other's

        def with_guess(row, program, budget):
            """A row with a cache is measured again with the next-layer guess prefetching."""
            r = row["routed"]
            if r["cache_slots"] and not r["resident_blocks"] and args.prefetch:
                row["routed, guess prefetched"] = generate(*program, budget, prompt, args.new_tokens, device, args.temperature, expert_prefetch=args.prefetch)
                row["prefetch_speedup"] = r["ms_per_token"] / row["routed, guess prefetched"]["ms_per_token"]

        def with_compiled(row, program, budget):
            """A row whose budget holds every weight but the routed experts is measured again
            with decode compiled (``compiled=("decode",)``): the experts' op runs inside one
            inductor graph, read in place or through the cache as before."""
            if device.type != "cuda":
                return
            try:
                c = row["routed, compiled"] = generate(*program, budget, prompt, args.new_tokens, device, args.temperature, compiled=True)
            except ValueError as e:
                if "compiled needs every weight but routed experts resident" not in str(e):
                    raise
                return
            row["compiled_speedup"] = row["routed"]["ms_per_token"] / c["ms_per_token"]
            # inductor fuses in float32 what the executor rounds to bf16 op by op: its tokens may part, so they are told apart
            row["compiled_same_tokens"] = c["tokens"] == row["routed"]["tokens"]
            bound(row, c, "compiled", result["all_resident_compiled_ms_per_token"])

        def add(row):
            """Record the row, printed without the token lists."""
            measured = [n for n in row if isinstance(row[n], dict)]
            add_row(result, row, path, shown={k: v for k, v in row.items() if k not in measured} | {n: {k: v for k, v in row[n].items() if k != "tokens"} for n in measured})

        def bound(row, r, name="routed", resident_ms=None):
            """``<name>_bound_ms_per_token``: max(the all-resident decode of the same mode, the
            bytes run ``r`` needed over the bus at the pinned bandwidth), and r's ratio to it."""
            if bandwidth:
                transfer = (r["bytes_streamed_per_token"] + r["needed_expert_bytes_per_token"]) / bandwidth * 1e3
                row[f"{name}_bound_ms_per_token"] = max(transfer, resident["ms_per_token"] if resident_ms is None else resident_ms)
                row[f"{name}_ratio_to_bound"] = r["ms_per_token"] / row[f"{name}_bound_ms_per_token"]

        for budget_name, budget in budgets:
            row = {"routing": "uniform", "budget": budget_name, "budget_bytes": max(budget, floor)}
            for name in programs:
                measured = generate(*programs[name], max(budget, floor, whole_floor if name == "all experts" else 0), prompt, args.new_tokens, device, args.temperature)
                row[name] = measured
            r = row["routed"]
            with_other_policy(row, programs["routed"], max(budget, floor))
            with_guess(row, programs["routed"], max(budget, floor))
            with_compiled(row, programs["routed"], max(budget, floor))
            bound(row, r)
            row["speedup_over_all_experts"] = row["all experts"]["ms_per_token"] / r["ms_per_token"]
            row["same_tokens"] = all(row[n]["tokens"] == row["all experts"]["tokens"] for n in row
                                     if isinstance(row[n], dict) and "tokens" in row[n] and n != "routed, compiled")
            add(row)
        peers = [p for p in args.peers.split(",") if p] if device.type == "cuda" else []
        routed_ms = {row["budget"]: row["routed"]["ms_per_token"] for row in result["rows"] if row["routing"] == "uniform"}
        for peer in peers:
            for budget_name, budget in budgets if peer == "accelerate" else (("one layer", floor),):
                t = time.perf_counter()
                if peer == "accelerate":
                    row = accelerate_peer(os.path.join(work, "ckpt"), max(budget, floor), prompt, args.peer_tokens)
                else:
                    row = airllm_peer(os.path.join(work, "ckpt"), os.path.join(work, "airllm"), prompt, args.peer_tokens)
                row |= {"routing": "peer", "budget": budget_name, "seconds": time.perf_counter() - t}
                against = routed_ms.get(budget_name if peer == "accelerate" else "floor")
                if against and row.get("ms_per_token"):
                    row["hostswap_speedup"] = row["ms_per_token"] / against  # hostswap's routed row at that budget (AirLLM: at the floor)
                add_row(result, row, path)
        if args.skew:
            t = time.perf_counter()
            result["skewed_router"] = skew_routers(os.path.join(work, "ckpt"), config, args.skew)
            skewed = export_checkpoint(os.path.join(work, "ckpt"), os.path.join(work, "skewed"), max_seq_len=max_seq_len, prefill_chunk=args.prompt)
            result["export_skewed_s"] = time.perf_counter() - t
            for budget_name, budget in budgets:
                row = {"routing": "skewed", "budget": budget_name, "budget_bytes": max(budget, floor), "routed": generate(*skewed, max(budget, floor), prompt, args.new_tokens, device, args.temperature)}
                with_other_policy(row, skewed, max(budget, floor))
                with_guess(row, skewed, max(budget, floor))
                with_compiled(row, skewed, max(budget, floor))
                bound(row, row["routed"])
                add(row)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
