"""Training in a GPU memory cap: hostswap's offloads against plain AdamW, torchao's
CPUOffloadOptimizer and save_on_cpu, one process.

    python bench/train.py                          # 1.57 B-parameter transformers Llama, cap 12 GiB
    python bench/train.py --quick --device cpu     # smoke test anywhere (numbers mean nothing)

The model is a transformers ``LlamaForCausalLM`` (hidden 2048, 32 layers, GQA 32/8 heads,
vocabulary 32000: 1.57 B parameters), random weights from a config, trained on ``--batch`` x
``--seq`` random token ids with its own causal-LM loss. First, with the whole GPU, plain
training gives the reference. Then ``torch.cuda.set_per_process_memory_fraction`` caps the
process at ``--cap-gib`` and every configuration runs under the cap:

- plain ``torch.optim.AdamW`` (fused), with fp32 weights under bf16 autocast (fp32 master
  weights, the usual mixed-precision recipe: 16 bytes per parameter on the GPU), and in bf16;
- plain ``torch.optim.AdamW`` on fp32 master copies beside bf16 working weights, with the whole
  GPU: the arithmetic of ``OffloadAdamW(offload_master=True)`` without offload, the reference
  for its losses (the autocast rows run their forward on fp32 weights: other numbers);
- torchao's ``CPUOffloadOptimizer`` (bf16 weights on the GPU, its AdamW on the CPU);
- ``hostswap.optim.OffloadAdamW`` with bf16 state, and with ``offload_master`` (fp32 masters
  and moments on the host); with gradient accumulation;
- with it, activation offload: ``OffloadContext`` on half the layers against
  ``torch.autograd.graph.save_on_cpu`` on the same layers; gradient checkpointing alone and
  with the checkpointed residual stream offloaded.

Each row: tokens/s, the median step (``--steps`` after ``--warmup``), its forward+backward
part (CUDA events), the peak of allocated GPU memory, host memory held for the offloads,
bytes copied each way per step, the final loss, and the transfer bound = forward+backward +
the optimizer's and activations' copies over the bandwidths measured in this run (H2D,
D2H, and both at once). A configuration that fails (out of memory under the cap) is a row
with its error. Rows go to ``bench/results/train_<device>.json`` as they are measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hostswap  # noqa: E402
import hostswap.activations  # noqa: E402
import hostswap.optim  # noqa: E402
from weights import environment, result_path  # noqa: E402

LR = 1e-5


def llama(args, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.seq),
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.train()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidths(device: torch.device, nbytes: int = 1 << 30, repeats: int = 8) -> dict:
    """Pinned host<->device bytes/s: each direction alone, and both at once on two streams."""
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    streams = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(h2d: bool, d2h: bool) -> float:
        times = []
        for _ in range(repeats + 1):
            sync(device)
            t = time.perf_counter()
            if h2d:
                with torch.cuda.stream(streams[0]):
                    dev_a.copy_(host_a, non_blocking=True)
            if d2h:
                with torch.cuda.stream(streams[1]):
                    host_b.copy_(dev_b, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - t)
        return nbytes * (h2d + d2h) / statistics.median(times[1:])

    return {"h2d": timed(True, False), "d2h": timed(False, True), "both": timed(True, True)}


@dataclasses.dataclass
class Config:
    """One configuration: how the model is made, how a step runs, what moves where."""

    name: str
    dtype: torch.dtype = torch.bfloat16
    optimizer: str = "adamw"  # adamw | adamw-master (fp32 masters beside bf16 weights) | cpu-offload (torchao) | offload | offload-master (hostswap)
    autocast: bool = False
    offload_layers: int = 0
    save_on_cpu_layers: int = 0
    checkpointing: bool = False
    accumulate: int = 1
    capped: bool = True
    reload_ahead: int | str | None = None
    modules: tuple[str, ...] | None = None


MASTER_REFERENCE_ROW = "plain AdamW on fp32 masters, bf16 weights, whole GPU"


class MasterWeightAdamW:
    """``torch.optim.AdamW`` on fp32 copies of bf16 parameters, all on the device, the bf16
    working weights rounded from them after each step: the arithmetic of
    ``OffloadAdamW(offload_master=True)`` without the offload, so its losses are the like-for-like
    reference for hostswap's fp32-master rows (fp32 weights under autocast run another forward)."""

    def __init__(self, params, lr: float):
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, lr=lr, foreach=False)

    def step(self) -> None:
        for master, p in zip(self.masters, self.params):
            master.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.params):
                p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.params + self.masters:
            t.grad = None


def make_optimizer(config: Config, model):
    params = list(model.parameters())
    if config.optimizer == "adamw-master":
        return MasterWeightAdamW(params, lr=LR)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=LR, fused=model.device.type == "cuda")
    if config.optimizer == "cpu-offload":
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(params, torch.optim.AdamW, lr=LR)
    if config.optimizer in ("offload", "offload-master"):
        return hostswap.optim.OffloadAdamW(params, lr=LR, offload_master=config.optimizer == "offload-master")
    raise ValueError(config.optimizer)


def save_on_cpu_layers(layers, k: int):
    """``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the first ``k`` layers;
    returns what undoes it."""
    wrapped_layers = list(layers)[:k]
    before = [layer.__dict__.get("forward") for layer in wrapped_layers]  # an instance's own forward, if any
    for layer in wrapped_layers:
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return _forward(*args, **kwargs)

        layer.forward = wrapped

    def undo() -> None:
        for layer, forward in zip(wrapped_layers, before):
            if forward is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = forward

    return undo


def release(model, opt) -> None:
    """Free a configuration's device and host memory even where a reference cycle outlives it
    (torchao's CPUOffloadOptimizer hooks every parameter with a closure over itself, a cycle
    through C++ that the garbage collector does not break: each one kept its model alive)."""
    if model is not None:
        for t in list(model.parameters()) + list(model.buffers()):
            t.grad = None
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    if opt is not None:
        for name in ("state", "param_d2h_map", "optim_dict", "queue"):
            table = getattr(opt, name, None)  # CPUOffloadOptimizer has no state of its own
            if isinstance(table, dict):
                table.clear()


def optimizer_moves(opt) -> tuple[int, int, int]:
    """(bytes host->device, device->host) the optimizer copies per step, host bytes it holds."""
    if isinstance(opt, hostswap.optim.OffloadAdamW):
        steps = max(opt.stats["steps"], 1)
        return opt.stats["bytes_h2d"] // steps, opt.stats["bytes_d2h"] // steps, opt.host_bytes
    if type(opt).__name__ == "CPUOffloadOptimizer":  # gradients out, weights back in
        moved = sum(p.numel() * p.element_size() for p in opt.param_d2h_map.values())
        state = sum(t.numel() * t.element_size() for o in opt.optim_dict.values() for s in o.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        return moved, moved, 2 * moved + state
    return 0, 0, 0


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.t0 = time.perf_counter()
        os.makedirs(args.out, exist_ok=True)
        self.path = result_path(args.out, "train", self.device, args.part)
        self.rows: list[dict] = []
        self.result = {"environment": environment(self.device), "args": vars(args), "rows": self.rows}
        self.tokens_per_step = args.batch * args.seq

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.result, f, indent=1)
        os.replace(self.path + ".tmp", self.path)

    def cap(self, on: bool) -> None:
        if self.device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, self.args.cap_gib * 2**30 / total) if on else 1.0, self.device)

    def batches(self, n: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return [torch.randint(0, self.args.vocab, (self.args.batch, self.args.seq), generator=g).to(self.device) for _ in range(n)]

    def activation_overhead(self, batch: int) -> None:
        """What activation offload costs a forward+backward, and the peak it saves: one bf16
        model, no cap and no optimizer, the configurations' steps interleaved round by round
        with the step that offloads nothing, so that they share the machine's state."""
        a, cuda = self.args, self.device.type == "cuda"
        if time.perf_counter() - self.t0 > a.deadline_s:
            self.log(f"activation overhead at batch {batch}: skipped, past the deadline")
            return
        model = llama(a, torch.bfloat16, self.device)
        layers = model.model.layers
        n = len(layers)
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, a.vocab, (batch, a.seq), generator=g).to(self.device)
        made: dict[str, object] = {"no offload": None}
        for k in sorted({max(1, n // 8), max(1, n // 4)}):
            for ahead in ("auto", 1, None):
                name = f"OffloadContext {k}/{n} layers" + (f", reload_ahead={ahead}" if ahead is not None else "")
                made[name] = hostswap.activations.OffloadContext(model_layers=n, num_layers=k, reload_ahead=ahead, min_offload_bytes=a.min_offload_bytes)
        made[f"save_on_cpu {max(1, n // 8)}/{n} layers"] = max(1, n // 8)
        samples = {name: {"forward_backward_s": [], "first_forward_s": [], "peak_bytes": 0} for name in made}

        def steps(name: str, count: int, keep: bool) -> None:
            how = made[name]
            undo = None
            if isinstance(how, hostswap.activations.OffloadContext):
                how.attach(layers)
            elif isinstance(how, int):
                undo = save_on_cpu_layers(layers, how)
            try:
                for _ in range(count):
                    sync(self.device)
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(self.device)
                        start, forward, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                        start.record()
                    t = time.perf_counter()
                    loss = model(input_ids=ids, labels=ids).loss
                    if cuda:
                        forward.record()
                    t_forward = time.perf_counter()
                    loss.backward()
                    if cuda:
                        done.record()
                    sync(self.device)
                    t_done = time.perf_counter()
                    for p in model.parameters():
                        p.grad = None
                    if keep:
                        s = samples[name]
                        s["forward_backward_s"].append(start.elapsed_time(done) / 1e3 if cuda else t_done - t)
                        s["first_forward_s"].append(start.elapsed_time(forward) / 1e3 if cuda else t_forward - t)
                        s["peak_bytes"] = max(s["peak_bytes"], torch.cuda.max_memory_allocated(self.device)) if cuda else None
            finally:
                if isinstance(how, hostswap.activations.OffloadContext):
                    how.detach()
                elif undo is not None:
                    undo()

        try:
            for name in made:  # pinned buffers, the allocator's blocks, and 'auto''s calibration steps
                steps(name, 4, keep=False)
            for _ in range(a.overhead_rounds):
                for name in made:
                    steps(name, 3, keep=True)
        except Exception as e:  # recorded, not hidden
            self.result.setdefault("activation_overhead", []).append({"batch": batch, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"})
            self.log(f"activation overhead at batch {batch} FAILED {e}")
            return
        finally:
            release(model, None)
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        rows = []
        for name, how in made.items():
            s = samples[name]
            row = {"config": name, "forward_backward_s": statistics.median(s["forward_backward_s"]), "first_forward_s": statistics.median(s["first_forward_s"]),
                   "samples_s": s["forward_backward_s"], "peak_bytes": s["peak_bytes"]}
            if isinstance(how, hostswap.activations.OffloadContext):
                row.update(activation_offloaded_bytes=how.stats["bytes_offloaded"], activation_transfer_s=how.stats["transfer_seconds"],
                           reload_points=[list(e) for _, e in sorted(how.synchronization_dict.items())])
            rows.append(row)
            base = rows[0]["forward_backward_s"]
            self.log(f"batch {batch} {name:48s} fwd+bwd {row['forward_backward_s'] * 1e3:7.1f} ms ({row['forward_backward_s'] / base - 1:+.1%})"
                     + (f"  peak {row['peak_bytes'] / 2**30:6.2f} GiB" if row["peak_bytes"] is not None else "")
                     + (f"  reloads at bwd {[e[3] for e in row['reload_points']]}" if "reload_points" in row else ""))
        self.result.setdefault("activation_overhead", []).append({"batch": batch, "tokens_per_step": batch * a.seq, "rows": rows})
        self.save()

    def run(self, config: Config) -> dict | None:
        if self.args.only and not any(o in config.name for o in self.args.only):
            return None
        if time.perf_counter() - self.t0 > self.args.deadline_s:
            self.log(f"{config.name}: skipped, past the deadline")
            return None
        cuda = self.device.type == "cuda"
        if config.optimizer == "cpu-offload" and not cuda:
            return None
        row: dict = {"config": config.name, "capped": config.capped and cuda, "cap_bytes": int(self.args.cap_gib * 2**30) if config.capped and cuda else None,
                     "accumulate": config.accumulate, "tokens_per_step": self.tokens_per_step * config.accumulate}
        model = opt = offload = None
        try:
            self.cap(config.capped)
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            model = llama(self.args, config.dtype, self.device)
            row["parameters"] = sum(p.numel() for p in model.parameters())
            if config.checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            layers = model.model.layers
            if config.offload_layers:
                offload = hostswap.activations.OffloadContext(model_layers=len(layers), num_layers=config.offload_layers,
                                                               reload_ahead=config.reload_ahead, min_offload_bytes=self.args.min_offload_bytes,
                                                               modules=config.modules)
                offload.attach(layers)
            if config.save_on_cpu_layers:
                save_on_cpu_layers(layers, config.save_on_cpu_layers)
            opt = make_optimizer(config, model)
            batches = self.batches(config.accumulate)
            autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if config.autocast else contextlib.nullcontext()
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            backward_done = torch.cuda.Event(enable_timing=True) if cuda else None
            forward_done = torch.cuda.Event(enable_timing=True) if cuda else None
            steps, fwd_bwd, fwd, losses, activation_bytes = [], [], [], [], []
            phases: list | None = None
            profiler = None

            def phase(name: str) -> None:
                # one traced step after the timed ones: memory at the end of each phase and the
                # peak within it (resetting the peak counter, so not during the timed steps)
                if phases is not None and cuda:
                    sync(self.device)
                    phases.append((name, torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)))
                    torch.cuda.reset_peak_memory_stats(self.device)

            # reload_ahead='auto' times two steps after the first, then runs on its fitted points
            warmup = max(self.args.warmup, -(-3 // config.accumulate)) if config.reload_ahead == "auto" else self.args.warmup
            for i in range(warmup + self.args.steps + 1):
                if i == warmup and cuda:
                    sync(self.device)
                    torch.cuda.reset_peak_memory_stats(self.device)
                if i == warmup + self.args.steps:  # the traced step
                    peak = torch.cuda.max_memory_allocated(self.device) if cuda else None
                    phases = []
                    phase("before the step")
                    if self.args.profile and any(pattern in config.name for pattern in self.args.profile):
                        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
                        profiler.__enter__()
                sync(self.device)
                t = time.perf_counter()
                if start is not None:
                    start.record()
                moved = 0
                for m, ids in enumerate(batches):
                    with autocast:
                        loss = model(input_ids=ids, labels=ids).loss
                    if m == 0 and forward_done is not None:
                        forward_done.record()
                    t_fwd = time.perf_counter() if m == 0 else t_fwd
                    phase(f"forward {m}")
                    (loss / config.accumulate).backward()
                    phase(f"backward {m}")
                    moved += offload.stats["bytes_offloaded"] if offload is not None else 0
                if backward_done is not None:
                    backward_done.record()
                t_bwd = time.perf_counter()
                opt.step()
                phase("optimizer step")
                opt.zero_grad(set_to_none=True)
                sync(self.device)
                if warmup <= i < warmup + self.args.steps:
                    steps.append(time.perf_counter() - t)
                    fwd_bwd.append(start.elapsed_time(backward_done) / 1e3 if cuda else t_bwd - t)
                    fwd.append(start.elapsed_time(forward_done) / 1e3 if cuda else t_fwd - t)
                    losses.append(loss.item())
                    activation_bytes.append(moved)
            row["memory_phases"] = phases if cuda else None
            if profiler is not None:
                profiler.__exit__(None, None, None)
                table = profiler.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=25)
                by_cpu = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
                name = "".join(c if c.isalnum() else "_" for c in config.name)
                with open(os.path.join(self.args.out, f"profile_{name}.txt"), "w") as f:
                    f.write(table + "\n\n" + by_cpu)
                profiler.export_chrome_trace(os.path.join(self.args.out, f"profile_{name}.json"))
            h2d, d2h, host = optimizer_moves(opt)
            step = statistics.median(steps)
            row.update(step_s=step, forward_backward_s=statistics.median(fwd_bwd), first_forward_s=statistics.median(fwd), tokens_per_s=row["tokens_per_step"] / step,
                       peak_bytes=peak,
                       optimizer_h2d_bytes=h2d, optimizer_d2h_bytes=d2h, optimizer_host_bytes=host,
                       activation_offloaded_bytes=max(activation_bytes), activation_host_bytes=offload.stats["host_bytes"] if offload else 0,
                       loss=losses[-1], losses=losses)
            if offload is not None:
                row["activation_transfer_s"] = offload.stats["transfer_seconds"] * config.accumulate
                if config.modules:  # Megatron's choice: what each named submodule's saves cost
                    row["bytes_by_module"] = offload.stats["bytes_by_module"]
                    row["transfer_seconds_by_module"] = offload.stats["transfer_seconds_by_module"]
            if config.save_on_cpu_layers:
                row["activation_offloaded_bytes"] = None  # save_on_cpu does not report it
        except Exception as e:  # recorded in the table, not hidden
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
        finally:
            if offload is not None:
                offload.detach()
            release(model, opt)
            del model, opt, offload
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        self.rows.append(row)
        self.save()
        if "error" in row:
            self.log(f"{config.name:58s} FAILED {row['error']}")
        else:
            peak = row["peak_bytes"] / 2**30 if row["peak_bytes"] is not None else float("nan")
            if row.get("memory_phases"):
                self.log("    GiB at the end of / peak in: " + ", ".join(f"{name} {a / 2**30:.2f}/{top / 2**30:.2f}" for name, a, top in row["memory_phases"]))
            self.log(f"{config.name:58s} {row['tokens_per_s']:9.0f} tok/s  step {row['step_s'] * 1e3:7.0f} ms (fwd+bwd {row['forward_backward_s'] * 1e3:6.0f})"
                     f"  peak {peak:6.2f} GiB  host {(row['optimizer_host_bytes'] + row['activation_host_bytes']) / 2**30:6.2f} GiB  loss {row['loss']:.4f}")
        return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches of the gradient-accumulation row")
    p.add_argument("--cap-gib", type=float, default=12.0, help="the process's GPU memory cap")
    p.add_argument("--min-offload-bytes", type=int, default=2**20, help="OffloadContext keeps smaller saved tensors on the GPU")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (reload_ahead='auto' takes at least 3: it times two after the first)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="a small model (smoke test; numbers mean nothing)")
    p.add_argument("--only", type=lambda v: v.split("|"), default=[], help="run only configurations whose names contain one of these ('|' between them)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--part", help="suffix of the result file (train_<device>_<part>.json)")
    p.add_argument("--profile", type=lambda v: v.split("|"), default=[], help="profile the traced step of configurations whose names contain one of these: a table and a Chrome trace beside the results")
    p.add_argument("--deadline-s", type=float, default=540, help="start nothing new after this many seconds")
    p.add_argument("--overhead-batches", type=lambda v: [int(b) for b in v.split(",") if b], default=[1, 4],
                   help="batch sizes of the activation offload overhead part (no cap, no optimizer, steps interleaved); empty to skip it")
    p.add_argument("--overhead-rounds", type=int, default=4, help="rounds of the overhead part: each runs every configuration for 3 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab, args.seq = 4, 128, 256, 4, 2, 512, 64
        args.steps, args.warmup, args.accumulate, args.min_offload_bytes = 2, 3, 2, 1024
    b = Bench(args)
    if b.device.type == "cuda":
        b.result["bandwidth_bytes_per_s"] = bandwidths(b.device)
        b.log("pinned " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in b.result["bandwidth_bytes_per_s"].items()))
    n, k = args.layers, args.layers // 2
    fp32_master = dict(dtype=torch.float32, autocast=True)
    b.run(Config("plain AdamW, fp32 master (bf16 autocast), whole GPU", capped=False, **fp32_master))
    b.run(Config("plain AdamW, bf16, whole GPU", capped=False))
    b.run(Config("plain AdamW, fp32 master (bf16 autocast)", **fp32_master))
    b.run(Config("plain AdamW, bf16"))
    b.run(Config("torchao CPUOffloadOptimizer, bf16", optimizer="cpu-offload"))
    b.run(Config("torchao CPUOffloadOptimizer, fp32 master (bf16 autocast)", optimizer="cpu-offload", **fp32_master))
    b.run(Config("torchao CPUOffloadOptimizer, fp32 master (bf16 autocast), whole GPU", optimizer="cpu-offload", capped=False, **fp32_master))
    b.run(Config("hostswap OffloadAdamW, bf16", optimizer="offload"))
    b.run(Config(MASTER_REFERENCE_ROW, optimizer="adamw-master", capped=False))
    if b.device.type == "cuda":  # the same code again: how far a GPU's backward (atomic adds) moves the losses run to run
        b.run(Config(MASTER_REFERENCE_ROW + ", again", optimizer="adamw-master", capped=False))
    b.run(Config("hostswap OffloadAdamW, fp32 master", optimizer="offload-master"))
    b.run(Config(f"hostswap OffloadAdamW + OffloadContext {k}/{n} layers, reload_ahead=1, {args.accumulate} micro-batches", optimizer="offload-master",
                 accumulate=args.accumulate, offload_layers=k, reload_ahead=1))
    for layers in (n // 4, k):
        b.run(Config(f"hostswap OffloadAdamW + OffloadContext {layers}/{n} layers", optimizer="offload-master", offload_layers=layers))
        for ahead in (1, "auto"):
            b.run(Config(f"hostswap OffloadAdamW + OffloadContext {layers}/{n} layers, reload_ahead={ahead}", optimizer="offload-master",
                         offload_layers=layers, reload_ahead=ahead))
    b.run(Config(f"hostswap OffloadAdamW + save_on_cpu {k}/{n} layers", optimizer="offload-master", save_on_cpu_layers=k))
    for modules in (("mlp",), ("self_attn",), ("mlp.down_proj", "self_attn.o_proj")):
        b.run(Config(f"hostswap OffloadAdamW + OffloadContext {k}/{n} layers, reload_ahead=1, modules {'+'.join(modules)}", optimizer="offload-master",
                     offload_layers=k, reload_ahead=1, modules=modules))
    b.run(Config("hostswap OffloadAdamW + checkpointing", optimizer="offload-master", checkpointing=True))
    b.run(Config(f"hostswap OffloadAdamW + checkpointing + residual offload {n - 2}/{n}", optimizer="offload-master", checkpointing=True, offload_layers=n - 2))
    b.cap(False)
    for batch in args.overhead_batches:
        b.activation_overhead(batch)
    b.save()
    b.log(f"wrote {b.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
