"""Host time of every statement of the generated forward (kernel launch or probe), prefill 9-layer.

Finds where the host blocks: the executor's generated code is recompiled with a timestamp after
each statement; per statement the median host time over 20 forwards is reported, with the
largest ones and the host time a forward spends before each streamed probe.
Usage: host_stmt.py [tokens] [depth:fraction ...]
"""
import builtins, re, statistics, sys, time, collections
import torch
from hostswap.runtime import Module
from hostswap.runtime import executor as ex
from hostswap.bench.weights import host_and_latency, llama_program

tokens_n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
configs = [tuple(float(x) for x in c.split(":")) for c in (sys.argv[2:] or ["1:1", "0:0.75", "1:0.75"])]
import os
DEV = os.environ.get("HS_DEV", "cuda")
pte, ptd, tokens = llama_program(int(os.environ.get("HS_LAYERS", 9)), tokens_n)
x = tokens.to(DEV)
if DEV == "cpu":
    torch.cuda.synchronize = lambda *a: None
total = 4167720960 if DEV == "cuda" else int(os.environ["HS_TOTAL"])

builtins._HS_T = []
_compile = builtins.compile
STMTS = []
def traced_compile(source, filename, mode, *a, **k):
    lines = source.split("\n")
    STMTS.clear()
    out = [lines[0], "    _T = __import__('builtins')._HS_T; _pc = __import__('time').perf_counter; _T.append(_pc())"]
    for line in lines[1:]:
        out.append(line)
        if line.startswith("    ") and not line.startswith("    return"):
            out.append("    _T.append(_pc())")
            STMTS.append(line.strip())
    return _compile("\n".join(out), filename, mode, *a, **k)
ex.compile = traced_compile

for rnd in range(2):
    for depth, frac in configs:
        depth = int(depth)
        m = Module(pte, ptd, weight_offload_budget_mb=int(frac * total) / 2**20, device=DEV, prefetch_depth=depth)
        exe = m._executors[m.method_name]
        m(x); torch.cuda.synchronize()  # generates the code
        stmts = list(STMTS)
        labels = []
        for ins in exe.instructions:
            if ins[0] == "kernel":
                op = ins[5] if ins[5] is not None else ins[1]
                labels.append(getattr(op, "__name__", str(op)))
            elif ins[0] == "probe":
                labels.append(f"probe {ins[1]} {ins[2]}")
            else:
                labels.append(ins[0])
        per = collections.defaultdict(list)
        hosts, lats = [], []
        for i in range(25):
            builtins._HS_T = T = []
            marks = []
            host, latency = host_and_latency(lambda: (marks.append(time.perf_counter()), m(x), marks.append(time.perf_counter())))
            if i >= 5:
                hosts.append(host); lats.append(latency)
                d = [b - a for a, b in zip(T, T[1:])]
                for j, v in enumerate(d):
                    per[j].append(v)
                per["pre"].append(T[0] - marks[0]); per["post"].append(marks[1] - T[-1])
        med = {j: statistics.median(v) for j, v in per.items()}
        stmt = sum(v for j, v in med.items() if isinstance(j, int))
        print(f"round {rnd} d{depth} {frac:.0%}: host {statistics.median(hosts)*1e3:.2f} ms, latency {statistics.median(lats)*1e3:.2f} ms; statements {stmt*1e3:.2f} ms, before run {med['pre']*1e3:.2f} ms, after {med['post']*1e3:.2f} ms; {len(labels)} instructions, {len(per)-2} timed statements", flush=True)
        def label(j):
            line = stmts[j] if j < len(stmts) else "?"
            mo = re.search(r"_op(\d+)\(", line)
            if mo:
                return labels[int(mo.group(1))]
            mo = re.search(r"_acquire\((\d+)", line)
            return f"probe {mo.group(1)}" if mo else line[:30]
        kinds = collections.defaultdict(float)
        for j in med:
            if isinstance(j, int):
                kinds[label(j).split(" ")[0] if label(j).startswith("probe") else label(j)] += med[j]
        print("  host by statement kind (ms): " + ", ".join(f"{k} {v*1e3:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:14]), flush=True)
        top = sorted((j for j in med if isinstance(j, int)), key=lambda j: -med[j])[:12]
        print("  largest statements (index: median us, max us): " + ", ".join(f"{j} {label(j)}: {med[j]*1e6:.0f}/{max(per[j])*1e6:.0f}" for j in top), flush=True)
        big = [(j, med[j]) for j in med if isinstance(j, int) and med[j] > 200e-6]
        print(f"  statements over 200 us: {len(big)}, {sum(v for _, v in big)*1e3:.2f} ms", flush=True)
        m.close()
