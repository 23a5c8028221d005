"""Interleaved A/B in one process: copies whose source is a view ExecuTorch folded into memory
planning (the q/k/v transposes after each projection's reshape) run as views
(executor.VIEW_FOLDED_SOURCES, since e30cd3e) or as copies (before). hostswap all-resident and
cuda_graph at the total budget, decode and prefill, on the bench's 9-layer model, with plain
PyTorch (``ep.module()`` on the device, as bench/weights.py runs it) timed in the same rounds.
Usage: python bench/ab_views.py   (HS_ROUNDS, HS_LAYERS, HS_DEV=cpu for a smoke run)
"""
import os, statistics
import torch
from hostswap.runtime import Module
from hostswap.runtime import executor
from hostswap.bench.weights import llama_program, time_calls
from hostswap.models import llama_decoder

dev = torch.device(os.environ.get("HS_DEV", "cuda"))
layers, rounds = int(os.environ.get("HS_LAYERS", 9)), int(os.environ.get("HS_ROUNDS", 3))
runs = 30 if dev.type == "cuda" else 3
progs = {}
for name, n in (("decode", 1), ("prefill", 2048 if dev.type == "cuda" else 16)):
    pte, ptd, tokens = llama_program(layers, n)
    progs[name] = (pte, ptd, tokens.to(dev))
plain = {}
for name, (_, _, x) in progs.items():
    model = llama_decoder(layers, max_seq=max(2048, x.shape[1])).to(dev)  # same seed as llama_program
    plain[name] = torch.export.export(model, (x,)).module()
graph_modes = (False, True) if dev.type == "cuda" else (False,)
res = {}
for rnd in range(rounds):
    for wl, (pte, ptd, x) in progs.items():
        t = time_calls(lambda: plain[wl](x), dev, runs, 3)[0]["latency_s"] * 1e3
        res.setdefault((wl, "plain", "PyTorch"), []).append(t)
        print(f"round {rnd} {wl} plain PyTorch: {t:.2f} ms", flush=True)
        for graph in graph_modes:
            for views in (True, False):
                executor.VIEW_FOLDED_SOURCES = views
                try:
                    m = Module(pte, ptd, weight_offload_budget_mb=10**6, device=dev, cuda_graph=graph)
                finally:
                    executor.VIEW_FOLDED_SOURCES = True
                elided = m._executors[m.method_name].elided_copies
                t = time_calls(lambda: m(x), dev, runs, 3)[0]["latency_s"] * 1e3
                m.close()
                key = (wl, "cuda_graph" if graph else "eager", "views" if views else "copies")
                res.setdefault(key, []).append(t)
                print(f"round {rnd} {' '.join(key)} ({elided} copies run as views): {t:.2f} ms", flush=True)
for key, v in res.items():
    print(*key, " ".join(f"{t:.2f}" for t in v), f"median {statistics.median(v):.2f} ms")
for wl in progs:
    for mode in ("eager",) + (("cuda_graph",) if len(graph_modes) > 1 else ()):
        for way in ("views", "copies"):
            r = [a / b for a, b in zip(res[(wl, mode, way)], res[(wl, "plain", "PyTorch")])]
            print(f"{wl} {mode} {way} / plain per round:", " ".join(f"{x:.3f}" for x in r), f"median {statistics.median(r):.3f}")
