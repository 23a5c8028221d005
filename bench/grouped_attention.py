"""Grouped-query attention reading its KV cache in place, against the cache's heads repeated, by context length.

    python bench/grouped_attention.py [--models llama,qwen3-moe] [--max-seq-lens 4096,16384] [--budgets all,floor]

transformers' ``repeat_kv`` copies each layer's whole static cache to give every query head
its own key and value heads; ``passes/grouped_query_attention.py`` lets attention read the
grouped cache as it lies instead (SDPA's ``enable_gqa``). The copy grows with the cache, so
each model (a random bf16 checkpoint, ``bench/checkpoints.py``) is exported from its shards
twice per ``--max-seq-lens`` entry: with the pass off ("heads repeated", the graph as
transformers writes it) and as ``hostswap.llm.export_checkpoint`` writes it ("grouped in
place"). For every budget asked (``all``: every weight resident; ``floor``) a ``Generator``
of each decodes ``--new-tokens`` greedy tokens after a 32-token prompt ``--repeats`` times
(graphed decode, the cache as long as the program allows: attention reads all of it, masked).
A row records each program's median ms/token, the speed-up, the activation arena each needs
(the repeated heads are planned there) and whether their tokens are the same. The models:
``llama`` (bench/generate.py's layer: 32 query heads, 8 KV heads) and ``qwen3-moe`` (bench/moe.py's
layer: 32 and 4), ``--layers`` layers each; ``tiny`` is a small Llama for a run on the CPU,
where the op repeats the heads itself. Rows go to ``bench/results/gqa_<device>.json``.
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
from norms import decode, model_config, passes_off  # noqa: E402
from weights import add_row, environment, result_path  # noqa: E402

from hostswap.checkpoint import export_checkpoint  # noqa: E402
from hostswap.passes.grouped_query_attention import GroupedQueryAttentionPass  # noqa: E402
from hostswap.runtime.budget import load_floor_on  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402

MODES = {"heads repeated": (GroupedQueryAttentionPass,), "grouped in place": ()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen3-moe")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of every model")
    parser.add_argument("--experts", type=int, default=16, help="qwen3-moe's experts per block (decode reads 8 at any count)")
    parser.add_argument("--max-seq-lens", default="4096,16384")
    parser.add_argument("--budgets", default="all,floor")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", default=None, help="folder for the checkpoints and programs (default: a temporary one)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = {"environment": environment(device), "new_tokens": args.new_tokens, "repeats": args.repeats, "prompt_tokens": 32, "models": {}, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "gqa", device)
    for name in args.models.split(","):
        config = model_config(name, args.layers, args.experts)
        config.max_position_embeddings = max(config.max_position_embeddings, *(int(s) for s in args.max_seq_lens.split(",")))
        with tempfile.TemporaryDirectory(dir=args.work) as work:
            checkpoint = write_checkpoint(os.path.join(work, "ckpt"), config)
            result["models"][name] = {"config": config.to_dict(), "checkpoint_bytes": checkpoint["bytes"]}
            prompt = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
            for max_seq_len in (int(s) for s in args.max_seq_lens.split(",")):
                start, programs = time.perf_counter(), {}
                for mode, off in MODES.items():
                    with passes_off(*off):
                        programs[mode] = export_checkpoint(os.path.join(work, "ckpt"), os.path.join(work, f"{mode.replace(' ', '_')}_{max_seq_len}"),
                                                           max_seq_len=max_seq_len, prefill_chunk=32)
                schedules = load_weight_schedules(programs["grouped in place"][0])
                floor = load_floor_on(schedules, device)
                everything = max(max(s.all_resident_budget_bytes for s in schedules.values()), floor)
                budgets = {"all": ("all resident", everything), "floor": ("floor", floor)}
                for key in args.budgets.split(","):
                    label, budget = budgets[key]
                    row = {"model": name, "max_seq_len": max_seq_len, "budget": label, "budget_bytes": budget, "setup_s": time.perf_counter() - start}
                    for mode, (pte, ptd) in programs.items():
                        row[mode] = decode(pte, ptd, budget, prompt, args.new_tokens, args.repeats, device)
                    repeated, grouped = row["heads repeated"], row["grouped in place"]
                    grouped["speedup"] = repeated["ms_per_token"] / grouped["ms_per_token"]
                    grouped["first_difference"] = next((i for i, (a, b) in enumerate(zip(grouped["tokens"], repeated["tokens"])) if a != b), None)
                    add_row(result, row, path, shown={k: v for k, v in row.items() if k not in MODES}
                            | {m: (row[m]["ms_per_token"], row[m]["activation_arena_bytes"]) for m in MODES})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
