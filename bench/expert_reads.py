"""How fast a GPU reads a few experts out of a table in pinned host memory, by each way there is.

An MoE decode step needs the k experts its router picked, known only on the device. The ways
to bring them without the host learning which: a gather kernel over the table's mapped host
pages (`table[ids]`, `index_select`, on wider element types), against the copy engine's
pinned-to-device copy of the same bytes (which needs the ids on the host) and the copy of
the whole table (the all-experts schedule). Writes bench/results/expert_reads_<device>.json.

    python bench/expert_reads.py [--experts 8] [--top-k 2] [--rows 28672] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from hostswap.kernels.row_copy import masked_row_copy
from hostswap.runtime.ptd import _MappedBytes


def mapped_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over ``host``'s pinned pages (cudaHostAlloc memory is mapped)."""
    from cuda.bindings import runtime as cudart

    err, pointer = cudart.cudaHostGetDevicePointer(host.data_ptr(), 0)
    assert err == cudart.cudaError_t.cudaSuccess, err
    raw = torch.as_tensor(_MappedBytes(int(pointer), host.numel() * host.element_size(), host), device="cuda")
    return raw.view(host.dtype).view(host.shape)


def timed(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rows", type=int, default=28672)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    shape = (args.experts, args.rows, args.hidden)
    host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    host.view(torch.int16).random_(-2000, 2000)
    view = mapped_view(host)
    ids = torch.randperm(args.experts, device="cuda")[: args.top_k]
    expert_bytes = args.rows * args.hidden * 2
    picked = expert_bytes * args.top_k
    device_table = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    landing = torch.empty((args.top_k, args.rows, args.hidden), dtype=torch.bfloat16, device="cuda")
    ids_host = ids.tolist()

    def copy_engine_picked():
        for j, e in enumerate(ids_host):
            landing[j].copy_(host[e], non_blocking=True)

    slots = torch.arange(args.top_k, device="cuda")
    every, none = torch.ones(args.top_k, dtype=torch.int32, device="cuda"), torch.zeros(args.top_k, dtype=torch.int32, device="cuda")
    wide = {torch.int64: view.view(args.experts, -1).view(torch.int64), torch.int32: view.view(args.experts, -1).view(torch.int32)}
    ways = {
        "copy engine, whole table (all experts)": (lambda: device_table.copy_(host, non_blocking=True), expert_bytes * args.experts),
        "copy engine, picked experts (ids on the host)": (copy_engine_picked, picked),
        "gather kernel table[ids] (bf16 elements)": (lambda: view[ids], picked),
        "index_select over int32 elements": (lambda: wide[torch.int32].index_select(0, ids), picked),
        "index_select over int64 elements": (lambda: wide[torch.int64].index_select(0, ids), picked),
        "mapped view copy_ of one expert (contiguous)": (lambda: landing[0].copy_(view[int(ids_host[0])]), expert_bytes),
        "masked row copy, every pick missed (Triton)": (lambda: masked_row_copy(view, landing, ids, slots, every), picked),
        "masked row copy, every pick hit (Triton, reads nothing)": (lambda: masked_row_copy(view, landing, ids, slots, none), 0),
    }
    # the same gather, checked once against the host's bytes (as int16: random bits hold NaNs, which equal nothing)
    assert torch.equal(view[ids].cpu().view(torch.int16), host[ids.cpu()].view(torch.int16))
    landing.zero_()
    masked_row_copy(view, landing, ids, slots, every)
    assert torch.equal(landing.cpu().view(torch.int16), host[ids.cpu()].view(torch.int16))
    results = {"device": torch.cuda.get_device_name(), "shape": list(shape), "top_k": args.top_k, "expert_bytes": expert_bytes, "ways": {}}
    for name, (fn, nbytes) in ways.items():
        seconds = timed(fn, args.repeat)
        results["ways"][name] = {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}
        print(f"{name:58s} {nbytes / 2**20:9.0f} MiB  {nbytes / seconds / 1e9:6.1f} GB/s  {seconds * 1e6:9.1f} us")
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    print("triton", results["triton"])
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    name = torch.cuda.get_device_name().replace(" ", "_")
    with open(os.path.join(os.path.dirname(__file__), "results", f"expert_reads_{name}_{args.experts}x{args.top_k}.json"), "w") as f:
        json.dump(results, f, indent=2)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"expert_reads_{name}_{args.experts}x{args.top_k}.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
