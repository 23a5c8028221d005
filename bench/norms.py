"""Norms and rotary as one kernel: decode with ``hostswap::rms_norm`` and ``hostswap::rotary`` against the same program's ATen ops.

    python bench/norms.py [--models llama,qwen3-moe] [--budgets all,floor] [--new-tokens 64] [--repeats 3]

Each model is a random bf16 checkpoint (``bench/checkpoints.py``) exported three times from its
shards: with both passes switched off ("ATen ops": each RMSNorm as transformers writes it,
casts, pow, mean, add, rsqrt and two products, and each rotary embedding as two products, a
negation, a concatenation and a sum, one launch each), with the norms only ("norms": each
RMSNorm, weight included, one ``hostswap::rms_norm``, passes/fused_rms_norm.py), and as
``hostswap.llm.export_checkpoint`` writes it ("norms and rotary": also each rotated query and
key one ``hostswap::rotary``, passes/fused_rotary.py). For every budget asked (``all``: every
weight resident; ``floor``), a ``Generator`` of each program decodes ``--new-tokens`` greedy
tokens after a 32-token prompt ``--repeats`` times (graphed decode); a row records each
program's median ms/token, the fused programs' speed-ups over the ATen ops, and whether their
tokens are the ATen ops', with the first position where they part. The models: ``llama``
(bench/generate.py's layer, hidden 2048, 12 layers) and ``qwen3-moe`` (bench/moe.py's
Qwen3-MoE layer, which also normalizes each head's queries and keys, 8 layers, with
``--experts`` experts: decode reads 8 of them a token at any count, so fewer make a smaller
checkpoint with the same step); ``tiny`` is a small Llama for a run on the CPU, where the op
runs the ATen ops themselves. Rows go to ``bench/results/norms_<device>.json``.
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
from weights import add_row, environment, result_path  # noqa: E402

from hostswap import llm  # noqa: E402
from hostswap.checkpoint import export_checkpoint  # noqa: E402
from hostswap.passes.fused_rms_norm import FuseRmsNormPass  # noqa: E402
from hostswap.passes.fused_rotary import FuseRotaryPass  # noqa: E402
from hostswap.runtime.budget import load_floor_on  # noqa: E402
from hostswap.schedules.pte_program import read_program  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402

# each program, and the passes switched off to export it
MODES = {"ATen ops": (FuseRmsNormPass, FuseRotaryPass), "norms": (FuseRotaryPass,), "norms and rotary": ()}
FUSED = ("norms", "norms and rotary")


@contextlib.contextmanager
def passes_off(*passes):
    """Exports in the body leave what ``passes`` (fusion pass classes) would fuse as the ATen ops
    transformers writes."""
    calls = {p: p.call for p in passes}
    for p in passes:
        p.call = lambda self, graph_module: 0
    try:
        yield
    finally:
        for p, call in calls.items():
            p.call = call


def model_config(name: str, layers: int | None, experts: int):
    from transformers import LlamaConfig

    if name == "llama":
        return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers or 12, num_attention_heads=32,
                           num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    if name == "qwen3-moe":
        config = shape_config("many")
        config.num_hidden_layers, config.num_experts = layers or config.num_hidden_layers, experts
        return config
    if name == "tiny":  # for a run on the CPU
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers or 2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    raise SystemExit(f"--models takes llama, qwen3-moe and tiny, got {name!r}")


def op_calls(pte: str, op: str) -> int:
    """Calls of operator ``op`` in the decode method of program ``pte``."""
    plan = next(p for p in read_program(pte).execution_plan if p.name == llm.DECODE)
    return sum(1 for chain in plan.chains for ins in chain.instructions
               if type(ins.instr_args).__name__ == "KernelCall" and plan.operators[ins.instr_args.op_index].name == op)


def decode(pte: str, ptd: str, budget: int, prompt: torch.Tensor, new_tokens: int, repeats: int, device: torch.device) -> dict:
    with llm.Generator(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=device) as g:
        runs = []
        for _ in range(repeats):
            out = g.generate(prompt, new_tokens, eos_token_id=[])
            runs.append(g.stats["ms_per_token"])
        return {"ms_per_token": sorted(runs)[(len(runs) - 1) // 2], "runs_ms": runs, "tokens": out[0, prompt.shape[1]:].tolist(),
                "activation_arena_bytes": g.stats["activation_arena_bytes"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen3-moe")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of every model (default: 12 for llama, 8 for qwen3-moe)")
    parser.add_argument("--experts", type=int, default=32, help="qwen3-moe's experts per block")
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
    path = result_path(args.out, "norms", device)
    for name in args.models.split(","):
        config = model_config(name, args.layers, args.experts)
        with tempfile.TemporaryDirectory(dir=args.work) as work:
            start = time.perf_counter()
            checkpoint = write_checkpoint(os.path.join(work, "ckpt"), config)
            programs = {}
            for mode, off in MODES.items():
                with passes_off(*off):
                    programs[mode] = export_checkpoint(os.path.join(work, "ckpt"), os.path.join(work, mode.replace(" ", "_")), max_seq_len=32 + args.new_tokens,
                                                       prefill_chunk=32)
            result["models"][name] = {"config": config.to_dict(), "checkpoint_bytes": checkpoint["bytes"], "setup_s": time.perf_counter() - start,
                                      "calls": {mode: {op: op_calls(pte, op) for op in ("hostswap::rms_norm", "hostswap::rotary")}
                                                for mode, (pte, _) in programs.items()}}
            schedules = load_weight_schedules(programs["norms and rotary"][0])
            floor = load_floor_on(schedules, device)
            everything = max(max(s.all_resident_budget_bytes for s in schedules.values()), floor)
            budgets = {"all": ("all resident", everything), "floor": ("floor", floor)}
            prompt = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
            for key in args.budgets.split(","):
                label, budget = budgets[key]
                row = {"model": name, "budget": label, "budget_bytes": budget}
                for mode, (pte, ptd) in programs.items():
                    row[mode] = decode(pte, ptd, budget, prompt, args.new_tokens, args.repeats, device)
                aten = row["ATen ops"]
                for mode in FUSED:
                    row[mode]["speedup"] = aten["ms_per_token"] / row[mode]["ms_per_token"]
                    row[mode]["first_difference"] = next((i for i, (a, b) in enumerate(zip(row[mode]["tokens"], aten["tokens"])) if a != b), None)
                add_row(result, row, path, shown={k: v for k, v in row.items() if k not in MODES} | {m: row[m]["ms_per_token"] for m in MODES})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
