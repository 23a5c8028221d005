"""Host time of a forward (launch only) against its synchronised latency, prefill 9-layer."""
import os, sys, tempfile, statistics, time
import torch
import hostswap
from hostswap.runtime import Module
from hostswap.bench.weights import host_and_latency, llama_program

tokens_n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
pte, ptd, tokens = llama_program(9, tokens_n)
x = tokens.cuda()
total = 4167720960
for rnd in range(2):
    for depth, frac, stalls in ((1, 1.0, True), (0, 0.75, True), (1, 0.75, True), (0, 0.75, False), (1, 0.75, False)):
        m = Module(pte, ptd, weight_offload_budget_mb=int(frac * total) / 2**20, device="cuda", prefetch_depth=depth)
        m.pool.streams.measure_stalls = stalls
        hosts, totals = [], []
        for i in range(25):
            host, latency = host_and_latency(lambda: m(x))
            if i >= 5:
                hosts.append(host); totals.append(latency)
        print(f"d{depth} {frac:.0%} stalls={stalls}: host {statistics.median(hosts)*1e3:.2f} ms, latency {statistics.median(totals)*1e3:.2f} ms", flush=True)
        m.close()
