"""How often a routed block's guess at the next block's experts is right, on the MoE bench's
random weights (CPU, no program: transformers' own forward with hooks).

The guess (experts.py) is the next block's router, through the next block's input norm, on
this layer's residual stream before its experts. The trace decodes ``--tokens`` tokens from a
random prompt (sampled at ``--temperature`` with a fixed seed, as bench/moe.py does; 0:
greedy) and counts, for each pair of consecutive layers, the next block's picks found among
the guess's top-k; it also counts the same guess made after this layer's experts (the next
layer's input), and the picks a block shares with its own picks of the token before.

It then replays the trace's decode steps through ``ExpertCache`` (runtime/expert_cache.py, its
torch ops on the CPU: the bookkeeping the GPU's kernel matches call for call) with
``--slots`` slots per block, as a decode step drives it: block L looks its picks up, then
prefetches block L+1's guess. Three ways: no guess; the N best scored experts the cache lacks,
alone ("lacking"), whose misses may evict cached experts the guess predicts; and the guess held
(``ExpertCache.guess``: the predicted top-k, of which at most the N best scored missing ones:
the cached ones among the predicted come along as hits, so the guessed misses cannot evict
them). It counts hits and the guesses a
lookup read, under each eviction policy (``POLICIES``: the expert picked least often lately,
or the least recently used). The routing is the random router's.

The same decode steps are replayed once more for experts on disk (runtime/expert_store.py):
each block's host cache (``HostSlots``, ``--host-slots`` per block) is asked for the picks its
device cache lacks (``--slots``' first figure, or none: every pick), both caches evicting as
each policy says, and the experts read from the disk per block and token are counted. The
result goes to stdout and, with ``--out``, to ``<out>/guess_cpu_<shape>.json``
(bench/report.py renders it).

    python bench/expert_guess.py --shape many      # 4 layers of the Qwen3-MoE shape
    python bench/expert_guess.py --shape mixtral   # 3 layers of the Mixtral shape, experts 8x narrower
    python bench/expert_guess.py --shape tiny      # the script's paths, in seconds

Every value is drawn from N(0, 0.02), norms included, as bench/checkpoints.py writes them.
The Mixtral shape's experts are narrowed to fit a CPU's memory; on these weights the experts'
output is small beside the residual stream, so the width hardly moves the routing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def config_for(shape: str):
    """bench/moe.py's shape, made to fit a CPU: the Qwen3-MoE shape's first 4 layers, the
    Mixtral shape's experts 8 times narrower."""
    from moe import shape_config

    config = shape_config(shape)
    config.dtype = None  # the trace casts the model itself
    if shape == "many":
        config.num_hidden_layers = 4
    elif shape == "mixtral":
        config.intermediate_size //= 8
    return config


# slots per block of the GPU bench's caches (bench/moe.py at 25 % and 50 % of the weights)
SLOTS = {"many": (27, 60), "mixtral": (3,), "tiny": (2, 3)}
# host slots per block of bench/moe_disk.py's host caches (12.5, 25 and 50 % of the tables; at least top-k)
HOST_SLOTS = {"many": (16, 32, 64), "mixtral": (2, 4), "tiny": (2, 3)}
GUESSES = ("none", "lacking", "held")


def lacking_guess(cache, scores: torch.Tensor) -> torch.Tensor:
    """The ``prefetching`` best scored experts the cache lacks, alone: the cached experts the
    guess predicts are not held, so a guessed miss may evict one of them."""
    scores = scores.reshape(-1).float()
    return torch.topk(scores.masked_fill(cache.slot_of[: cache.num_experts] >= 0, float("-inf")), cache.prefetching).indices


def replay(steps: list, experts: int, k: int, slots: int, guess: str, n: int, policy: str) -> dict:
    """The decode steps' picks (per step, per block: top-k ids) and guess scores (per step,
    per block after the first: that block's router on the block before's residual stream)
    through one ``ExpertCache`` per block, evicting as ``policy`` says."""
    from hostswap.runtime.expert_cache import ExpertCache

    blocks = len(steps[0][0])
    tables = (torch.zeros(experts, 1, 1), torch.zeros(experts, 1, 1), None)  # the rows' values do not matter here
    caches = [ExpertCache(f"block {i}", experts, 8, slots, k, torch.device("cpu"), prefetch=n if guess != "none" else 0, policy=policy)
              for i in range(blocks)]
    for picks, scores in steps:
        for i, cache in enumerate(caches):
            cache.lookup(picks[i].view(1, k), tables)
            if guess != "none" and i + 1 < blocks:
                after = caches[i + 1]
                after.prefetch(lacking_guess(after, scores[i + 1]) if guess == "lacking" else after.guess(scores[i + 1]))
    hits, misses, prefetched, used, _ = (sum(c) for c in zip(*(cache.counts() for cache in caches)))
    return {"slots": slots, "policy": policy, "guess": guess, "hit_rate": hits / (hits + misses), "prefetched_per_lookup": prefetched / (hits + misses),
            "guesses_read": used / prefetched if prefetched else None}


def replay_host(steps: list, experts: int, k: int, host_slots: int, device_slots: int, policy: str) -> dict:
    """The decode steps' picks through a host cache of ``host_slots`` per block
    (``HostSlots``), asked for those a device cache of ``device_slots`` (0: none) lacks, both
    evicting as ``policy`` says: the experts read from the disk per block and token."""
    from hostswap.runtime.expert_cache import ExpertCache
    from hostswap.runtime.expert_store import HostSlots

    blocks = len(steps[0][0])
    tables = (torch.zeros(experts, 1, 1), torch.zeros(experts, 1, 1), None)
    hosts = [HostSlots(host_slots, experts, policy) for _ in range(blocks)]
    devices = [ExpertCache(f"block {i}", experts, 8, device_slots, k, torch.device("cpu"), policy=policy) for i in range(blocks)] if device_slots else None
    reads = asked = 0
    for picks, _ in steps:
        for i, host in enumerate(hosts):
            lacking = picks[i].tolist()
            if devices:  # a pick the device cache holds needs nothing from the disk
                lacking = [e for e, held in zip(lacking, (devices[i].slot_of[picks[i]] >= 0).tolist()) if not held]
                devices[i].lookup(picks[i].view(1, k), tables)
            slots, read = host.place(lacking)
            host.filled(read, slots)
            reads, asked = reads + len(read), asked + len(lacking)
    return {"host_slots": host_slots, "device_slots": device_slots, "policy": policy, "disk_reads_per_block_token": reads / len(steps) / blocks,
            "host_hit_rate": 1 - reads / asked if asked else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="many")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--slots", type=lambda v: [int(x) for x in v.split(",") if x], default=None,
                        help="cache slots per block to replay (default: the GPU bench's for the shape)")
    parser.add_argument("--host-slots", type=lambda v: [int(x) for x in v.split(",") if x], default=None,
                        help="host cache slots per block to replay experts on disk with (default: bench/moe_disk.py's for the shape)")
    parser.add_argument("--prefetch", type=int, default=1, help="guessed experts per block and step in the replay")
    parser.add_argument("--out", default=None, help="folder for guess_cpu_<shape>.json (default: stdout only)")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from hostswap.runtime.expert_cache import POLICIES

    config = config_for(args.shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    layers, k = model.model.layers, config.num_experts_per_tok
    before_experts, after_layer = {}, {}
    for i, layer in enumerate(layers):
        layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a, i=i: before_experts.__setitem__(i, a[0][:, -1]))
        layer.register_forward_hook(lambda m, a, out, i=i: after_layer.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[:, -1]))

    def scores(i: int, x: torch.Tensor) -> torch.Tensor:
        norm = layers[i].post_attention_layernorm
        return torch.nn.functional.linear(type(norm).forward(norm, x), layers[i].mlp.gate.weight).float()  # the class's forward: no hook

    def top(logits: torch.Tensor) -> torch.Tensor:
        return torch.topk(logits, k).indices.reshape(-1)

    experts = layers[0].mlp.gate.weight.shape[0]
    slots = args.slots if args.slots is not None else SLOTS[args.shape]
    if any(not k <= s < experts for s in slots) or not 0 < args.prefetch <= k:
        raise SystemExit(f"--slots must be {k} to {experts - 1} and --prefetch 1 to {k}, got {slots} and {args.prefetch}")
    host_slots = args.host_slots if args.host_slots is not None else HOST_SLOTS[args.shape]
    if any(not k <= s <= experts for s in host_slots):
        raise SystemExit(f"--host-slots must be {k} to {experts}, got {host_slots}")
    trace: list = []  # per decode step: (each block's top-k ids, each block's guess scores)

    counts = {"early": 0, "late": 0, "guessed": 0, "repeated": 0, "picks": 0}
    previous: dict[int, set[int]] = {}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    past = None
    with torch.no_grad():
        for step in range(args.tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            if step:  # decode steps only, as the cache sees them
                # each block's own picks, and the guess at each block after the first (its router on the block before's input)
                own = [top(scores(i, before_experts[i])) for i in range(len(layers))]
                early = [None] + [scores(i + 1, before_experts[i]).reshape(-1) for i in range(len(layers) - 1)]
                trace.append((own, early))
                for i in range(len(layers) - 1):
                    true = set(own[i + 1].tolist())
                    counts["early"] += len(true & set(top(early[i + 1]).tolist()))
                    counts["late"] += len(true & set(top(scores(i + 1, after_layer[i])).tolist()))
                    counts["guessed"] += k
                for i in range(len(layers)):
                    now = set(own[i].tolist())
                    counts["repeated"] += len(now & previous.get(i, set()))
                    counts["picks"] += k
                    previous[i] = now
            logits = out.logits[0, -1].float()
            ids = (torch.multinomial(torch.softmax(logits / args.temperature, -1), 1, generator=gen) if args.temperature
                   else logits.argmax().view(1)).view(1, 1)
    steps = args.tokens - 1
    from weights import environment

    result = {"environment": environment(torch.device("cpu")), "shape": args.shape, "layers": len(layers), "experts": experts, "top_k": k,
              "temperature": args.temperature, "decode_steps": steps, "prefetch": args.prefetch,
              "guess_found": counts["early"] / counts["guessed"], "guess_after_experts_found": counts["late"] / counts["guessed"],
              # a block's picks of the token before it also picked (the first decode step has none before it)
              "same_as_previous_token": counts["repeated"] / (counts["picks"] - len(layers) * k),
              "cache": [replay(trace, experts, k, s, guess, args.prefetch, policy) for s in slots for policy in POLICIES for guess in GUESSES],
              "host_cache": [replay_host(trace, experts, k, h, d, policy) for d in (0, slots[0]) for h in host_slots for policy in POLICIES]}
    print(json.dumps(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"guess_cpu_{args.shape}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
