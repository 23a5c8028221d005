"""Activation-offload benchmark: hostswap against no offload, save_on_cpu and PyTorch's own pass.

A training step of a stack of Llama-style decoder blocks (RMSNorm, rotary attention through
scaled_dot_product_attention, SwiGLU), bf16, random data from a fixed seed. Every
configuration runs in this one process; the JSON goes to --out.

    python bench/activations.py --layers 8 --hidden 2048 --seq 2048 --batch 4
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hostswap  # noqa: E402
from hostswap.models import DecoderBlock, _rotary_tables  # noqa: E402


class Blocks(nn.Module):
    """The benchmark's model: decoder blocks on hidden states; per-layer wrappers for peers."""

    def __init__(self, layers: int, hidden: int, heads: int, intermediate: int, seq: int):
        super().__init__()
        self.layers = nn.ModuleList(DecoderBlock(hidden, heads, intermediate, llama=True) for _ in range(layers))
        cos, sin = _rotary_tables(seq, hidden // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.wrap = {}  # layer index -> context manager factory (save_on_cpu) or "checkpoint"

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            how = self.wrap.get(i)
            if how == "checkpoint":
                x = torch.utils.checkpoint.checkpoint(layer, x, self.cos, self.sin, use_reentrant=False)
            elif how is not None:
                with how():
                    x = layer(x, self.cos, self.sin)
            else:
                x = layer(x, self.cos, self.sin)
        return x


def bandwidth(direction: str, nbytes: int = 1 << 30) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        (dev.copy_(host, non_blocking=True) if direction == "h2d" else host.copy_(dev, non_blocking=True))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:])


class Bench:
    def __init__(self, args):
        self.args = args
        torch.manual_seed(0)
        self.model = Blocks(args.layers, args.hidden, args.heads, args.intermediate, args.seq).to(torch.bfloat16).cuda()
        g = torch.Generator("cuda").manual_seed(1)
        self.x = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        self.rows, self.references = [], {}
        stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
        os.makedirs(args.out, exist_ok=True)
        self.path = os.path.join(args.out, f"activations_{stamp}.json")
        props = torch.cuda.get_device_properties(0)
        from weights import source_digest

        self.result = {"environment": {"gpu": props.name, "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "source_sha256": source_digest()},
                       "args": vars(args), "rows": self.rows}

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.result, f, indent=1)

    def step_fn(self, wrap=None, backend=None, functorch_flags=None):
        model = copy.deepcopy(self.model)
        model.wrap = wrap or {}
        torch._dynamo.reset()
        if backend == "eager-module":
            fn = model
        elif backend is None:
            fn = torch.compile(model)
        else:
            fn = torch.compile(model, backend=backend)
        x = self.x.clone().requires_grad_(False)

        def step():
            loss = fn(x).float().pow(2).mean()
            loss.backward()
            return loss

        return model, step

    def run(self, name, reference, *, wrap=None, backend=None, theoretical=0, flags=None):
        flags = flags or {}
        try:
            with contextlib.ExitStack() as stack:
                for key, value in flags.items():
                    stack.enter_context(torch._functorch.config.patch(**{key: value}))
                model, step = self.step_fn(wrap, backend)
                for _ in range(self.args.warmup):
                    step()
                    for p in model.parameters():
                        p.grad = None
                torch.cuda.synchronize()
                gc.collect()
                torch.cuda.empty_cache()
                start = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(self.args.steps):
                    for p in model.parameters():
                        p.grad = None
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    loss = step()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                peak = torch.cuda.max_memory_allocated() - start
                grads = [p.grad.detach().clone() for p in model.parameters()]
        except Exception as e:  # recorded in the table, not hidden
            row = {"config": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:34s} FAILED {row['error']}", flush=True)
            self.rows.append(row)
            self.save()
            return None
        if reference not in self.references:
            self.references[reference] = (loss.detach().clone(), grads)
            bitwise = None
        else:
            ref_loss, ref_grads = self.references[reference]
            bitwise = bool(torch.equal(ref_loss, loss.detach()) and all(torch.equal(a, b) for a, b in zip(ref_grads, grads)))
        row = {"config": name, "step_s": statistics.median(times), "step_p90_s": sorted(times)[int(0.9 * (len(times) - 1))], "peak_bytes": peak,
               "theoretical_saving_bytes": theoretical, "bitwise_vs": reference, "bitwise": bitwise}
        if isinstance(backend, hostswap.passes.activation_offload.ActivationOffloadBackend):
            row["offloaded_bytes"] = backend.synchronizer.bytes_offloaded
            row["max_offloaded_layers_on_gpu"] = backend.synchronizer.max_offloaded_layers_on_gpu
        self.rows.append(row)
        self.save()
        print(f"{name:34s} {row['step_s'] * 1e3:8.1f} ms  peak {peak / 2**30:6.2f} GiB  theory saving {theoretical / 2**30:5.2f} GiB  bitwise vs {reference}: {bitwise}", flush=True)
        del model, step
        gc.collect()
        torch.cuda.empty_cache()
        return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    b = Bench(args)
    n = args.layers
    b.result["pinned_h2d_bytes_per_s"] = bandwidth("h2d")
    b.result["pinned_d2h_bytes_per_s"] = bandwidth("d2h")
    print(f"pinned H2D {b.result['pinned_h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H {b.result['pinned_d2h_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)

    def hostswap_backend(**kw):
        return hostswap.activation_offload_backend(model_layers=n, **kw)

    zero = hostswap_backend(num_layers=0)
    b.run("no offload (hostswap k=0)", "hostswap", backend=zero)
    b.run("no offload (hostswap k=0), again", "hostswap", backend=hostswap_backend(num_layers=0))
    per_layer = None
    for k in sorted({1, n // 4, n // 2, n - 2}):
        backend = hostswap_backend(num_layers=k)
        row = b.run(f"hostswap k={k}", "hostswap", backend=backend, theoretical=0)
        if row:
            row["theoretical_saving_bytes"] = sum(r["offloaded_bytes"] for r in backend.schedule.rows())
            per_layer = row["theoretical_saving_bytes"] / k
            b.result.setdefault("schedules", {})[f"k={k}"] = backend.schedule.to_dict()
            b.save()
    custom = {i: (True, i + 2, False, i + 1) for i in range(n // 2)}
    backend = hostswap_backend(synchronization_dict=custom)
    row = b.run(f"hostswap custom dict (first {n // 2}, window 2)", "hostswap", backend=backend)
    if row:
        row["theoretical_saving_bytes"] = sum(r["offloaded_bytes"] for r in backend.schedule.rows())
        row["synchronization_dict"] = {str(k): list(v) for k, v in custom.items()}
    k = n // 2
    both = hostswap_backend(num_layers=k)
    row = b.run(f"hostswap k={k} + checkpoint others", "hostswap+ckpt", backend=both, wrap={i: "checkpoint" for i in range(k, n)})
    if row:
        row["theoretical_saving_bytes"] = sum(r["offloaded_bytes"] for r in both.schedule.rows())
    b.run("no offload (eager)", "eager", backend="eager-module")
    b.run("no offload (eager), again", "eager", backend="eager-module")  # is the reference itself run-to-run bitwise?
    save = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    b.run(f"save_on_cpu(pin_memory) first {k} (eager)", "eager", backend="eager-module", wrap={i: save for i in range(k)}, theoretical=(per_layer or 0) * k)
    b.run("no offload (inductor default)", "inductor", backend=None)
    b.run("no offload (inductor default), again", "inductor", backend=None)
    flags = {"enable_activation_offloading": True, "activation_offload_separate_stream": True}
    if all(hasattr(torch._functorch.config, f) for f in flags):
        b.run("PyTorch AOT activation offloading", "inductor", backend=None, flags=flags)
    else:
        b.rows.append({"config": "PyTorch AOT activation offloading", "error": f"torch {torch.__version__} has no torch._functorch.config.{'/'.join(flags)}"})
    b.save()
    print(f"wrote {b.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
