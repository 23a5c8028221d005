"""Load time against depth: what a Module's load costs beyond copying the resident weights.

    python bench/load.py [--layers 12,40,80] [--device cpu]

A transformers Llama with thin layers (hidden 64: the weights' bytes do not matter here, their
count does) is exported with ``hostswap.llm.export`` at each depth. Each program is then loaded
at its floor, at 50 % and at every weight resident (best of ``--repeat``), and the parts of a
load are timed alone: parsing the ``.pte`` (ExecuTorch's deserializer), the planned layout at
that budget, and the rest (executors, view planning, pool). Rows go to
``bench/results/load_<device>.json``.
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

from weights import add_row, best_seconds, environment, result_path  # noqa: E402

from hostswap import llm  # noqa: E402
from hostswap.runtime import Module  # noqa: E402
from hostswap.schedules.policies import plan_layout  # noqa: E402
from hostswap.schedules.pte_program import read_program, read_program_bytes  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402
from hostswap.schedules.weight_schedule import load_floor_bytes  # noqa: E402


def thin_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12,40,80")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = {"environment": environment(device) | {"cpu_count": os.cpu_count()}, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "load", device)
    with tempfile.TemporaryDirectory() as folder:
        for layers in (int(n) for n in args.layers.split(",")):
            start = time.perf_counter()
            pte, ptd = llm.export(thin_llama(layers), os.path.join(folder, f"l{layers}"), max_seq_len=64, prefill_chunk=16)
            export_s = time.perf_counter() - start
            schedules = load_weight_schedules(pte)
            schedule = schedules["decode"]
            floor, total = load_floor_bytes(schedules), schedule.total_bytes
            parse_s = best_seconds(lambda: read_program(read_program_bytes(pte), pte), args.repeat)
            for name, budget in (("floor", floor), ("50%", max(floor, total // 2)), ("all", max(floor, schedule.resident_bytes))):
                load_s = best_seconds(lambda: Module(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=device).close(), args.repeat)
                layout_s = best_seconds(lambda: plan_layout(schedule, budget), args.repeat)
                row = {"layers": layers, "weights": len(schedule.fqns), "program_bytes": os.path.getsize(pte), "export_s": export_s, "budget": name,
                       "budget_bytes": budget, "load_s": load_s, "parse_s": parse_s, "layout_s": layout_s, "rest_s": load_s - parse_s - layout_s}
                add_row(result, row, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
