"""Interleaved A/B in one process: the pool's _Streams as committed against the host-call
version tried in 750bc14/6b6ddcf and reverted (bench/ab_data/host_call_streams.py: one
cudaMemcpyAsync per copy, compute stream looked up once per forward, stall events reused).
The run recorded in bench/results/ab_host_calls_h100_2026-11-22_s7.txt was made at 6b6ddcf,
where the pool also reused one completion event per ring fill; at HEAD only the _Streams
class differs. Each variant also runs with the pool's stall timing off (nostall: no timing
event pair around a compute-stream wait on a copy). Usage: python bench/ab_host_calls.py
"""
import os, sys, tempfile, statistics
import torch
import hostswap
from hostswap.runtime import Module
from hostswap.runtime import pool
from hostswap.bench.weights import llama_program, time_calls

TRIED_SRC = open(os.path.join(os.path.dirname(__file__), "ab_data", "host_call_streams.py")).read()
ns = dict(pool.__dict__)
exec(TRIED_SRC, ns)
OldStreams = pool._Streams  # as committed
NewStreams = ns["HostCallStreams"]  # tried and reverted
total = 4167720960
progs = {}
for name, n in (("prefill", 2048), ("decode", 1)):
    pte, ptd, tokens = llama_program(9, n)
    progs[name] = (pte, ptd, tokens.cuda())
configs = [("prefill", "planned", 0), ("prefill", "planned", 1), ("decode", "planned", 1)]
res = {}
for rnd in range(3):
    for wl, policy, depth in configs:
        for variant, cls, stalls in (("old", OldStreams, True), ("old nostall", OldStreams, False), ("new", NewStreams, True), ("new nostall", NewStreams, False)):
            pool._Streams = cls
            pte, ptd, x = progs[wl]
            m = Module(pte, ptd, weight_offload_budget_mb=int(0.75 * total) / 2**20, device="cuda", policy=policy, prefetch_depth=depth)
            m.pool.streams.measure_stalls = stalls
            t = time_calls(lambda: m(x), x.device, 30, 3)[0]["latency_s"] * 1e3
            m.close()
            res.setdefault((wl, policy, depth, variant), []).append(t)
            print(f"round {rnd} {wl} {policy} d{depth} 75% {variant}: {t:.2f} ms", flush=True)
pool._Streams = OldStreams
for k, v in res.items():
    print(*k, " ".join(f"{t:.2f}" for t in v), f"median {statistics.median(v):.2f} ms")
