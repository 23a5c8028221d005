"""What one decode step of a resident draft costs, and what it is made of.

    python bench/draft_cost.py                       # GPU: SmolLM2's shape, bf16 and int8
    python bench/draft_cost.py --device cpu --layers 2 --schemes none --steps 3

Speculative streaming pays when a draft step costs little beside the target's streamed pass:
a round of k proposals costs about ``k`` draft steps plus one pass. A draft held whole on the
device is not bound by bytes but by its kernels: each decode step launches the same kernels,
whatever the weights' bytes. For a transformers Llama of the given shape (random weights:
acceptance is not measured here; bench/speculative.py measures it on real weights), each
scheme's program is loaded with every weight resident and timed over ``--steps`` decode steps
(graphed on CUDA), run as the executor's kernel per instruction and compiled into one graph
by inductor (``Module(compiled=...)``, what a draft given by path gets on CUDA). Each row counts the kernels of one step from the program's instruction
list (views excluded: they launch nothing), per layer too, and on CUDA the kernels a profiled
step launched and the ones it spent the most time in. Rows go to
``bench/results/drafts_<device>.json``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from speculative import FUSED  # noqa: E402
from weights import add_row, environment, result_path  # noqa: E402

from hostswap import llm  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402
from hostswap.schedules.weight_schedule import load_floor_bytes  # noqa: E402


def smollm2_shaped(layers: int, vocab: int):
    """A Llama of SmolLM2-135M's shape (hidden 576, 9 heads, 3 key/value heads, tied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                         num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def every_weight_mb(pte) -> float:
    schedules = load_weight_schedules(pte)
    return max(load_floor_bytes(schedules), schedules[llm.DECODE].total_bytes) / 2**20 + 1


def step_kernels(generator) -> collections.Counter:
    """Operator -> launches in one decode step, from the decode method's instruction list."""
    executor = generator.module._executors[llm.DECODE]
    counts = collections.Counter()
    for ins in executor.instructions:
        if ins.tag == "kernel" and ins.view_op is None:
            op = ins.op
            counts[getattr(op, "__name__", None) or str(getattr(op, "_schema", op)).split("(")[0]] += 1
    return counts


def profiled_kernels(generator, device: torch.device, replays: int = 5) -> tuple[float, list]:
    """(GPU kernels launched per step, the 12 kernels that took the most time per step) of
    graphed decode steps under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    ids, positions = torch.zeros(1, 1, dtype=torch.long, device=device), torch.arange(20, 21, device=device)
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(replays):
            generator.module.run_method(llm.DECODE, [ids, positions])
        torch.cuda.synchronize(device)
    kernels = [e for e in trace.key_averages() if e.self_device_time_total > 0]
    per_step = sum(e.count for e in kernels) / replays
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    return per_step, [{"kernel": e.key[:100], "per_step": e.count / replays, "us_per_step": e.self_device_time_total / replays} for e in top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--schemes", default=None, help="none (the model's dtype), int8, int4, each optionally with -fused: its sibling linears "
                   "(q/k/v, gate/up) exported as one (default: none,int8 on CUDA, none on the CPU)")
    p.add_argument("--dtype", default=None, help="the model's dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--compiled", choices=["both", "yes", "no"], default="both",
                   help="run decode as the executor's kernel per instruction (no), compiled into one graph by inductor (yes), or both")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    schemes = (args.schemes or ("none,int8" if cuda else "none")).split(",")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    result = {"environment": environment(device), "model": f"SmolLM2-135M shape, {args.layers} layers, random weights", "dtype": str(dtype).removeprefix("torch."),
              "rows": []}
    path = result_path(args.out, "drafts", device)
    os.makedirs(args.out, exist_ok=True)
    model = smollm2_shaped(args.layers, args.vocab).to(dtype)
    one_layer = smollm2_shaped(1, args.vocab).to(dtype)
    with tempfile.TemporaryDirectory() as folder:
        for scheme in schemes:
            counts, paths = {}, {}
            for layers, m in ((1, one_layer), (args.layers, model)):
                base = scheme.removesuffix(FUSED)
                draft = copy.deepcopy(m) if base == "none" else llm.quantize(copy.deepcopy(m), base)
                paths[layers] = llm.export(draft, os.path.join(folder, f"{scheme}-{layers}"), max_seq_len=args.max_seq_len, prefill_chunk=32,
                                           fuse_linears=scheme.endswith(FUSED))
                with llm.Generator(*paths[layers], weight_offload_budget_mb=every_weight_mb(paths[layers][0]), device=device, warm_up=False) as g:
                    counts[layers] = step_kernels(g)
            total, single = sum(counts[args.layers].values()), sum(counts[1].values())
            per_layer = (total - single) / (args.layers - 1) if args.layers > 1 else None
            for compiled in (False, True) if args.compiled == "both" else (args.compiled == "yes",):
                pte, ptd = paths[args.layers]
                with llm.Generator(pte, ptd, weight_offload_budget_mb=every_weight_mb(pte), device=device, compiled=(llm.DECODE,) if compiled else False) as g:
                    prompt = torch.arange(8).reshape(1, 8)
                    g.generate(prompt, 4, eos_token_id=[])  # one-time costs
                    g.generate(prompt, args.steps + 1, eos_token_id=[])
                    ms = g.last.decode_seconds / args.steps * 1e3
                    profiled, top = profiled_kernels(g, device) if cuda else (None, [])
                add_row(result, {"scheme": scheme, "compiled": compiled, "layers": args.layers, "ms_per_step": ms, "kernels_per_step": total,
                                 "kernels_per_layer": per_layer, "kernels_outside_layers": total - per_layer * args.layers if per_layer is not None else None,
                                 "us_per_kernel": ms * 1e3 / total, "gpu_kernels_per_step": profiled, "top_gpu_kernels": top,
                                 "operators_per_layer": {op: (counts[args.layers][op] - counts[1][op]) / (args.layers - 1) for op in counts[args.layers]}
                                 if args.layers > 1 else None},
                        path, shown={"scheme": scheme, "compiled": compiled, "ms_per_step": ms, "kernels_per_step": total, "gpu_kernels_per_step": profiled})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
