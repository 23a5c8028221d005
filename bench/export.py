"""Exporting a transformers checkpoint: streamed from its shards, against loading it, beside the disk's own speed.

    python bench/export.py                                  # Llama 3 8B's shape (16 GB bf16), then 2 GB both ways
    python bench/export.py --size-gb 4 --small-gb 1 --work /data/exportbench
    python bench/export.py --size-gb 0 --part small         # the two paths at 2 GB alone

First the disk under ``--work``: a file of ``--disk-gb`` written sequentially and fsynced (the
write speed), then read back by 8 threads in 16 MiB aligned blocks with O_DIRECT (the read
speed; where the filesystem refuses O_DIRECT, buffered reads after the file's pages are dropped
with posix_fadvise, and the result says so). Then a dense Llama-shaped bf16 checkpoint of
``--size-gb`` (bench/checkpoints.py: shards of at most 4 GB, written straight from random
values and fsynced) has its pages dropped from the page cache and is exported with
``hostswap.llm.export_checkpoint`` in a child process, so that what it measures is the export's
own: seconds, split where the library's progress messages mark the phases (what comes before
the first weight is written: building and tracing, lowering, and in memory loading apart and
emitting; then the weights: streamed, each read from its shard, hashed and written; then the
rest), the peak RSS (``VmHWM``) against the child's
RSS after importing torch, transformers, accelerate, executorch and hostswap, the bytes it
read from and wrote to storage (``/proc/self/io``) and, apart, the fsync of what it wrote.
Then a ``--small-gb`` checkpoint both ways, each in a child of its own with the checkpoint's
pages dropped first: streamed, and in memory (``AutoModelForCausalLM.from_pretrained`` +
``hostswap.llm.export``). Each measurement goes to ``bench/results/export_<device>[_<part>].json``
as soon as it is made; bench/report.py sets each export's time against the checkpoint's bytes
over the read speed plus the same bytes over the write speed. Checkpoints and exports are
deleted as soon as they are measured (the disk holds one checkpoint and its export at a time)
unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from procfs import drop_page_cache, memory  # noqa: E402

BLOCK = 16 * 2**20
READERS = 8
STREAMED, IN_MEMORY = "streamed", "in-memory"
LOADED = "model loaded"  # the in-memory child's own progress mark


def storage_io() -> dict:
    """This process's I/O counters (``/proc/self/io``): the bytes it made storage read and
    write, and the bytes through its read and write calls (page-cache hits included)."""
    names = {"read_bytes": "storage_read_bytes", "write_bytes": "storage_write_bytes", "rchar": "read_call_bytes", "wchar": "write_call_bytes"}
    try:
        with open("/proc/self/io") as f:
            return {names[key]: int(value) for key, value in (line.split(": ") for line in f) if key in names}
    except (OSError, ValueError):
        return {}


def child(path: str, folder: str, out: str, max_seq_len: str) -> None:
    """One export in this process (``bench/export.py child ...``): its figures as one JSON line
    on stdout, its progress on stderr."""
    import accelerate  # noqa: F401
    import executorch.exir  # noqa: F401
    import torch
    import transformers

    import hostswap.checkpoint  # noqa: F401
    import hostswap.llm as llm

    baseline = memory()["rss"]
    phases = []
    start = time.perf_counter()

    def say(message: str) -> None:
        phases.append((time.perf_counter() - start, message))
        print(f"    [{phases[-1][0]:7.1f}s] {path}: {message}", file=sys.stderr, flush=True)

    before = storage_io()
    if path == STREAMED:
        files = llm.export_checkpoint(folder, out, max_seq_len=int(max_seq_len), progress=say)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        say(LOADED)
        files = llm.export(model, out, max_seq_len=int(max_seq_len), progress=say)
        del model
    seconds = time.perf_counter() - start
    peak = memory()["peak"]
    after = storage_io()
    t = time.perf_counter()
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    io = {key: after[key] - before[key] for key in after if key in before}
    print(json.dumps({"seconds": seconds, "sync_s": time.perf_counter() - t, "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
                      "pte_bytes": os.path.getsize(files[0]), "ptd_bytes": os.path.getsize(files[1]), "phases": phases, **io}))


def phase_split(phases: list, seconds: float) -> dict:
    """Seconds of each phase from the progress messages' times: loading (in memory), all before
    the first weight is written (tracing and lowering; in memory also emitting), writing the
    weights, and the rest (streamed: emitting the program; the moves into place)."""
    times = [t for t, _ in phases]
    loaded = next((t for t, m in phases if m == LOADED), None)
    first = next((i for i, (_, m) in enumerate(phases) if m.startswith("writing ")), None)
    if first is None:
        return {}
    written = times[first + 1] if first + 1 < len(times) else seconds
    return {"load_s": loaded, "trace_lower_s": times[first] - (loaded or 0.0), "write_s": written - times[first], "rest_s": seconds - written}


def _open_direct(path: str, buffer) -> int | None:
    """``path`` opened with O_DIRECT and read once, or None where the filesystem refuses it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return None
    try:
        os.preadv(fd, [buffer], 0)
        return fd
    except OSError:
        os.close(fd)
        return None


def read_speed(path: str) -> tuple[float, str]:
    """Bytes/s of reading ``path`` with READERS threads in BLOCK-sized aligned reads, and how:
    with O_DIRECT, or where it is refused, buffered after dropping the file's pages."""
    size = os.path.getsize(path)
    buffers = [mmap.mmap(-1, BLOCK) for _ in range(READERS)]  # page-aligned, as O_DIRECT needs
    fd, mode = _open_direct(path, buffers[0]), "O_DIRECT"
    if fd is None:
        drop_page_cache(os.path.dirname(path))
        fd, mode = os.open(path, os.O_RDONLY), "buffered, pages dropped with posix_fadvise first"

    def reader(i: int) -> int:
        got = 0
        for offset in range(i * BLOCK, size, READERS * BLOCK):
            got += os.preadv(fd, [buffers[i]], offset)
        return got

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(READERS) as pool:
            nbytes = sum(pool.map(reader, range(READERS)))
        return nbytes / (time.perf_counter() - start), mode
    finally:
        os.close(fd)


def disk_speed(folder: str, nbytes: int) -> dict:
    """The disk's sequential write speed (fsync included) and read speed, with a file of
    ``nbytes`` of random bytes in ``folder``."""
    path = os.path.join(folder, "disk-speed.bin")
    block = os.urandom(BLOCK)  # random: a compressing filesystem gains nothing
    blocks = max(1, nbytes // BLOCK)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(blocks):
            f.write(block)
        os.fsync(f.fileno())
    write = blocks * BLOCK / (time.perf_counter() - start)
    try:
        read, mode = read_speed(path)
    finally:
        os.remove(path)
    return {"bytes": blocks * BLOCK, "write_bytes_per_s": write, "read_bytes_per_s": read, "read_mode": mode, "read_threads": READERS, "block_bytes": BLOCK}


def filesystem(folder: str) -> str | None:
    """The type of the filesystem ``folder`` is on (the longest mount point above it)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(folder)
    found = [(point, kind) for point, kind in mounts if real == point or real.startswith(point.rstrip("/") + "/")]
    return max(found, key=lambda m: len(m[0]))[1] if found else None


class Bench:
    def __init__(self, args):
        import torch

        from weights import environment, result_path

        self.args = args
        self.t0 = time.perf_counter()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        os.makedirs(args.out, exist_ok=True)
        self.path = result_path(args.out, "export", device, args.part)
        self.temporary = args.work is None
        self.work = args.work or tempfile.mkdtemp(prefix="hostswap-export-")
        os.makedirs(self.work, exist_ok=True)
        env = environment(device)
        env.update(cpu_count=os.cpu_count(), ram_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), work_filesystem=filesystem(self.work),
                   work_free_bytes=shutil.disk_usage(self.work).free)
        self.result = {"environment": env, "args": vars(args), "disk": None, "checkpoints": {}, "rows": [], "notes": []}

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {message}", flush=True)

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.result, f, indent=1)
        os.replace(self.path + ".tmp", self.path)

    def note(self, message: str) -> None:
        self.result["notes"].append(message)
        self.log(message)
        self.save()

    def export(self, path: str, name: str, checkpoint: dict, folder: str) -> None:
        """One export in a child process; its row is saved at once."""
        out = os.path.join(self.work, f"{name}-{path}")
        drop_page_cache(folder)
        self.log(f"{name}: exporting {path}")
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "child", path, folder, out, str(self.args.max_seq_len)],
                              stdout=subprocess.PIPE, text=True)  # its progress and warnings pass through on stderr
        row = {"checkpoint": name, "checkpoint_bytes": checkpoint["bytes"], "layers": checkpoint["layers"], "hidden_size": checkpoint["hidden_size"],
               "path": path, "page_cache": "dropped"}
        if done.returncode != 0:
            row["error"] = f"child exited with {done.returncode}"
        else:
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            row.update(measured, **phase_split(measured["phases"], measured["seconds"]))
        self.result["rows"].append(row)
        self.save()
        for suffix in (".pte", ".ptd"):
            if not self.args.keep and os.path.exists(out + suffix):
                os.remove(out + suffix)
        if "error" not in row:
            self.log(f"{name} {path}: {row['seconds']:.1f} s ({checkpoint['bytes'] / row['seconds'] / 1e9:.3g} GB/s of the checkpoint; "
                     f"before the weights {row.get('trace_lower_s', 0):.1f} s, weights {row.get('write_s', 0):.1f} s, then fsync {row['sync_s']:.1f} s), peak RSS "
                     f"{row['peak_rss_bytes'] / 2**30:.2f} GiB, {(row['peak_rss_bytes'] - row['baseline_rss_bytes']) / 2**30:.2f} GiB above the baseline")

    def checkpoint(self, name: str, config, paths: tuple[str, ...]) -> None:
        from checkpoints import checkpoint_bytes, write_checkpoint

        nbytes = checkpoint_bytes(config)
        free = shutil.disk_usage(self.work).free
        if free < 2.05 * nbytes:  # the checkpoint and its export at once
            return self.note(f"{name}: skipped: {nbytes / 1e9:.1f} GB and its export need {2.05 * nbytes / 1e9:.1f} GB, {self.work} has {free / 1e9:.1f} GB free")
        folder = os.path.join(self.work, name)
        if os.path.exists(folder):
            shutil.rmtree(folder)
        self.log(f"{name}: writing {nbytes / 1e9:.2f} GB ({config.num_hidden_layers} layers, hidden {config.hidden_size}) to {folder}")
        info = write_checkpoint(folder, config)
        self.result["checkpoints"][name] = info
        self.save()
        self.log(f"{name}: {info['shards']} shards written in {info['seconds']:.1f} s ({info['bytes'] / info['seconds'] / 1e9:.2f} GB/s, fsynced)")
        try:
            for path in paths:
                self.export(path, name, info, folder)
        finally:
            if not self.args.keep:
                shutil.rmtree(folder)

    def run(self) -> None:
        from checkpoints import llama3_8b, llama_of_size

        a = self.args
        self.log(f"writing {self.path}; work in {self.work} ({self.result['environment']['work_filesystem']})")
        if a.disk_gb:
            disk = self.result["disk"] = disk_speed(self.work, int(a.disk_gb * 1e9))
            self.save()
            self.log(f"disk: write {disk['write_bytes_per_s'] / 1e9:.2f} GB/s (fsync included), read {disk['read_bytes_per_s'] / 1e9:.2f} GB/s ({disk['read_mode']})")
        try:
            if a.size_gb != 0:
                self.checkpoint("llama3-8b" if a.size_gb is None else f"llama-{a.size_gb:g}gb", llama3_8b() if a.size_gb is None else llama_of_size(a.size_gb * 1e9),
                                (STREAMED,))
            if a.small_gb:
                self.checkpoint(f"llama-{a.small_gb:g}gb", llama_of_size(a.small_gb * 1e9), (STREAMED, IN_MEMORY))
        finally:
            if self.temporary and not a.keep:
                shutil.rmtree(self.work, ignore_errors=True)
        self.result["wall_s"] = time.perf_counter() - self.t0
        self.save()
        self.log(f"done: {self.path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=None, help="the streamed checkpoint's size (default: Llama 3 8B's shape, 16.06 GB; 0: none)")
    p.add_argument("--small-gb", type=float, default=2.0, help="the checkpoint exported both ways (default 2; 0: none)")
    p.add_argument("--disk-gb", type=float, default=4.0, help="the disk speed file (default 4; 0: not measured)")
    p.add_argument("--max-seq-len", type=int, default=256, help="the exported programs' KV cache (default 256)")
    p.add_argument("--work", help="where checkpoints and exports go (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and exports")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--part", help="suffix of the result file (export_<device>_<part>.json)")
    args = p.parse_args(argv)
    Bench(args).run()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(*sys.argv[2:])
    else:
        raise SystemExit(main())
