"""Interleaved A/B in one process: the pool's _Streams as committed (one cudaMemcpyAsync per
copy, compute stream looked up once per forward, events reused) against the version that goes
through torch for every call (bench/ab_data/torch_call_streams.py), each also with stall
timing off.

    python bench/ab_host_calls.py [--model hf-llama|own] [--layers 12] [--fraction 0.5]

Host time decides eager forwards whose kernels launch faster than the host walks the
program (transformers models in decode): there the pool's own host calls add to latency.
"""
import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hostswap  # noqa: E402
from hostswap.bench.weights import hf_llama, host_and_latency, time_calls  # noqa: E402
from hostswap.models import llama_decoder  # noqa: E402
from hostswap.runtime import Module, pool  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="hf-llama", choices=["hf-llama", "own"])
p.add_argument("--layers", type=int, default=12)
p.add_argument("--fraction", type=float, default=0.5)
p.add_argument("--rounds", type=int, default=2)
args = p.parse_args()

OTHER_SRC = open(os.path.join(os.path.dirname(__file__), "ab_data", "torch_call_streams.py")).read()
ns = dict(pool.__dict__)
exec(OTHER_SRC, ns)
committed, torch_calls = pool._Streams, ns["TorchCallStreams"]
model = hf_llama(args.layers) if args.model == "hf-llama" else llama_decoder(args.layers, max_seq=2048)
directory = tempfile.mkdtemp()
progs = {}
for name, n in (("prefill", 2048), ("decode", 1)):
    ids = torch.randint(0, 32000, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ep = hostswap.apply_weight_offload(torch.export.export(model, (ids,), strict=False))
    progs[name] = (*hostswap.save(ep, os.path.join(directory, name)), ids.cuda())
res = {}
for rnd in range(args.rounds):
    for wl in progs:
        pte, ptd, x = progs[wl]
        total = hostswap.schedules.load_weight_schedule(pte).total_bytes
        for variant, cls, stalls in (("committed", committed, True), ("committed nostall", committed, False), ("torch calls", torch_calls, True), ("torch calls nostall", torch_calls, False)):
            pool._Streams = cls
            m = Module(pte, ptd, weight_offload_budget_mb=int(args.fraction * total) / 2**20, device="cuda")
            m.pool.streams.measure_stalls = stalls
            t = time_calls(lambda: m(x), x.device, 20, 3)[0]["latency_s"] * 1e3
            host = statistics.median(host_and_latency(lambda: m(x))[0] for _ in range(5)) * 1e3
            m.close()
            res.setdefault((wl, variant), []).append((t, host))
            print(f"round {rnd} {wl} {args.fraction:.0%} {variant}: latency {t:.2f} ms, host {host:.2f} ms", flush=True)
pool._Streams = committed
for (wl, variant), v in res.items():
    print(wl, variant, "median latency", f"{statistics.median(t for t, _ in v):.2f} ms", "host", f"{statistics.median(h for _, h in v):.2f} ms")
