"""What trusting the files costs: the checks at load, and verifying every byte.

    python bench/verify.py --layers 12        # the generation benchmark's 1.25 GiB bf16 Llama

The generation benchmark's transformers ``LlamaForCausalLM`` (bench/generate.py) is exported
with ``hostswap.llm.export``. Then, with the files in the page cache as a user's second load
finds them: the index validation and pair check every load adds (no weight read; parsing
the program, which every load does anyway, timed apart), the
byte-for-byte verification of ``verify=True`` / ``hostswap verify``, and, for scale, a plain
copy of every weight out of the mapping. Each is timed ``--repeat`` times (best kept). The
result goes to ``bench/results/verify_<machine>.json`` (the GPU's name on a GPU host, else
``cpu``): hashing runs on the host CPU, so the machine is what the figure describes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hostswap.llm as llm  # noqa: E402
from generate import llama  # noqa: E402
from hostswap.runtime.ptd import PtdFile, open_pair  # noqa: E402
from hostswap.schedules.pte_program import read_program, read_program_bytes  # noqa: E402
from weights import best_seconds, environment, result_path  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--workdir", default=tempfile.gettempdir())
    args = p.parse_args(argv)
    machine = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    say = lambda m: print(f"[verify] {m}", flush=True)
    model = llama(args.layers)
    work = tempfile.mkdtemp(dir=args.workdir)
    t = time.perf_counter()
    pte, ptd = llm.export(model, os.path.join(work, "llama"), max_seq_len=256, progress=say)
    export_s = time.perf_counter() - t
    del model

    data = read_program_bytes(pte)
    program = read_program(data, pte)

    def load_checks():  # what verify=False adds to a load: the index and the pair, no weight read
        with open_pair(pte, data, program, ptd):
            pass

    with PtdFile(ptd) as weights:
        nbytes = sum(e.nbytes for e in weights.entries.values())
        verify_s = best_seconds(weights.verify, args.repeat)
        into = torch.empty(nbytes, dtype=torch.uint8)

        def copy_out():
            at = 0
            for e in sorted(weights.entries.values(), key=lambda e: e.offset):
                into[at : at + e.nbytes].copy_(weights.host_tensor(e.fqn).reshape(-1).view(torch.uint8))
                at += e.nbytes

        copy_s = best_seconds(copy_out, args.repeat)
        count = len(weights.entries)
    checks_s = best_seconds(load_checks, args.repeat)
    parse_s = best_seconds(lambda: read_program(data, pte), args.repeat)  # every load parses the program anyway
    result = {
        "environment": dict(environment(machine), cpu_count=os.cpu_count(), cpu=_cpu_name()),
        "model": {"class": "LlamaForCausalLM", "layers": args.layers, "weight_bytes": nbytes, "weights": count},
        "export_s": export_s,
        "program_bytes": len(data),
        "parse_program_s": parse_s,
        "load_checks_s": checks_s,
        "verify_s": verify_s,
        "copy_s": copy_s,
    }
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "verify", machine)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    say(f"{count} weights, {nbytes / 2**30:.2f} GiB: checks at load {checks_s * 1e3:.1f} ms (parsing the program, done anyway: {parse_s * 1e3:.0f} ms); verify {verify_s:.2f} s "
        f"({nbytes / verify_s / 1e9:.1f} GB/s); copying them out {copy_s:.2f} s ({nbytes / copy_s / 1e9:.1f} GB/s) -> {path}")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
