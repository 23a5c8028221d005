"""Where a streamed probe's host time goes (bench/host_stmt.py: about 150 us each, 20 us for a
kernel launch). Two parts, prefill on the bench's 9-layer model:

1. cProfile over forwards of each ``depth:fraction`` config, top functions by own time.
2. Host microseconds of the CUDA calls a fill and a wait make, one at a time, on a weight of the
   registered .ptd mapping (the pool's own host tensor) and on a pinned torch copy of it.
Usage: host_cprofile.py [depth:fraction ...]   (default 0:0.75 1:0.75)
"""
import cProfile, io, os, pstats, statistics, sys, time
import torch
from hostswap.runtime import Module
from hostswap.bench.weights import llama_program

configs = [tuple(float(x) for x in c.split(":")) for c in (sys.argv[1:] or ["0:0.75", "1:0.75"])]
pte, ptd, tokens = llama_program(int(os.environ.get("HS_LAYERS", 9)), 2048)
x = tokens.to("cuda")
total = 4167720960


def host_us(fn, n=50):
    """Median host microseconds of ``fn()``, synchronizing every 8 calls so queues stay short."""
    times = []
    for i in range(n):
        if i % 8 == 0:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


for i, (depth, frac) in enumerate(configs):
    m = Module(pte, ptd, weight_offload_budget_mb=int(frac * total) / 2**20, device="cuda", prefetch_depth=int(depth))
    for _ in range(5):
        m(x)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        m(x)
        torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(f"=== d{int(depth)} {frac:.0%}: cProfile of 10 forwards, by own time")
    print("\n".join(s.getvalue().splitlines()[:45]))
    pool = m.pool
    if i == 0:  # the call costs once, on the first config's pool: its weight nearest 32 MiB
        src = min(pool.host, key=lambda t: abs(t.numel() * t.element_size() - 32 * 2**20))
        pinned = src.clone().pin_memory()
        dst = torch.empty_like(src, device="cuda")
        s_copy = torch.cuda.Stream()
        print(f"--- host us per call ({src.numel() * src.element_size() / 2**20:.0f} MiB weight; registered is_pinned={src.is_pinned()})")
        def copy_in_stream(source):
            with torch.cuda.stream(s_copy):
                dst.copy_(source, non_blocking=True)
        def stream_ctx():
            with torch.cuda.stream(s_copy):
                pass
        ev = torch.cuda.Event()
        ev.record()
        rows = {
            "copy_ registered, non_blocking, in stream ctx": lambda: copy_in_stream(src),
            "copy_ pinned torch tensor, same": lambda: copy_in_stream(pinned),
            "with torch.cuda.stream(s): pass": stream_ctx,
            "torch.cuda.Event()": lambda: torch.cuda.Event(),
            "torch.cuda.Event(enable_timing=True)": lambda: torch.cuda.Event(enable_timing=True),
            "event.record(stream)": lambda: ev.record(s_copy),
            "event.query()": lambda: ev.query(),
            "stream.wait_event(event)": lambda: s_copy.wait_event(ev),
            "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
            "torch.cuda.is_current_stream_capturing()": lambda: torch.cuda.is_current_stream_capturing(),
        }
        for name, fn in rows.items():
            print(f"  {name}: {host_us(fn):.1f}")
    m.close()
