"""Streamed generation: hostswap.llm against transformers' generate and accelerate, one process.

    python bench/generate.py --layers 12                 # transformers Llama, 1.25 GiB of bf16 weights
    python bench/generate.py --layers 46 --part 4gib     # 4.1 GiB
    python bench/generate.py --layers 12 --dtype float32 --budgets floor,100% --prompts 128 --skip-accelerate --part fp32
    python bench/generate.py --layers 12 --budgets floor,25%,50%,75% --quantize int8,int4 --skip-accelerate --part quantized

A transformers ``LlamaForCausalLM`` (hidden 2048, GQA 32/8 heads, bf16, random weights from a
config) is exported once with ``hostswap.llm.export``. For each prompt length and budget
(floor, 25/50/75/100 % of the weight bytes) a ``Generator`` generates ``--new-tokens`` greedy
tokens; rows give prefill ms, decode ms/token, tokens/s and bytes streamed per token. In the
same process: transformers' ``generate`` with every weight on the GPU, accelerate's
``dispatch_model`` with ``max_memory`` at the same GPU memory, and the bound = max(all-resident
ms/token, bytes streamed per token / pinned H2D bandwidth measured in this run), computed by
bench/report.py. hostswap's tokens are checked against transformers' with the same static
cache for the first ``--check-tokens``; where they part, the row records the reference's logit
margin between its token and hostswap's at that step (a near-tie that a different kernel
order flips shows a margin of the order of the dtype's rounding). Every row is
written to ``bench/results/generate_<device>[_<part>].json`` as soon as it is measured.

``--quantize int8,int4``: after the bf16 rows, for each scheme a deepcopy of the same bf16
model is quantized with ``hostswap.llm.quantize`` (torchao weight-only: int8, or int4 in the
tinygemm layout), exported, and run with the same prompts at the same budgets: its own floor,
and 25/50/75/100 % of the *bf16* weight bytes, so a budget at or above the quantized total is
all-resident (the row's ``all_resident``). Rows carry ``quantize``; bench/report.py bounds them
by the quantized bytes streamed and the scheme's own all-resident decode, and sets them
against bf16 at the same budget. Quality: the program's logits teacher-forced over the bf16
reference's greedy continuation of the first prompt (the prompt prefilled, then each token the
bf16 eager model chose fed by one decode step, for ``--check-tokens`` steps: every step sees
the context the reference's step saw) against the bf16 eager model's logits of those steps
(transformers ``generate``, static cache): the largest and mean |logit difference| and the
share of steps whose top-1 token agrees. The bf16 program is measured the same way beside them
(``quality`` of the result), the difference that tracing alone makes.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hostswap  # noqa: E402
import hostswap.llm as llm  # noqa: E402
from weights import environment, h2d_bandwidth, result_path  # noqa: E402

BUDGETS = (("floor", None), ("25%", 0.25), ("50%", 0.50), ("75%", 0.75), ("100%", 1.0))
SCHEMES = llm.QUANTIZATION_SCHEMES


def llama(layers: int, dtype: torch.dtype = torch.bfloat16, random_state: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(random_state)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(dtype)  # random init on the GPU: seconds, not minutes
    return model.cpu().eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mapped_h2d_bandwidth(module, device: torch.device, repeats: int = 3) -> float | None:
    """Bytes/s of copying the streamed weights straight out of the loaded ``.ptd`` mapping (the
    pages registered with the driver), weight by weight as the pool does, with nothing else
    running: what the link gives from those pages, beside the pinned-buffer figure that the
    bound uses (the two differ where, say, the page cache sits on another NUMA node)."""
    if device.type != "cuda":
        return None
    pool = module.pool
    host = [pool.host[w] for w in pool.streamed_weights()]
    if not host:
        return None
    target = torch.empty(max(t.numel() * t.element_size() for t in host), dtype=torch.uint8, device=device)
    nbytes = sum(t.numel() * t.element_size() for t in host)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for t in host:
            target[: t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)


def reference_scores(model, prompt: torch.Tensor, new_tokens: int, static_cache_len: int) -> list[torch.Tensor]:
    """The logits of each greedy step of ``model.generate`` with a static cache (untimed)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, pad_token_id=0, disable_compile=True, cache_implementation="static",
                              cache_config={"batch_size": 1, "max_cache_len": static_cache_len}, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(prompt, generation_config=config, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return [step[0].float().cpu() for step in out.logits]


def transformers_generate(model, prompt: torch.Tensor, new_tokens: int, static_cache_len: int | None = None) -> tuple[float, float, torch.Tensor]:
    """(prefill s, decode s per token, tokens) of ``model.generate`` (greedy; its default
    dynamic cache, or a static cache of ``static_cache_len`` positions as hostswap's program
    keeps): timed with one new token and with ``new_tokens``; the difference is decode."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, pad_token_id=0, disable_compile=True)
    if static_cache_len:
        config.cache_implementation = "static"
        config.cache_config = {"batch_size": 1, "max_cache_len": static_cache_len}

    def run(n):
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, generation_config=config, max_new_tokens=n, min_new_tokens=n)
        sync()
        return time.perf_counter() - t, out

    run(2)  # warm-up
    one, _ = run(1)
    full, out = run(new_tokens)
    return one, (full - one) / (new_tokens - 1), out.cpu()


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda")
        self.path = result_path(args.out, "generate", self.device, args.part)
        os.makedirs(args.out, exist_ok=True)
        self.t0 = time.perf_counter()
        self.result = {"environment": environment(self.device), "args": vars(args), "rows": [], "notes": []}

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {message}", flush=True)

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.result, f, indent=1)

    def time_left(self) -> float:
        return self.args.deadline_s - (time.perf_counter() - self.t0)

    def add(self, row: dict) -> None:
        self.result["rows"].append(row)
        self.save()
        per_token = f"{row['ms_per_token']:.2f} ms/token" if row.get("ms_per_token") else ""
        streamed = f" {row['bytes_streamed_per_token'] / 2**20:.0f} MiB/token" if row.get("bytes_streamed_per_token") else ""
        if row.get("mapped_h2d_bytes_per_s"):
            streamed += f" (mapping H2D {row['mapped_h2d_bytes_per_s'] / 1e9:.1f} GB/s)"
        config = f"{row['config']} [{row['quantize']}{', all-resident' if row['all_resident'] else ''}]" if row.get("quantize") else row["config"]
        self.log(f"{config:36s} prompt {row['prompt_tokens']:4d} {row['budget_name']:>5s}  prefill {row.get('prefill_ms', 0):7.1f} ms  {per_token}{streamed} {row.get('tokens', '')}")

    def run(self) -> None:
        a = self.args
        model = llama(a.layers, getattr(torch, a.dtype))
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.result["model"] = {"class": "LlamaForCausalLM", "layers": a.layers, "dtype": a.dtype, "weight_bytes": weight_bytes}
        self.log(f"model: {a.layers} layers, {weight_bytes / 2**30:.2f} GiB")
        pinned = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
        self.result["pinned_h2d_bytes_per_s"] = bw = h2d_bandwidth(self.device, pinned)
        del pinned
        self.log(f"pinned H2D {bw / 1e9:.1f} GB/s")
        prompts = {n: torch.randint(0, 32000, (1, n), generator=torch.Generator().manual_seed(n)) for n in a.prompts}
        max_seq_len = max(a.prompts) + a.new_tokens
        work = tempfile.mkdtemp(dir=a.workdir)
        t = time.perf_counter()
        programs, constants = llm.export_programs(copy.deepcopy(model), max_seq_len=max_seq_len, prefill_chunk=a.prefill_chunk,
                                                  progress=lambda m: self.log(f"export: {m}"))
        pte, ptd = hostswap.save(programs, os.path.join(work, "llama"), constant_methods=constants, progress=lambda m: self.log(f"export: {m}"))
        self.result["export_s"] = time.perf_counter() - t
        schedule = hostswap.schedules.load_weight_schedule(pte, "decode")
        total = schedule.total_bytes
        # transformers all-resident: the reference tokens and the bound's compute term
        resident = copy.deepcopy(model).to(self.device)
        reference, scores = {}, {}
        for n, prompt in prompts.items():
            scores[n] = reference_scores(resident, prompt.to(self.device), a.check_tokens, max_seq_len)
            for config, cache_len in (("transformers generate", None), ("transformers generate, static cache", max_seq_len)):
                prefill_s, per_token_s, tokens = transformers_generate(resident, prompt.to(self.device), a.new_tokens, cache_len)
                if cache_len:  # the same cache as the program's: the reference tokens
                    reference[n] = tokens
                self.add({"config": config, "prompt_tokens": n, "budget_name": "100%", "budget_bytes": total,
                          "prefill_ms": prefill_s * 1e3, "ms_per_token": per_token_s * 1e3, "tokens_per_s": 1 / per_token_s,
                          "new_token_ids": tokens[0, n : n + a.check_tokens].tolist()})
        del resident
        gc.collect()
        torch.cuda.empty_cache()

        budgets = [(name, schedule.floor_bytes if f is None else max(schedule.floor_bytes, int(f * total))) for name, f in BUDGETS]
        budgets[-1] = ("100%", total + 2**20)
        budgets = [b for b in budgets if b[0] in a.budgets]
        configs = [("hostswap planned, decode graphed", dict(policy="planned"))]
        if a.eager:
            configs.append(("hostswap planned, eager", dict(policy="planned", cuda_graph=False)))
        for budget_name, budget in budgets:
            for config, options in configs:
                if config.endswith("eager") and budget_name not in ("floor", "50%"):
                    continue
                for n, prompt in prompts.items():
                    if self.time_left() < a.reserve_s:
                        self.result["notes"].append(f"deadline: stopped before {config} {budget_name} prompt {n}")
                        self.save()
                        return
                    self.run_hostswap(config, options, pte, ptd, budget_name, budget, n, prompt, reference[n], scores[n])
        if a.quantize:
            import torchao

            self.result["environment"]["torchao"] = torchao.__version__
            first = min(prompts)
            self.result["quality"] = {"bf16": self.quality(pte, ptd, total + 2**20, prompts[first], scores[first])}
            self.save()
            for scheme in a.quantize:
                # an export of the quantized model takes about as long as the bf16 one did
                if self.time_left() < a.reserve_s + 1.2 * self.result["export_s"]:
                    self.result["notes"].append(f"deadline: stopped before {scheme}")
                    self.save()
                    return
                if not self.run_quantized(model, scheme, total, prompts, scores, max_seq_len, work):
                    return
        if not a.skip_accelerate:
            self.run_accelerate(model, [b for b in budgets if b[0] not in ("floor", "100%")], prompts)
        self.save()

    def quality(self, pte, ptd, budget: int, prompt: torch.Tensor, scores: list[torch.Tensor]) -> dict:
        """A program's logits against the bf16 eager model's ``scores``, teacher-forced over the
        bf16 reference's greedy continuation (the argmax of each of its steps)."""
        n = prompt.shape[1]
        continuation = [int(step.argmax()) for step in scores]
        with llm.Generator(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=self.device) as g:
            ours = [llm.prefill(g._step, prompt, g.prefill_chunks, g.max_seq_len).float().cpu()]
            for i, token in enumerate(continuation[:-1]):
                ours.append(g._step(llm.DECODE, torch.tensor([[token]], dtype=torch.long), n + i)[0, -1].float().cpu())
        ours, theirs = torch.stack(ours), torch.stack(scores)
        diff = (ours - theirs).abs()
        return {"prompt_tokens": n, "steps": len(scores), "max_abs_logit_diff": diff.max().item(), "mean_abs_logit_diff": diff.mean().item(),
                "top1_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(), "reference_max_abs_logit": theirs.abs().max().item()}

    def run_quantized(self, model, scheme: str, bf16_total: int, prompts: dict, scores: dict, max_seq_len: int, work: str) -> bool:
        """One scheme's rows; False where the deadline stopped them."""
        a = self.args
        t = time.perf_counter()
        quantized = llm.quantize(copy.deepcopy(model), scheme)
        quantize_s = time.perf_counter() - t
        say = lambda m: self.log(f"export {scheme}: {m}")  # noqa: E731
        programs, constants = llm.export_programs(quantized, max_seq_len=max_seq_len, prefill_chunk=a.prefill_chunk, progress=say)
        pte, ptd = hostswap.save(programs, os.path.join(work, f"llama_{scheme}"), constant_methods=constants, progress=say)
        del quantized, programs
        gc.collect()
        schedules = hostswap.schedules.load_weight_schedules(pte)
        floor, total = max(s.floor_bytes for s in schedules.values()), max(s.total_bytes for s in schedules.values())
        first = min(prompts)
        quality = self.quality(pte, ptd, total + 2**20, prompts[first], scores[first])
        self.result["quality"][scheme] = quality
        self.result.setdefault("quantized", {})[scheme] = {
            "quantize_s": quantize_s, "export_s": time.perf_counter() - t - quantize_s, "total_bytes": total, "floor_bytes": floor,
            "bytes_by_dtype": schedules["decode"].bytes_by_dtype()}
        self.log(f"{scheme}: {total / 2**30:.2f} GiB ({total / bf16_total:.2f} of bf16), floor {floor / 2**20:.0f} MiB; against bf16 eager over "
                 f"{quality['steps']} steps: max |logit difference| {quality['max_abs_logit_diff']:.3g}, top-1 agreement {quality['top1_agreement']:.2f}")
        self.save()
        config, options = "hostswap planned, decode graphed", dict(policy="planned")
        for budget_name, fraction in BUDGETS:
            if budget_name not in a.budgets:
                continue
            # the floor is the quantized program's; the others are shares of the bf16 weight bytes
            budget = floor if fraction is None else total + 2**20 if fraction >= 1 else max(floor, int(fraction * bf16_total))
            for n, prompt in prompts.items():
                if self.time_left() < a.reserve_s:
                    self.result["notes"].append(f"deadline: stopped before {scheme} {budget_name} prompt {n}")
                    self.save()
                    return False
                self.run_hostswap(config, options, pte, ptd, budget_name, budget, n, prompt, None, None, extra={
                    "quantize": scheme, "all_resident": budget >= total, "quantized_total_bytes": total, "quantized_floor_bytes": floor,
                    "max_abs_logit_diff_vs_bf16": quality["max_abs_logit_diff"], "top1_agreement_vs_bf16": quality["top1_agreement"]})
        return True

    def run_hostswap(self, config, options, pte, ptd, budget_name, budget, n, prompt, reference, scores, extra=None) -> None:
        """One row; tokens are checked against ``reference`` (transformers') where it is given."""
        a = self.args
        t = time.perf_counter()
        with llm.Generator(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=self.device, **options) as g:
            load_s = time.perf_counter() - t
            g.generate(prompt, 4)  # warm-up: CUDA graph capture, allocator
            out = g.generate(prompt, a.new_tokens)
            s = g.stats
            mapped = mapped_h2d_bandwidth(g.module, self.device) if s["bytes_streamed_per_token"] else None
        check = min(a.check_tokens, a.new_tokens)
        row = {"config": config, "prompt_tokens": n, "budget_name": budget_name, "budget_bytes": budget, "load_s": load_s,
               "prefill_ms": s["prefill_ms"], "ms_per_token": s["ms_per_token"], "tokens_per_s": s["tokens_per_s"],
               "bytes_streamed_per_token": s["bytes_streamed_per_token"] or 0, "kv_cache_bytes": s["kv_cache_bytes"],
               "activation_arena_bytes": s["activation_arena_bytes"], "mapped_h2d_bytes_per_s": mapped, **(extra or {})}
        if reference is None:
            self.add(dict(row, new_token_ids=out[0, n : n + check].tolist()))
            return
        mine, theirs = out[0, n : n + check].tolist(), reference[0, n : n + check].tolist()
        differ = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), None)
        margin = None
        if differ is not None and differ < len(scores):  # the reference's own preference for its token over ours
            margin = float(scores[differ][theirs[differ]] - scores[differ][mine[differ]])

        self.add(dict(row, new_token_ids=mine, checked_tokens=check, first_token_differing_from_transformers=differ,
                      reference_logit_margin_at_difference=margin,
                      tokens="same tokens" if differ is None else f"differs from token {differ} (reference margin {margin:.3g})"))

    def run_accelerate(self, model, budgets, prompts) -> None:
        try:
            from accelerate import dispatch_model, infer_auto_device_map
        except ImportError:
            self.result["notes"].append("accelerate not installed: peer not measured")
            return
        for budget_name, budget in budgets:
            if self.time_left() < self.args.reserve_s:
                self.result["notes"].append(f"deadline: stopped before accelerate {budget_name}")
                return
            m = copy.deepcopy(model)
            device_map = infer_auto_device_map(m, max_memory={0: budget, "cpu": 2**40}, no_split_module_classes=["LlamaDecoderLayer"])
            before = torch.cuda.memory_allocated()
            m = dispatch_model(m, device_map=device_map, main_device=0)
            on_gpu = torch.cuda.memory_allocated() - before
            for n, prompt in prompts.items():
                prefill_s, per_token_s, _ = transformers_generate(m, prompt.to(self.device), self.args.peer_tokens)
                self.add({"config": "accelerate dispatch_model", "prompt_tokens": n, "budget_name": budget_name, "budget_bytes": budget,
                          "weights_on_gpu_bytes": on_gpu, "prefill_ms": prefill_s * 1e3, "ms_per_token": per_token_s * 1e3,
                          "tokens_per_s": 1 / per_token_s, "bytes_streamed_per_token": self.result["model"]["weight_bytes"] - on_gpu})
            del m
            gc.collect()
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12, help="decoder layers (12: 1.25 GiB, 46: 4.1 GiB of bf16)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--budgets", type=lambda v: v.split(","), default=[name for name, _ in BUDGETS], help="of floor,25%%,50%%,75%%,100%% (default all)")
    p.add_argument("--prompts", type=lambda v: [int(x) for x in v.split(",")], default=[128, 512], help="prompt lengths (default 128,512)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--check-tokens", type=int, default=64, help="hostswap's first new tokens compared with transformers'")
    p.add_argument("--peer-tokens", type=int, default=16, help="new tokens per accelerate measurement")
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--eager", action="store_true", help="also run decode eagerly (no CUDA graph) at the floor and 50 %%")
    p.add_argument("--skip-accelerate", action="store_true")
    p.add_argument("--quantize", type=lambda v: [s for s in v.split(",") if s], default=[],
                   help="also quantize the model (torchao weight-only, of int8,int4) and run each at the same budgets (default none)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--workdir", default=tempfile.gettempdir())
    p.add_argument("--part", help="suffix of the result file (generate_<device>_<part>.json)")
    p.add_argument("--deadline-s", type=float, default=540, help="start nothing new after this many seconds")
    p.add_argument("--reserve-s", type=float, default=20)
    args = p.parse_args(argv)
    unknown = [b for b in args.budgets if b not in dict(BUDGETS)]
    if unknown:
        p.error(f"--budgets: unknown {unknown}; choose from {','.join(dict(BUDGETS))}")
    unknown = [q for q in args.quantize if q not in SCHEMES]
    if unknown:
        p.error(f"--quantize: unknown {unknown}; choose from {','.join(SCHEMES)}")
    if "int4" in args.quantize and args.dtype != "bfloat16":
        p.error("--quantize int4 takes bfloat16 weights: leave --dtype at bfloat16")
    if not torch.cuda.is_available():
        print("bench/generate.py measures on a CUDA device", file=sys.stderr)
        return 2
    Bench(args).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
