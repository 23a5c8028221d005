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
import torch._functorch.config
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


def bandwidth(direction: str, nbytes: int = 1 << 30, repeats: int = 12) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats):
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
        from weights import result_path, source_digest

        os.makedirs(args.out, exist_ok=True)
        self.path = result_path(args.out, "activations", torch.device("cuda"), args.part)
        props = torch.cuda.get_device_properties(0)

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

    def run(self, name, reference, *, wrap=None, backend=None, theoretical=0, flags=None, deterministic=False, trace=False):
        if self.args.only and not any(o in name for o in self.args.only):
            return None
        flags = flags or {}
        trace_rows = None
        try:
            with contextlib.ExitStack() as stack:
                for key, value in flags.items():
                    stack.enter_context(torch._functorch.config.patch(**{key: value}))
                if deterministic:
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    stack.enter_context(sdpa_kernel(SDPBackend.MATH))
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
                if (trace or self.args.trace_all) and isinstance(backend, hostswap.passes.activation_offload.ActivationOffloadBackend):
                    # one more step, traced: memory at every layer boundary and the peak between them
                    for p in model.parameters():
                        p.grad = None
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()  # as before the timed steps, plus the grads kept above
                    backend.synchronizer.memory_trace = []
                    step()
                    torch.cuda.synchronize()
                    trace_rows = [(point, alloc - base, high - base) for point, alloc, high in backend.synchronizer.memory_trace]
                    trace_rows.append(("end of step", torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base))
                    backend.synchronizer.memory_trace = None
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
            row["theoretical_saving_bytes"] = sum(r["offloaded_bytes"] for r in backend.schedule.rows())
            row["synchronization_dict"] = {str(k): list(v) for k, v in backend.schedule.sync.items()}
        if trace_rows and len(trace_rows) > 1:
            # the peak of a segment is reached between the point named and the next one
            row["memory_trace"] = trace_rows
            top = max(range(len(trace_rows) - 1), key=lambda i: trace_rows[i + 1][2])
            row["peak_after_point"] = trace_rows[top][0]
            print(f"    peak {trace_rows[top + 1][2] / 2**30:.2f} GiB reached after {trace_rows[top][0]}; at points: "
                  + ", ".join(f"{pt} {a / 2**30:.2f}" for pt, a, _ in trace_rows), flush=True)
        self.rows.append(row)
        self.save()
        print(f"{name:34s} {row['step_s'] * 1e3:8.1f} ms  peak {peak / 2**30:6.2f} GiB  theory saving {row['theoretical_saving_bytes'] / 2**30:5.2f} GiB  bitwise vs {reference}: {bitwise}", flush=True)
        del model, step
        gc.collect()
        torch.cuda.empty_cache()
        return row


def mark_layers_for_torch_offload(k: int):
    """A joint-graph pass for PyTorch's activation offloading: mark the nodes of layers 0..k-1."""
    from hostswap.passes.activation_offload import LayerMap

    def mark(joint: torch.fx.GraphModule, joint_inputs):
        layer_map = LayerMap(joint.graph, None)
        for node in joint.graph.nodes:
            layer = layer_map.layer(node)
            if layer is not None and layer < k:
                node.meta["should_offload"] = True
        return joint

    return mark


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
    p.add_argument("--trace-all", action="store_true", help="one traced step after every hostswap configuration")
    p.add_argument("--sync-dict", action="append", default=[], help='JSON {layer: [offload_fwd, offload_num, reload_fwd, reload_num]}; repeatable; adds a traced hostswap row')
    p.add_argument("--only", type=lambda v: v.split(","), default=[], help="run only configurations whose names contain one of these")
    p.add_argument("--part", help="suffix of the result file, for a run split over several processes (activations_<device>_<part>.json)")
    args = p.parse_args(argv)
    b = Bench(args)
    n = args.layers
    b.result["pinned_h2d_bytes_per_s"] = bandwidth("h2d")
    b.result["pinned_d2h_bytes_per_s"] = bandwidth("d2h")
    print(f"pinned H2D {b.result['pinned_h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H {b.result['pinned_d2h_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)

    def hostswap_backend(**kw):
        return hostswap.activation_offload_backend(model_layers=n, **kw)

    b.run("no offload (hostswap k=0)", "hostswap", backend=hostswap_backend(num_layers=0), trace=True)
    b.run("no offload (hostswap k=0), again", "hostswap", backend=hostswap_backend(num_layers=0))
    per_layer = None
    for k in sorted({1, n // 4, n // 2, n - 2}):
        backend = hostswap_backend(num_layers=k)
        row = b.run(f"hostswap k={k}", "hostswap", backend=backend, trace=k == n // 2)
        if row:
            per_layer = row["theoretical_saving_bytes"] / k
            b.result.setdefault("schedules", {})[f"k={k}"] = backend.schedule.to_dict()
            b.save()
    for k in sorted({1, n // 4, n // 2, n - 2}):
        b.run(f"hostswap k={k} reload_ahead=1", "hostswap", backend=hostswap_backend(num_layers=k, reload_ahead=1), trace=k == n // 2)
    custom = {i: (True, i + 2, False, i + 1) for i in range(n // 2)}
    b.run(f"hostswap custom dict (first {n // 2}, window 2)", "hostswap", backend=hostswap_backend(synchronization_dict=custom))
    for text in args.sync_dict:  # dictionaries given on the command line, traced
        given = {int(layer): tuple(entry) for layer, entry in json.loads(text).items()}
        b.run(f"hostswap custom dict {json.dumps({str(k_): list(v) for k_, v in given.items()}, separators=(',', ':'))}", "hostswap", backend=hostswap_backend(synchronization_dict=given), trace=True)
    k = n // 2
    b.run(f"hostswap k={k} + checkpoint others", "hostswap+ckpt", backend=hostswap_backend(num_layers=k), wrap={i: "checkpoint" for i in range(k, n)})
    if n - k - 2 >= 1:
        b.run(f"hostswap k={k} reload_ahead={n - k - 2} + checkpoint others", "hostswap+ckpt", backend=hostswap_backend(num_layers=k, reload_ahead=n - k - 2),
              wrap={i: "checkpoint" for i in range(k, n)}, trace=True)
    # one layer later than the default (n-k-1): room for the weight gradients made meanwhile
    for k2 in sorted({1, n // 4, n // 2, n - 2}):
        if n - k2 - 2 >= 1:
            b.run(f"hostswap k={k2} reload_ahead={n - k2 - 2}", "hostswap", backend=hostswap_backend(num_layers=k2, reload_ahead=n - k2 - 2), trace=True)
    # bitwise: flash and memory-efficient attention backward are not run-to-run deterministic
    # even without offload, so the bitwise pair runs the math attention (matmuls and softmax)
    b.run("no offload (hostswap k=0), math attention", "math", backend=hostswap_backend(num_layers=0), deterministic=True)
    b.run("no offload (hostswap k=0), math attention, again", "math", backend=hostswap_backend(num_layers=0), deterministic=True)
    b.run(f"hostswap k={k}, math attention", "math", backend=hostswap_backend(num_layers=k), deterministic=True)
    b.run(f"hostswap k={k} reload_ahead=1, math attention", "math", backend=hostswap_backend(num_layers=k, reload_ahead=1), deterministic=True)
    b.run("no offload (eager)", "eager", backend="eager-module")
    b.run("no offload (eager), again", "eager", backend="eager-module")  # is the reference itself run-to-run bitwise?
    save = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    b.run(f"save_on_cpu(pin_memory) first {k} (eager)", "eager", backend="eager-module", wrap={i: save for i in range(k)}, theoretical=(per_layer or 0) * k)
    b.run("no offload (inductor default)", "inductor", backend=None)
    b.run("no offload (inductor default), again", "inductor", backend=None)
    # PyTorch's own pass offloads the forward nodes a joint-graph pass marks should_offload;
    # mark those of the same first k layers (it then keeps only saved, contiguous, non-view ones)
    base_flags = {"enable_activation_offloading": True, "joint_custom_pass": mark_layers_for_torch_offload(k)}
    variants = {"sync": {}, "separate stream": {"activation_offload_separate_stream": True},
                "separate stream + sink wait + prefetch": {"activation_offload_separate_stream": True, "activation_offload_sink_wait": True, "activation_reload_prefetch": True}}
    for label, extra in variants.items():
        flags = {**base_flags, **extra}
        name = f"PyTorch AOT activation offloading first {k} ({label})"
        missing = [f for f in flags if not hasattr(torch._functorch.config, f)]
        if missing:
            if not b.args.only or any(o in name for o in b.args.only):
                b.rows.append({"config": name, "error": f"torch {torch.__version__} has no torch._functorch.config.{'/'.join(missing)}"})
            continue
        b.run(name, "inductor", backend=None, flags=flags, theoretical=(per_layer or 0) * k)
    # measured again at the end: the transfer-bound uses the mean, and the spread is reported
    b.result["pinned_h2d_bytes_per_s_end"] = bandwidth("h2d")
    b.result["pinned_d2h_bytes_per_s_end"] = bandwidth("d2h")
    print(f"at the end: pinned H2D {b.result['pinned_h2d_bytes_per_s_end'] / 1e9:.1f} GB/s, D2H {b.result['pinned_d2h_bytes_per_s_end'] / 1e9:.1f} GB/s", flush=True)
    b.save()
    print(f"wrote {b.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
