"""Interleaved A/B in one process: the pool's _Streams before (6183ec5) and after the host-call
changes (750bc14 + 6b6ddcf), prefill and decode at 75 % of the weights."""
import os, sys, tempfile, statistics
import torch
import hostswap
from hostswap.models import llama_decoder
from hostswap.runtime import Module
from hostswap.runtime import pool
from hostswap.bench.weights import time_calls

OLD_SRC = open(os.path.join(os.path.dirname(__file__), "ab_data", "old_streams.py")).read()
ns = dict(pool.__dict__)
exec(OLD_SRC, ns)
class OldStreams(ns["_Streams"]):
    def copy(self, dst, src, event=None):
        return super().copy(dst, src)
NewStreams = pool._Streams
total = 4167720960
progs = {}
for name, n in (("prefill", 2048), ("decode", 1)):
    model = llama_decoder(9, max_seq=2048)
    tokens = torch.randint(0, 32000, (1, n), generator=torch.Generator().manual_seed(1))
    tmp = tempfile.mkdtemp()
    progs[name] = (*hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, (tokens,))), os.path.join(tmp, "m")), tokens.cuda())
    del model
configs = [("prefill", "planned", 0), ("prefill", "planned", 1), ("decode", "planned", 1), ("decode", "lru", 1)]
res = {}
for rnd in range(3):
    for wl, policy, depth in configs:
        for variant, cls in (("old", OldStreams), ("new", NewStreams)):
            pool._Streams = cls
            pte, ptd, x = progs[wl]
            m = Module(pte, ptd, weight_offload_budget_mb=int(0.75 * total) / 2**20, device="cuda", policy=policy, prefetch_depth=depth)
            t = time_calls(lambda: m(x), x.device, 30, 3)[0]["latency_s"] * 1e3
            m.close()
            res.setdefault((wl, policy, depth, variant), []).append(t)
            print(f"round {rnd} {wl} {policy} d{depth} 75% {variant}: {t:.2f} ms", flush=True)
pool._Streams = NewStreams
for k, v in res.items():
    print(*k, " ".join(f"{t:.2f}" for t in v), f"median {statistics.median(v):.2f} ms")
