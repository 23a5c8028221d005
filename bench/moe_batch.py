"""Batched MoE decode through the expert caches: a step's (token, expert) pairs from the caches'
slots against its picked experts read in place from the tables, at the same budget.

    python bench/moe_batch.py [--shape many] [--layers 4] [--batches 4,8] [--live all,2] [--budgets 25%,50%]

A random bf16 checkpoint of bench/moe.py's shape (``--layers`` of them) is exported with
``max_batch_size=B`` for each batch size B, its experts read in place. For each budget a
``BatchGenerator`` takes B prompts of ``--prompt`` tokens, sampled at ``--temperature`` with a
fixed seed; once all are prefilled and the decode graph is captured, ``--new-tokens`` decode
steps are timed: ms per step (every sequence's token), tokens/s, the caches' hit rate over
those steps and the experts that crossed the bus per step (the misses). Each budget runs twice:
with its caches ("cache") and with them withheld ("in place": the same budget and program, each
pair read from the tables in mapped host memory, as at a budget with no room for a cache).
A row's bound is max(the all-resident step at that B, its experts over the bus per step /
pinned H2D bandwidth measured in this run). In place, a step reads each expert its rows picked
once (``routed_union``); each budget runs a third time with every (row, pick) read on its own
("in place, per pick", as a decode step of one token reads its picks). ``--live`` adds rows where only some of the B slots
hold a sequence ("all": every slot): the step still computes every row, and its empty rows read
no experts ("live rows"); each such row is measured again with the empty rows reading theirs
("every row"), as a program stepped without its live rows named would. Rows go to ``bench/results/moebatch_<device>.json``
as they are measured. ``--device cpu`` runs the script's paths without a GPU: a CPU step is
not a captured graph, so both modes read the union in place there and no bound is given.
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
from weights import add_row, environment, h2d_bandwidth, result_path, save_result, sync  # noqa: E402

import hostswap.kernels.routed_experts as routed_experts  # noqa: E402
import hostswap.runtime.module as runtime_module  # noqa: E402
from hostswap import batching  # noqa: E402
from hostswap.checkpoint import export_checkpoint  # noqa: E402
from hostswap.sampling import SamplingParams  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402
from hostswap.runtime.budget import load_floor_on  # noqa: E402


@contextlib.contextmanager
def caches_withheld():
    """Modules loaded in the body give no block an expert cache: their budget's room for experts
    stays unused and every pair is read in place."""
    place = runtime_module.place_experts
    runtime_module.place_experts = lambda *args, **kwargs: (frozenset(), {})
    try:
        yield
    finally:
        runtime_module.place_experts = place


@contextlib.contextmanager
def every_row_read():
    """Modules run in the body read every row's experts: the rows a step names live are ignored."""
    reading = runtime_module.reading_rows
    runtime_module.reading_rows = lambda live: reading(None)
    try:
        yield
    finally:
        runtime_module.reading_rows = reading


@contextlib.contextmanager
def per_pick_products():
    """Modules run in the body read a captured step's experts once per (row, pick), as one
    token's decode step does (``routed_gemv``), rather than each picked expert once: the
    reference the union's reads are measured against."""
    pairs, counter = routed_experts._pairs, routed_experts._device_counter

    def record_pairs(block, ids, unit_bytes):
        if not routed_experts._graph_paths(ids):  # an eager call (a prefill chunk) reads its experts as it does outside the bench
            return counter(block, ids, unit_bytes)
        routed_experts._record_pairs(block, ids, unit_bytes, routed_experts._live_rows(block, ids.shape[0]))

    def per_pick(*args, union=False, count_into=None, **kwargs):
        return pairs(*args, count_into=count_into, **kwargs) if kwargs.get("grouped") is not None else pairs(*args, **kwargs)

    routed_experts._pairs = per_pick
    routed_experts._device_counter = record_pairs
    try:
        yield
    finally:
        routed_experts._pairs, routed_experts._device_counter = pairs, counter


def measure(pte: str, ptd: str, budget_bytes: int, prompts: list[list[int]], new_tokens: int, device: torch.device, temperature: float) -> dict:
    sampling = SamplingParams(temperature=temperature, seed=0) if temperature else None
    with batching.BatchGenerator(pte, ptd, weight_offload_budget_mb=budget_bytes / 2**20, device=device) as b:
        b.generate(prompts, 3, eos_token_id=[], sampling=sampling)  # captures the decode graph and warms the samplers
        sequences = [b.add(p, new_tokens + 1, eos_token_id=[], sampling=sampling) for p in prompts]
        caches = b.module.expert_caches
        before = {block: c.counts()[:2] for block, c in caches.items()}
        read_before = b.module.expert_bytes_read  # over the bus: misses, pairs or experts read in place
        sync(device)
        start = time.perf_counter()
        for _ in range(new_tokens):
            b.step()
        sync(device)
        seconds = time.perf_counter() - start
        after = {block: c.counts()[:2] for block, c in caches.items()}  # a host sync per block, once
        hits = sum(after[block][0] - before[block][0] for block in caches)
        misses = sum(after[block][1] - before[block][1] for block in caches)
        assert all(len(s.tokens) == new_tokens + 1 for s in sequences)
        return {"ms_per_step": seconds / new_tokens * 1e3, "tokens_per_s": len(prompts) * new_tokens / seconds, "budget_bytes": budget_bytes,
                "graphed": b.module.cuda_graph, "cache_slots": sorted({c.slots for c in caches.values()}),
                "resident_blocks": len(b.module.resident_experts), "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
                "expert_bytes_per_step": (b.module.expert_bytes_read - read_before) / new_tokens,
                "tokens": [s.tokens for s in sequences]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="many", help="bench/moe.py's shapes: many, mixtral, tiny")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="4,8")
    parser.add_argument("--live", default="all,2", help="sequences decoding in the B slots: all, or a count below B")
    parser.add_argument("--budgets", default="25%,50%", help="shares of every weight, experts included")
    parser.add_argument("--prompt", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (random weights soon repeat a few tokens, which flatters a cache)")
    parser.add_argument("--device", default="cuda", help="cpu runs the script's paths without a GPU (no bandwidth, no bound)")
    parser.add_argument("--work", default=None, help="folder for the checkpoint and programs (default: a temporary one)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = shape_config(args.shape)
    config.num_hidden_layers = args.layers
    result = {"environment": environment(device), "shape": args.shape, "layers": args.layers, "prompt": args.prompt, "new_tokens": args.new_tokens,
              "temperature": args.temperature, "experts": getattr(config, "num_local_experts", None) or config.num_experts,
              "top_k": config.num_experts_per_tok, "rows": []}
    result["pinned_h2d_bytes_per_s"] = h2d_bandwidth(device, torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()) if device.type == "cuda" else None
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "moebatch", device)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or scratch
        result["checkpoint"] = write_checkpoint(os.path.join(work, "ckpt"), config)
        for b in [int(x) for x in args.batches.split(",")]:
            prompts = torch.randint(0, config.vocab_size, (b, args.prompt), generator=g).tolist()
            pte, ptd = export_checkpoint(os.path.join(work, "ckpt"), os.path.join(work, f"b{b}"), max_seq_len=args.prompt + args.new_tokens + 8,
                                         prefill_chunk=args.prompt, max_batch_size=b)
            schedules = load_weight_schedules(pte)
            decode = schedules["decode"]
            total = decode.resident_bytes + sum(e.table_bytes for e in decode.expert_blocks)  # every weight, experts included
            floor = load_floor_on(schedules, device)
            scratch_bytes = max(s.expert_scratch_bytes for s in schedules.values())
            resident = measure(pte, ptd, max(total + scratch_bytes, floor), prompts, args.new_tokens, device, args.temperature)
            add_row(result, {"batch": b, "live": b, "rows_read": "live rows", "budget": "all", "mode": "all resident", **resident}, path, shown={"batch": b, "budget": "all", "ms_per_step": resident["ms_per_step"]})
            lives = [b if n == "all" else int(n) for n in args.live.split(",")]
            for live, budget in [(n, budget) for n in lives if 0 < n <= b for budget in args.budgets.split(",")]:
                budget_bytes = max(floor, int(total * float(budget.rstrip("%")) / 100))
                rows = {}
                for mode in ("cache", "in place", "in place, per pick"):
                    for read in ("live rows", "every row") if live < b and mode != "in place, per pick" else ("live rows",):
                        with (caches_withheld() if mode != "cache" else contextlib.nullcontext(), every_row_read() if read == "every row" else contextlib.nullcontext(),
                              per_pick_products() if mode == "in place, per pick" else contextlib.nullcontext()):
                            rows[mode, read] = measure(pte, ptd, budget_bytes, prompts[:live], args.new_tokens, device, args.temperature)
                for (mode, read), row in rows.items():
                    row["same_tokens"] = row["tokens"] == resident["tokens"][:live]
                    if result["pinned_h2d_bytes_per_s"]:
                        row["bound_ms_per_step"] = max(resident["ms_per_step"], row["expert_bytes_per_step"] / result["pinned_h2d_bytes_per_s"] * 1e3)
                        row["ratio_to_bound"] = row["ms_per_step"] / row["bound_ms_per_step"]
                    if mode == "cache":
                        row["speedup_over_in_place"] = rows["in place", read]["ms_per_step"] / row["ms_per_step"]
                    if mode == "in place" and read == "live rows":
                        row["speedup_over_per_pick"] = rows["in place, per pick", "live rows"]["ms_per_step"] / row["ms_per_step"]
                    if read == "live rows" and live < b and mode != "in place, per pick":
                        row["speedup_over_every_row"] = rows[mode, "every row"]["ms_per_step"] / row["ms_per_step"]
                    labels = {"batch": b, "live": live, "rows_read": read, "budget": budget, "mode": mode}
                    add_row(result, labels | row, path, shown={k: v for k, v in row.items() if k != "tokens"} | labels)
    save_result(result, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
