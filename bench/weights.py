"""Weight-streaming benchmark: hostswap against all-resident, the PCIe bound and accelerate.

One process, one run: a transformers ``LlamaForCausalLM`` (GQA, bf16, random weights from a
config; ``--model own`` takes the project's Llama-style decoder instead) is exported,
passed and saved once per workload (decode: batch 1, one token; prefill: batch 1, N
tokens), then every configuration is loaded and timed in turn. Each configuration's row
goes into one JSON file under --out as soon as it is measured, so a run cut short still
leaves its numbers. bench/report.py turns the JSON into docs/benchmarks.md's tables and plot.

    python bench/weights.py --layers 12 --out bench/results           # GPU machine
    python bench/weights.py --quick --device cpu --out /tmp/bench      # smoke test anywhere

``--quantize int8,int4``: after the bf16 rows, for each scheme a deepcopy of the same bf16
model is quantized with ``hostswap.llm.quantize`` (torchao weight-only; int4 needs CUDA),
exported per workload and run at the quantized program's floor and at 25/50/75 % of the
*bf16* weight bytes (all-resident where the quantized total fits), in the configurations
``--quantized-configs`` names. Rows carry ``quantize``; their bound is the quantized bytes
streamed over the pinned bandwidth or the scheme's own all-resident latency, and their
quality is the logits against plain PyTorch's bf16 ones: max difference and the share of
positions whose top-1 token agrees (prefill: every position of the fixed prompt).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import re
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hostswap  # noqa: E402
from procfs import drop_page_cache  # noqa: E402
from hostswap.llm import QUANTIZATION_SCHEMES  # noqa: E402
from hostswap.models import DecoderBlock, llama_decoder  # noqa: E402
from hostswap.runtime import Module  # noqa: E402
from hostswap.schedules import load_weight_schedule  # noqa: E402
from hostswap.schedules.policies import mb_ceil  # noqa: E402

DEPTHS = (0, 1, 2, 4)
BUDGET_FRACTIONS = (0.25, 0.5, 0.75)


class LogitsOnly(torch.nn.Module):
    """A transformers causal LM returning its logits alone, as every configuration compares them."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def hf_llama(layers: int, hidden: int = 2048, intermediate: int = 5632, vocab: int = 32000, heads: int = 32, kv_heads: int = 8, max_seq: int = 4096, random_state: int = 0) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with grouped-query attention in bf16, random weights from ``random_state``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_seq, use_cache=False,
    )
    torch.manual_seed(random_state)
    return LogitsOnly(LlamaForCausalLM(config).to(torch.bfloat16)).eval()


# Decoder layer class of each benchmark model, for accelerate's device map.
LAYER_CLASS = {"hf-llama": "LlamaDecoderLayer", "own": DecoderBlock.__name__}


# --- measurement helpers ---------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_snapshot() -> tuple[float, float, float, float] | None:
    """(wall s, busy CPU s of all processes, steal s, this process's CPU s) from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    own = os.times()
    return time.perf_counter(), (user + nice + system + irq + softirq) / hz, steal / hz, own.user + own.system


def host_load(before, after) -> dict:
    """How busy the host's other processes kept its cores (and the hypervisor's steal) between
    two _cpu_snapshot()s, in cores: a row timed on a disturbed host shows it here."""
    if before is None or after is None or after[0] <= before[0]:
        return {}
    wall = after[0] - before[0]
    return {"host_other_cpu_cores": max(0.0, (after[1] - before[1]) - (after[3] - before[3])) / wall,
            "host_steal_cores": (after[2] - before[2]) / wall}


class _GcPauses:
    """Python garbage collections (count, seconds, of them the full ones) while it is open."""

    def __init__(self):
        self.count = self.full = 0
        self.seconds = 0.0
        self._t = None

    def _callback(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self.count += 1
            self.full += info.get("generation") == 2
            self._t = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


def time_calls(fn, device, runs: int, warmup: int):
    """Median and spread of ``fn()`` wall time, each call synchronized; returns the last output.
    Also how busy the rest of the host was meanwhile (on Linux) and the Python garbage
    collections during the timed calls."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync(device)
    snap = _cpu_snapshot()
    times = []
    with _GcPauses() as gcp:
        for _ in range(runs):
            t = time.perf_counter()
            out = fn()
            sync(device)
            times.append(time.perf_counter() - t)
    times.sort()
    return {
        "latency_s": statistics.median(times),
        "latency_p10_s": times[len(times) // 10],
        "latency_p90_s": times[(len(times) * 9) // 10 - (1 if len(times) % 10 == 0 else 0)],
        "runs": runs,
        **host_load(snap, _cpu_snapshot()),
        "gc_collections": gcp.count, "gc_full_collections": gcp.full, "gc_seconds": gcp.seconds,
    }, out


def host_and_latency(fn) -> tuple[float, float]:
    """One CUDA call of ``fn()`` from an idle GPU: (seconds until it returns on the host,
    seconds until the GPU has finished it). For bench/eager_overlap.py and ab_host_calls.py."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t0


def h2d_bandwidth(device: torch.device, source: torch.Tensor, repeats: int = 10) -> float:
    """Median bytes/s of copying ``source`` (host) to ``device`` with a non-blocking copy."""
    dst = torch.empty(source.shape, dtype=source.dtype, device=device)
    times = []
    for _ in range(repeats + 2):
        sync(device)
        t = time.perf_counter()
        dst.copy_(source, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t)
    return source.numel() * source.element_size() / statistics.median(times[2:])


def host_memory() -> dict:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key.lower() + "_bytes"] = int(rest.split()[0]) * 1024
    return fields


def compare(out: torch.Tensor, reference: torch.Tensor) -> dict:
    a, b = out.float().cpu(), reference.float().cpu()
    return {
        "max_abs_diff_vs_plain": (a - b).abs().max().item(),
        "rel_err_vs_plain": ((a - b).norm() / b.norm()).item(),
        # logits: the share of positions whose most likely token is plain PyTorch's
        "top1_agreement_vs_plain": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }


def source_digest() -> str:
    import hashlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "results", "build"))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def environment(device: torch.device) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "device": str(device),
    }
    try:
        env["hostswap_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        pass
    # A copy of the tree may carry a stale .git (the GPU machine's does): the hash of the
    # sources identifies the code that ran; `git ls-files -s` hashes locate the commit.
    env["source_sha256"] = source_digest()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    for package in ("accelerate", "transformers"):
        try:
            env[package] = __import__(package).__version__
        except ImportError:
            env[package] = None
    return env


def device_slug(device: torch.device) -> str:
    """A short lower-case name of the device, for result file names ("h100", "cpu")."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    found = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name)
    return (found.group(1) if found else re.sub(r"\W+", "-", name)).lower()


def result_path(out: str, benchmark: str, device: torch.device, part: str | None = None) -> str:
    """``out/<benchmark>_<device>[_<part>].json``: one file per benchmark and device (and part,
    for a run split over several processes with --only)."""
    return os.path.join(out, f"{benchmark}_{device_slug(device)}{'_' + part if part else ''}.json")


def save_result(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def add_row(result: dict, row: dict, path: str, shown: dict | None = None) -> None:
    """Append ``row`` to ``result["rows"]``, print it (or ``shown``, a shorter form) as a JSON
    line, and write the result: a run cut short keeps every row it measured."""
    result["rows"].append(row)
    print(json.dumps(row if shown is None else shown), flush=True)
    save_result(result, path)


def best_seconds(fn, repeat: int) -> float:
    """The least wall time of ``repeat`` calls of ``fn()`` (host work: nothing to synchronize)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# --- the run ------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.t0 = time.perf_counter()
        os.makedirs(args.out, exist_ok=True)
        os.makedirs(args.workdir, exist_ok=True)
        self.path = result_path(args.out, "weights", self.device, args.part)
        self.result = {"environment": environment(self.device), "args": vars(args), "rows": [], "load": [], "notes": []}

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)

    def time_left(self) -> float:
        return self.args.deadline_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.result, f, indent=1)
        os.replace(self.path + ".tmp", self.path)

    def add_row(self, row: dict) -> None:
        self.result["rows"].append(row)
        self.save()
        lat = row.get("latency_s")
        if "error" in row:
            self.log(f"{row['workload']:7s} {row['config']:22s} {row['budget_name']:>6s} FAILED {row['error']}")
            return
        extra = f" bound {row['bound_s'] * 1e3:.2f} ms ratio {row['latency_s'] / row['bound_s']:.3f}" if row.get("bound_s") else ""
        if "host_other_cpu_cores" in row:
            extra += f" (host: others {row['host_other_cpu_cores']:.2f} cores, steal {row['host_steal_cores']:.2f})"
        if row.get("gc_collections"):
            extra += f" gc {row['gc_collections']} ({row['gc_full_collections']} full) {row['gc_seconds'] * 1e3:.1f} ms"
        config = f"{row['config']} [{row['quantize']}]" if row.get("quantize") else row["config"]
        self.log(f"{row['workload']:7s} {config:22s} {row['budget_name']:>6s} "
                 f"{'' if lat is None else f'{lat * 1e3:9.2f} ms'} H2D/fwd {row.get('bytes_h2d_per_forward', 0) / 2**20:9.1f} MB{extra}")

    # --- model and programs
    def export_programs(self, model: torch.nn.Module, name: str) -> dict[str, tuple[str, str]]:
        """{workload: (.pte, .ptd)} of ``model``: exported, passed and saved once per workload
        (a .ptd records the .pte saved with it, so each workload has its own pair)."""
        programs = {}
        for workload, tokens in self.inputs.items():
            t = time.perf_counter()
            with torch.no_grad():
                ep = hostswap.apply_weight_offload(torch.export.export(model, (tokens,), strict=False))
            programs[workload] = hostswap.save(ep, os.path.join(self.args.workdir, f"{name}_{workload}"))
            self.log(f"{name} {workload}: exported, passed and lowered in {time.perf_counter() - t:.1f} s -> {programs[workload][0]}")
        return programs

    def build(self):
        a = self.args
        small = dict(hidden=256, intermediate=688, vocab=2048, heads=4) if a.quick else {}
        if a.model == "hf-llama":
            self.model = hf_llama(a.layers, max_seq=max(a.prefill_tokens, 2048), **small, **({"kv_heads": 2} if a.quick else {}))
            vocab = self.model.model.config.vocab_size
        else:
            self.model = llama_decoder(a.layers, random_state=0, max_seq=max(a.prefill_tokens, 2048), **small)
            vocab = self.model.embed.num_embeddings
        gen = torch.Generator().manual_seed(1)
        self.inputs = {
            "decode": torch.randint(0, vocab, (1, 1), generator=gen),
            "prefill": torch.randint(0, vocab, (1, a.prefill_tokens), generator=gen),
        }
        self.inputs = {w: t for w, t in self.inputs.items() if w in a.workloads}
        self.variants = {None: self.export_programs(self.model, f"{a.model}{a.layers}")}
        first_pte, self.ptd = next(iter(self.variants[None].values()))
        self.schedule = load_weight_schedule(first_pte)
        self.total_bytes = self.schedule.total_bytes
        self.result["model"] = {
            "name": a.model,
            "class": type(getattr(self.model, "model", self.model)).__name__,
            "layers": a.layers,
            "weight_bytes": self.total_bytes,
            "num_weights": len(self.schedule.fqns),
            "num_kernels": self.schedule.num_kernels,
            "prefill_tokens": a.prefill_tokens,
            "ptd_bytes": os.path.getsize(self.ptd),
            "floor_bytes_by_depth": {d: self._floor(d) for d in DEPTHS},
        }
        self.save()

    def _floor(self, depth: int) -> int:
        import dataclasses

        return dataclasses.replace(self.schedule, prefetch_depth=depth).floor_bytes

    def budgets(self) -> list[tuple[str, int]]:
        floor = mb_ceil(max(self._floor(d) for d in DEPTHS)) * 2**20
        out = [("floor", floor)]
        for f in BUDGET_FRACTIONS:
            out.append((f"{round(f * 100)}%", max(floor, int(f * self.total_bytes))))
        out.append(("100%", mb_ceil(self.total_bytes) * 2**20 + 2**20))
        return out

    # --- bandwidth
    def measure_bandwidth(self) -> None:
        if self.device.type != "cuda":
            self.result["pinned_h2d_bytes_per_s"] = None
            return
        nbytes = 1 << 30 if not self.args.quick else 64 << 20
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.fill_(1)
        self.pinned_bw = h2d_bandwidth(self.device, pinned)
        pageable = torch.ones(nbytes, dtype=torch.uint8)
        self.result["pinned_h2d_bytes_per_s"] = self.pinned_bw
        self.result["pageable_h2d_bytes_per_s"] = h2d_bandwidth(self.device, pageable, repeats=5)
        del pinned, pageable
        self.log(f"pinned H2D {self.pinned_bw / 1e9:.1f} GB/s, pageable {self.result['pageable_h2d_bytes_per_s'] / 1e9:.1f} GB/s")

    def registered_bandwidth(self, m: Module) -> None:
        """Bandwidth from the registered .ptd mapping itself (the largest weight ``m`` streams:
        only streamed weights are registered), once, from the first configuration that streams."""
        streamed = list(m.pool.streamed_weights())
        if self.device.type != "cuda" or "registered_h2d_bytes_per_s" in self.result or not streamed:
            return
        largest = max(streamed, key=lambda w: m.schedule.weight_bytes[w])
        host = m.ptd.host_tensor(m.schedule.fqns[largest])
        self.result["registered_h2d_bytes_per_s"] = h2d_bandwidth(self.device, host)
        self.log(f"registered .ptd H2D {self.result['registered_h2d_bytes_per_s'] / 1e9:.1f} GB/s")

    def bound(self, workload: str, streamed: int, quantize: str | None = None, cuda_graph: bool = False) -> float | None:
        """max(the all-resident forward, streamed bytes / pinned bandwidth). The all-resident
        forward runs the same way as the row: plain PyTorch for eager rows, hostswap's graphed
        all-resident forward for graphed rows (plain PyTorch launches every kernel from the
        host, which a graph does not: it would bound a graph by launch time), the quantized
        program's own graphed all-resident forward for quantized rows."""
        if quantize is not None:
            resident = self.quantized_resident_latency.get((quantize, workload))
        elif cuda_graph:
            resident = self.graph_resident_latency.get(workload)
        else:
            resident = self.resident_latency.get(workload)
        if resident is None or not getattr(self, "pinned_bw", None):
            return None
        return max(resident, streamed / self.pinned_bw)

    # --- plain PyTorch
    def run_plain(self) -> None:
        self.reference, self.resident_latency, self.hostswap_resident_out, self.quantized_resident_latency = {}, {}, {}, {}
        self.graph_resident_latency = {}
        for workload, tokens in self.inputs.items():
            x = tokens.to(self.device)
            # exported on the device: .to() after export would leave lifted constants behind
            on_device = copy.deepcopy(self.model).to(self.device)
            with torch.no_grad():
                module = torch.export.export(on_device, (x,), strict=False).module()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                before = torch.cuda.memory_allocated(self.device)
            with torch.no_grad():
                timing, out = time_calls(lambda: module(x), self.device, self.args.runs, self.args.warmup)
            row = {"workload": workload, "config": "plain PyTorch", "policy": None, "budget_name": "100%", "budget_bytes": self.total_bytes, **timing, "bytes_h2d_per_forward": 0, "peak_weight_bytes": self.total_bytes}
            if self.device.type == "cuda":
                row["activation_peak_bytes"] = torch.cuda.max_memory_allocated(self.device) - before
            self.reference[workload] = out.float().cpu()
            self.resident_latency[workload] = timing["latency_s"]
            self.add_row(row)
            del module, on_device, out
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    # --- hostswap
    def run_hostswap(self, workload: str, budget_name: str, budget: int, config: str, policy: str, depth: int, cuda_graph: bool = False, warm_pool: bool = True,
                     quantize: str | None = None) -> dict | None:
        if self.args.only and not any(o in config for o in self.args.only) and quantize is None:
            return None
        try:
            return self._run_hostswap(workload, budget_name, budget, config, policy, depth, cuda_graph, warm_pool, quantize)
        except Exception as e:  # recorded, not hidden: the table shows the failure
            self.add_row({"workload": workload, "config": config, "policy": policy, "prefetch_depth": depth, "cuda_graph": cuda_graph,
                          "budget_name": budget_name, "budget_bytes": budget, "error": f"{type(e).__name__}: {e}",
                          **({"quantize": quantize} if quantize else {})})
            gc.collect()
            return None

    def _run_hostswap(self, workload, budget_name, budget, config, policy, depth, cuda_graph, warm_pool, quantize=None) -> dict:
        x = self.inputs[workload].to(self.device)
        pte, ptd = self.variants[quantize][workload]
        m = Module(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=self.device, policy=policy, prefetch_depth=depth, cuda_graph=cuda_graph, warm_pool=warm_pool)
        if quantize is None:
            self.registered_bandwidth(m)
        try:
            for _ in range(self.args.warmup):
                m(x)
            sync(self.device)
            before = dict(m.stats)
            timing, out = time_calls(lambda: m(x), self.device, self.args.runs, 0)
            after = m.stats
            runs = timing["runs"]
            if cuda_graph:  # replays do not pass through the pool's bookkeeping
                streamed = m.pool.layout.streamed_bytes
            else:
                streamed = (after["bytes_h2d"] - before["bytes_h2d"]) // runs
            row = {
                "workload": workload, "config": config, "policy": policy, "prefetch_depth": depth, "cuda_graph": cuda_graph, "warm_pool": warm_pool,
                "budget_name": budget_name, "budget_bytes": budget, "floor_bytes": m.schedule.floor_bytes,
                **timing,
                "bytes_h2d_per_forward": streamed,
                "achieved_h2d_bytes_per_s": streamed / timing["latency_s"] if streamed else None,
                "stall_s_per_forward": (after["stall_seconds"] - before["stall_seconds"]) / runs,
                "peak_weight_bytes": after["peak_weight_bytes"],
                "activation_arena_bytes": after["activation_arena_bytes"],
                "load_s": m.load_seconds,
                "allocations_per_forward": (after["allocations"] - before["allocations"]) / runs,
                "fragmentation_evictions_per_forward": (after["fragmentation_evictions"] - before["fragmentation_evictions"]) / runs,
                "pool_trims_per_forward": (after["pool_trims"] - before["pool_trims"]) / runs,
                "allocation_s_per_call": ((after["allocation_seconds"] - before["allocation_seconds"]) / (after["allocations"] - before["allocations"])) if after["allocations"] > before["allocations"] else None,
                **compare(out, self.reference[workload]),
            }
            if policy == "planned":
                row["planned_resident_bytes"] = m.pool.layout.resident_bytes
                row["planned_ring_bytes"] = m.pool.layout.ring_bytes
            if quantize is not None:
                total = m.schedule.total_bytes
                row.update(quantize=quantize, quantized_total_bytes=total, all_resident=streamed == 0)
                if streamed == 0:  # the scheme's own all-resident forward bounds its streamed ones
                    self.quantized_resident_latency.setdefault((quantize, workload), timing["latency_s"])
            elif cuda_graph and streamed == 0:  # bounds this workload's graphed streamed rows
                self.graph_resident_latency.setdefault(workload, timing["latency_s"])
            resident = self.hostswap_resident_out.get((quantize, workload))
            if resident is None:
                self.hostswap_resident_out[(quantize, workload)] = out.float().cpu().clone()
            else:
                row["bitwise_vs_hostswap_resident"] = bool(torch.equal(out.float().cpu(), resident))
            row["bound_s"] = self.bound(workload, streamed, quantize, cuda_graph)
            row["bound_resident"] = "quantized graphed" if quantize else "hostswap graphed" if cuda_graph else "plain PyTorch"
            # what handing the caller its own outputs costs: one device copy of each (included
            # in latency_s), timed alone
            copy_timing, _ = time_calls(lambda: out.clone(), self.device, 10, 2)
            row["output_copy_s"] = copy_timing["latency_s"]
            row["output_bytes"] = out.numel() * out.element_size()
            self.add_row(row)
            return row
        finally:
            m.close()
            del m
            gc.collect()

    def hostswap_configs(self) -> list[tuple[str, str, int, bool]]:
        configs = [(f"planned d{d}", "planned", d, False) for d in DEPTHS]
        configs += [(f"lru d{d}", "lru", d, False) for d in DEPTHS]
        if self.device.type == "cuda":
            configs.append(("planned d1 cuda_graph", "planned", 1, True))
        return configs

    def run_hostswap_all(self, budgets: bool = True) -> None:
        for workload in self.inputs:
            # all-resident first: its output is the bitwise reference for every budget
            budget_name, budget = self.budgets()[-1]
            self.run_hostswap(workload, budget_name, budget, "hostswap all-resident", "planned", 1)
            if self.device.type == "cuda":
                self.run_hostswap(workload, budget_name, budget, "planned d1 cuda_graph", "planned", 1, cuda_graph=True)
            self.run_hostswap(workload, budget_name, budget, "lru d1", "lru", 1)
        if not budgets:
            return
        for workload in self.inputs:
            for budget_name, budget in self.budgets()[:-1]:
                for config, policy, depth, graph in self.hostswap_configs():
                    if self.time_left() < self.args.reserve_s:
                        self.result["notes"].append(f"stopped before {workload} {config} {budget_name}: deadline")
                        self.log(self.result["notes"][-1])
                        return
                    self.run_hostswap(workload, budget_name, budget, config, policy, depth, cuda_graph=graph)
        # what one allocation costs in steady state, warmed or not
        floor_name, floor = self.budgets()[0]
        if "decode" in self.inputs:
            self.run_hostswap("decode", floor_name, floor, "lru d1 unwarmed", "lru", 1, warm_pool=False)

    # --- quantized weights
    def quantized_configs(self) -> list[tuple[str, str, int, bool]]:
        """The configurations --quantized-configs names; an unknown name is refused."""
        known = self.hostswap_configs() + [("hostswap all-resident", "planned", 1, False)]
        configs = [c for c in known if c[0] in self.args.quantized_configs]
        if len(configs) != len(set(self.args.quantized_configs)):
            raise SystemExit(f"--quantized-configs {self.args.quantized_configs}: choose from {[c[0] for c in known]}")
        return configs

    def run_quantized(self, scheme: str) -> None:
        """The same model quantized with ``scheme``, at the quantized floor and the shares of the
        bf16 bytes; each configuration of --quantized-configs, all-resident first."""
        from hostswap import llm

        t = time.perf_counter()
        quantized = llm.quantize(copy.deepcopy(self.model), scheme)
        hostswap.prepare_quantized(quantized)
        quantize_s = time.perf_counter() - t
        self.variants[scheme] = self.export_programs(quantized, f"{self.args.model}{self.args.layers}_{scheme}")
        del quantized
        gc.collect()
        schedule = load_weight_schedule(next(iter(self.variants[scheme].values()))[0])
        floor = mb_ceil(schedule.floor_bytes) * 2**20
        total = schedule.total_bytes
        self.result.setdefault("quantized", {})[scheme] = {"total_bytes": total, "floor_bytes": schedule.floor_bytes, "quantize_s": quantize_s,
                                                          "bytes_by_dtype": schedule.bytes_by_dtype()}
        self.save()
        self.log(f"{scheme}: {total / 2**30:.2f} GiB ({total / self.total_bytes:.2f} of bf16), floor {schedule.floor_bytes / 2**20:.0f} MiB")
        budgets = [("100%", mb_ceil(total) * 2**20 + 2**20), ("floor", floor)]
        budgets += [(f"{round(f * 100)}%", max(floor, int(f * self.total_bytes))) for f in BUDGET_FRACTIONS]
        for workload in self.inputs:
            for budget_name, budget in budgets:
                for config, policy, depth, graph in self.quantized_configs():
                    if self.time_left() < self.args.reserve_s:
                        self.result["notes"].append(f"stopped before {scheme} {workload} {config} {budget_name}: deadline")
                        self.log(self.result["notes"][-1])
                        return
                    if config == "hostswap all-resident" and budget_name != "100%":
                        continue
                    self.run_hostswap(workload, budget_name, budget, config, policy, depth, cuda_graph=graph, quantize=scheme)

    # --- accelerate
    def run_accelerate(self) -> None:
        try:
            from accelerate import cpu_offload, dispatch_model, infer_auto_device_map
            from accelerate.hooks import remove_hook_from_submodules
        except ImportError:
            self.result["notes"].append("accelerate not installed: peer not measured")
            return
        if self.device.type != "cuda":
            self.result["notes"].append("accelerate needs CUDA here: peer not measured")
            return
        gpu = self.device.index or 0
        cases = [(name, budget) for name, budget in self.budgets()[:-1]] + [("cpu_offload", None)]
        streamed_all = False  # a budget no module fits already ran cpu_offload
        for budget_name, budget in cases:
            if budget is None and streamed_all:
                continue
            for workload, tokens in self.inputs.items():
                if self.time_left() < self.args.reserve_s:
                    self.result["notes"].append(f"stopped before accelerate {budget_name} {workload}: deadline")
                    return
                model = copy.deepcopy(self.model)
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated(self.device)
                if budget is None:
                    model = cpu_offload(model, execution_device=self.device)
                    config = "accelerate cpu_offload"
                    device_map = None
                else:
                    device_map = infer_auto_device_map(model, max_memory={gpu: budget, "cpu": 2**40}, no_split_module_classes=[LAYER_CLASS[self.args.model]])
                    if gpu not in device_map.values():
                        # no module fits the budget beside accelerate's reserve for the largest
                        # layer: dispatch_model would run on the CPU; a user streams everything
                        model = cpu_offload(model, execution_device=self.device)
                        config = "accelerate cpu_offload"
                        device_map = None
                        streamed_all = True
                    else:
                        model = dispatch_model(model, device_map=device_map, main_device=gpu)
                        config = "accelerate dispatch_model"
                weights_on_gpu = torch.cuda.memory_allocated(self.device) - before
                x = tokens.to(self.device)
                runs = max(self.args.runs, 20)
                with torch.no_grad():
                    timing, out = time_calls(lambda: model(x), self.device, runs, 2)
                row = {"workload": workload, "config": config, "policy": None, "budget_name": budget_name if budget else "floor",
                       "budget_bytes": budget if budget else 0, **timing, "peak_weight_bytes": weights_on_gpu,
                       "bytes_h2d_per_forward": self.total_bytes - weights_on_gpu,
                       "gpu_modules": sum(1 for d in (device_map or {}).values() if d == gpu),
                       "cpu_modules": sum(1 for d in (device_map or {}).values() if d == "cpu"),
                       **compare(out, self.reference[workload])}
                row["bound_s"] = self.bound(workload, row["bytes_h2d_per_forward"])
                self.add_row(row)
                remove_hook_from_submodules(model)
                del model, out
                gc.collect()
                torch.cuda.empty_cache()

    # --- load time, cold and warm page cache
    def run_load(self) -> None:
        workload = next(iter(self.inputs))
        pte, ptd = self.variants[None][workload]
        for budget_name, budget in (self.budgets()[0], self.budgets()[-1]):
            for cache in ("cold", "warm"):
                if self.time_left() < 20:
                    return
                if cache == "cold":
                    drop_page_cache(ptd)
                t = time.perf_counter()
                m = Module(pte, ptd, weight_offload_budget_mb=budget / 2**20, device=self.device, prefault=True)
                load = time.perf_counter() - t
                x = self.inputs[workload].to(self.device)
                t = time.perf_counter()
                m(x)
                sync(self.device)
                first = time.perf_counter() - t
                entry = {"workload": workload, "budget_name": budget_name, "budget_bytes": budget, "page_cache": cache, "load_s": load, "first_forward_s": first, **host_memory()}
                m.close()
                del m
                gc.collect()
                self.result["load"].append(entry)
                self.save()
                self.log(f"load {budget_name} {cache}: {load:.2f} s, first forward {first * 1e3:.1f} ms, RSS {entry.get('vmrss_bytes', 0) / 2**30:.2f} GiB")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(LAYER_CLASS), default="hf-llama", help="hf-llama: transformers LlamaForCausalLM (GQA); own: the project's decoder")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--workdir", default="/tmp/hostswap-bench")
    p.add_argument("--quick", action="store_true", help="a small model (smoke test; numbers mean nothing)")
    p.add_argument("--deadline-s", type=float, default=540, help="stop starting new configurations after this many seconds")
    p.add_argument("--reserve-s", type=float, default=30)
    p.add_argument("--workloads", type=lambda v: v.split(","), default=["decode", "prefill"], help="comma-separated subset of decode,prefill")
    p.add_argument("--only", type=lambda v: v.split(","), default=[], help="run only hostswap configurations whose names contain one of these")
    p.add_argument("--skip", default="", help="comma-separated: accelerate,load,budgets")
    p.add_argument("--part", help="suffix of the result file, for a run split over several processes (weights_<device>_<part>.json)")
    p.add_argument("--quantize", type=lambda v: [s for s in v.split(",") if s], default=[],
                   help="also quantize the model (torchao weight-only, of int8,int4) and run it at the same budgets (default none)")
    p.add_argument("--quantized-configs", type=lambda v: [s for s in v.split(",") if s], default=None,
                   help="configurations the quantized programs run in (default: planned d1 cuda_graph on CUDA, planned d1 elsewhere)")
    args = p.parse_args(argv)
    unknown = [q for q in args.quantize if q not in QUANTIZATION_SCHEMES]
    if unknown:
        p.error(f"--quantize: unknown {unknown}; choose from {','.join(QUANTIZATION_SCHEMES)}")
    if "int4" in args.quantize and not args.device.startswith("cuda"):
        p.error("--quantize int4: torchao's tinygemm int4 layout packs and runs on CUDA only")
    if args.quantized_configs is None:
        args.quantized_configs = ["planned d1 cuda_graph" if args.device.startswith("cuda") else "planned d1"]
    skip = set(filter(None, args.skip.split(",")))
    bench = Bench(args)
    if args.quantize:
        bench.quantized_configs()  # refused before anything is exported
    bench.log(f"writing {bench.path}")
    bench.measure_bandwidth()
    bench.build()
    bench.log(f"weights {bench.total_bytes / 2**30:.2f} GiB, budgets {[(n, round(b / 2**20)) for n, b in bench.budgets()]} MiB")
    bench.run_plain()
    bench.run_hostswap_all(budgets="budgets" not in skip)
    for scheme in args.quantize:
        bench.run_quantized(scheme)
    if "accelerate" not in skip:
        bench.run_accelerate()
    if "load" not in skip:
        bench.run_load()
    bench.result["wall_s"] = time.perf_counter() - bench.t0
    bench.save()
    bench.log(f"done: {bench.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
