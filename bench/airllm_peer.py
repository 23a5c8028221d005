"""AirLLM as the disk-streaming peer: its decode time per token and GPU memory on a transformers checkpoint.

    PYTHONPATH=/tmp/site python bench/airllm_peer.py CHECKPOINT --work DIR --new-tokens 4 --prompt-len 16 --out result.json

AirLLM (pip ``airllm``, 4.0) first splits the checkpoint into one safetensors file per module
(embedding, each decoder layer, final norm, head) under ``<work>/splitted_model``. It then builds
the transformers model on the meta device and hooks each of those modules. Before a module runs,
its file is read, with the next module's file read on a worker thread (prefetching, on by
default), and its weights are moved to the device. After the module runs, they go back to meta.
transformers' ``generate`` drives the forward passes with its default dynamic KV cache, so every
token, the first and each decoded one, reads every module's file once. The defaults are
AirLLM's: no compression, prefetching on, the checkpoint's dtype and sdpa attention.

Measured in this process, ``run_airllm`` returns:

- ``split_seconds``: AirLLM's one-time split, timed around AirLLM's own call that finds or makes
  the split. When ``<work>`` already holds a complete split, AirLLM reuses it:
  ``split_reused``, and the seconds are only the check.
- ``init_seconds``: building the model (after the split).
- ``first_token_s``: from calling ``generate`` to the first new token, i.e. the prefill of the
  prompt, one pass over every module. A streamer (transformers' ``BaseStreamer``) takes the
  time of each new token as ``generate`` hands it over, after synchronizing the device.
- ``ms_per_token``: steady-state decode, the mean interval between consecutive new tokens after
  the first (``decode_token_ms`` lists each interval). ``timing`` says how it was taken; with
  one new token there is no interval, and ``ms_per_token`` is the whole ``generate`` call.
- ``gpu_peak_bytes`` and ``gpu_reserved_peak_bytes``: ``torch.cuda.max_memory_allocated`` and
  ``max_memory_reserved``. The peak counters are reset after the split and before the model is
  built, so they cover building and ``generate``. They count PyTorch's allocator only, not the
  CUDA context and not AirLLM's pinned host copies. ``host_peak_rss_bytes`` is the process's
  ``VmHWM``.
- ``clean_memory_seconds`` (and ``_calls``): the part of ``generate`` spent in AirLLM's
  ``clean_memory`` (``gc.collect``, ``malloc_trim``, ``torch.cuda.empty_cache``), which it calls
  after every module; a diagnostic that leaves the call as it is.
- ``tokens``: the new token ids, greedy (``do_sample=False``). ``min_new_tokens`` equals
  ``max_new_tokens``, as in bench/generate.py, so exactly ``new_tokens`` come out.

The page cache: AirLLM reads its files through the page cache, so on a host whose RAM holds the
split, the reads after the first pass (and, just after a split, the first pass as well) come
from RAM. ``drop_cache`` controls this. ``"none"`` leaves the cache as it is. ``"start"`` writes back
the split's files and drops their pages (``posix_fadvise(DONTNEED)``) once before ``generate``.
``"every-token"`` also drops them after each token; the interval of the next token starts once
the drop has returned, so the drop's own time is not counted.

Two things are adjusted from outside AirLLM, neither of which changes what it streams or how:

- The tokenizer. AirLLM's constructor loads the checkpoint's tokenizer
  (``AutoTokenizer.from_pretrained``) only to hand it to the caller as ``model.tokenizer``;
  nothing on the ``generate`` path reads it. The benchmark passes token ids, and
  bench/checkpoints.py's checkpoints have no tokenizer files, so there the load raises. The
  class that AirLLM's ``AutoModel`` picks for the checkpoint is therefore subclassed with a
  ``get_tokenizer`` that returns None.
- Its prints (split progress, "saved as ...") go to stderr, so stdout carries the JSON alone.

AirLLM's own dependencies need nothing beyond torch, transformers, accelerate, safetensors, tqdm
and huggingface_hub on this path: ``bitsandbytes`` (compression only), ``sentencepiece`` (the
Baichuan tokenizer only), ``compressed_tensors`` (pre-quantized checkpoints only) and ``mlx``
(macOS only) are imported behind guards or lazily, and ``scipy`` is not imported by AirLLM.
transformers imports ``scipy`` only when it is installed.

The CLI prints one JSON object. On any failure, or on SIGTERM (a caller's time limit), it prints
``{"error": ..., "partial": {...what was measured so far}}`` instead and exits with 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procfs import drop_page_cache, memory  # noqa: E402

# what drop_cache accepts
DROP_CACHE = ("none", "start", "every-token")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TokenClock:
    """A transformers streamer that stamps each token ``generate`` hands over. The first ``put``
    is the prompt; each later one is one new token. ``after_token`` (the page-cache drop of
    "every-token") runs after the stamp, and the next interval starts when it returns."""

    def __init__(self, device: torch.device, after_token=None):
        self.device, self.after_token = device, after_token
        self.prompt_seen = False
        self.stamps: list[float] = []  # when each new token arrived
        self.resumed: list[float] = []  # when generation went on after it

    def put(self, value) -> None:
        _sync(self.device)
        now = time.perf_counter()
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.stamps.append(now)
        if self.after_token is not None:
            self.after_token()
            now = time.perf_counter()
        self.resumed.append(now)

    def end(self) -> None:
        pass


def _resolve_class(checkpoint_folder: str):
    """The class AirLLM's AutoModel picks for the checkpoint, with the tokenizer load left out
    (see the module docstring)."""
    import importlib

    from airllm import AutoModel

    module, name = AutoModel.get_module_class(checkpoint_folder)
    base = getattr(importlib.import_module(module), name)

    class Peer(base):
        def get_tokenizer(self, hf_token=None):
            return None

    Peer.__name__ = Peer.__qualname__ = f"{name}WithoutTokenizer"
    return base, Peer


def run_airllm(checkpoint_folder, work_dir, prompt_ids: list[int], new_tokens: int, device="cuda", *,
               drop_cache: str = "none", prefetching: bool = True, partial: dict | None = None) -> dict:
    """Run AirLLM in this process on ``checkpoint_folder`` (a transformers checkpoint folder),
    splitting it under ``work_dir``, and generate ``new_tokens`` greedy tokens after
    ``prompt_ids``. Returns the measurements described in the module docstring. ``partial``, when
    given, is filled in as each stage completes, so a caller can still report them when a later
    stage fails."""
    if drop_cache not in DROP_CACHE:
        raise ValueError(f"drop_cache must be one of {DROP_CACHE}, not {drop_cache!r}")
    if new_tokens < 1 or not prompt_ids:
        raise ValueError("need at least one prompt token and one new token")
    result = partial if partial is not None else {}
    checkpoint_folder, work_dir = os.path.abspath(os.fspath(checkpoint_folder)), os.path.abspath(os.fspath(work_dir))
    if not os.path.isfile(os.path.join(checkpoint_folder, "config.json")):
        # AirLLM would take anything else for a Hugging Face repo id and try to download it
        raise FileNotFoundError(f"no config.json in {checkpoint_folder}: not a transformers checkpoint folder")
    os.makedirs(work_dir, exist_ok=True)
    if device == "cuda":
        device = "cuda:0"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.init()

    import transformers

    t = time.perf_counter()
    import airllm
    import airllm.airllm_base as airllm_base
    from transformers import GenerationConfig

    result.update({"airllm_version": _version("airllm"), "transformers_version": transformers.__version__, "torch_version": torch.__version__,
                   "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                   "checkpoint": checkpoint_folder, "work_dir": work_dir, "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens,
                   "import_seconds": time.perf_counter() - t})

    base, Peer = _resolve_class(checkpoint_folder)
    split_dir = os.path.join(work_dir, "splitted_model")
    split_before = os.path.isdir(split_dir)

    # AirLLM's constructor splits the checkpoint through this function (or finds the split done);
    # time that call alone.
    find_or_split = airllm_base.find_or_create_local_splitted_path
    split = {}

    def timed_split(*args, **kwargs):
        start, wall = time.perf_counter(), time.time()
        out = find_or_split(*args, **kwargs)
        split["seconds"] = time.perf_counter() - start
        split["path"] = out[1]
        # reused: the folder was there and the call wrote none of its files
        split["reused"] = split_before and all(os.path.getmtime(os.path.join(out[1], f)) < wall for f in os.listdir(out[1]))
        if dev.type == "cuda":  # the split moves nothing to the GPU; the peaks start here
            torch.cuda.reset_peak_memory_stats(dev)
        return out

    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    airllm_base.find_or_create_local_splitted_path = timed_split
    try:
        start = time.perf_counter()
        model = Peer(checkpoint_folder, device=str(dev), layer_shards_saving_path=work_dir, prefetching=prefetching)
        total_init = time.perf_counter() - start
    finally:
        airllm_base.find_or_create_local_splitted_path = find_or_split
    split_path = split["path"]
    split_bytes = sum(os.path.getsize(os.path.join(split_path, f)) for f in os.listdir(split_path) if f.endswith(".safetensors"))
    result.update({"split_seconds": split["seconds"], "split_reused": split["reused"],
                   "split_dir": split_path, "split_bytes": split_bytes, "init_seconds": total_init - split["seconds"]})
    result["settings"] = {"airllm_class": base.__name__, "compression": model.compression, "prefetching": model.prefetching,
                          "dtype": str(model.running_dtype).replace("torch.", ""), "max_seq_len": model.max_seq_len,
                          "attn_implementation": getattr(model.model.config, "_attn_implementation", None),
                          "streamed_modules": len(model._streamed_indices), "tie_word_embeddings": model.tie_word_embeddings,
                          "cache": "transformers generate's default (dynamic) KV cache", "do_sample": False, "drop_cache": drop_cache,
                          "tokenizer": "not loaded (ids are passed)"}
    if dev.type == "cuda":
        result["gpu_allocated_after_init_bytes"] = torch.cuda.memory_allocated(dev)

    if drop_cache != "none":
        t = time.perf_counter()
        drop_page_cache(split_path)
        result["drop_cache_seconds"] = time.perf_counter() - t
    clock = _TokenClock(dev, (lambda: drop_page_cache(split_path)) if drop_cache == "every-token" else None)
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    config = GenerationConfig(do_sample=False, pad_token_id=0, disable_compile=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    # AirLLM calls clean_memory (gc.collect, malloc_trim, torch.cuda.empty_cache) after every
    # module; its time is counted apart, as a diagnostic (the call itself is AirLLM's own).
    clean_memory, cleaning = airllm_base.clean_memory, [0, 0.0]

    def timed_clean_memory():
        t = time.perf_counter()
        clean_memory()
        cleaning[0] += 1
        cleaning[1] += time.perf_counter() - t

    airllm_base.clean_memory = timed_clean_memory
    try:
        _sync(dev)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, generation_config=config, streamer=clock)
        _sync(dev)
        total = time.perf_counter() - start
    finally:
        airllm_base.clean_memory = clean_memory
    tokens = out[0, len(prompt_ids):].tolist()
    if len(clock.stamps) != len(tokens):
        raise RuntimeError(f"the streamer saw {len(clock.stamps)} new tokens, generate returned {len(tokens)}")
    intervals = [(clock.stamps[i] - clock.resumed[i - 1]) * 1e3 for i in range(1, len(clock.stamps))]
    result.update({"tokens": tokens, "generate_seconds": total, "first_token_s": clock.stamps[0] - start,
                   "decode_token_ms": intervals, "clean_memory_calls": cleaning[0], "clean_memory_seconds": cleaning[1]})
    if intervals:
        result["ms_per_token"] = sum(intervals) / len(intervals)
        result["timing"] = "steady-state decode: mean interval between consecutive new tokens after the first, stamped by a streamer after a device sync"
    else:
        result["ms_per_token"] = total * 1e3 / new_tokens
        result["timing"] = "one new token: the whole generate call over new_tokens (includes the prefill)"
    if dev.type == "cuda":
        result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        result["gpu_reserved_peak_bytes"] = torch.cuda.max_memory_reserved(dev)
    else:
        result["gpu_peak_bytes"] = result["gpu_reserved_peak_bytes"] = None
    result["host_peak_rss_bytes"] = memory()["peak"]
    if model._executor is not None:
        model._executor.shutdown(wait=True)
    return result


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 - a version string is informative only
        return None


def prompt_of_length(n: int, vocab_size: int) -> list[int]:
    """The prompt bench/generate.py uses for length ``n`` (``torch.randint(0, 32000)`` seeded
    with ``n``), its range cut to the vocabulary where that is smaller."""
    return torch.randint(0, min(32000, vocab_size), (1, n), generator=torch.Generator().manual_seed(n))[0].tolist()


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated(f"terminated by signal {signum}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a transformers checkpoint folder (config.json and safetensors shards)")
    p.add_argument("--work", required=True, help="where AirLLM writes its per-module split (<work>/splitted_model, about the checkpoint's size)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16, help="bench/generate.py's prompt of this length (ignored with --prompt-ids)")
    p.add_argument("--prompt-ids", type=lambda v: [int(x) for x in v.split(",")], help="comma-separated prompt token ids")
    p.add_argument("--device", default="cuda")
    p.add_argument("--drop-cache", choices=DROP_CACHE, default="none", help="drop the split's pages from the page cache: never, once before generate, or after every token too")
    p.add_argument("--no-prefetching", action="store_true", help="turn AirLLM's prefetching off (default: AirLLM's default, on)")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)

    signal.signal(signal.SIGTERM, _on_sigterm)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint only: never wait on the network
    partial: dict = {}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if a.prompt_ids:
                prompt = a.prompt_ids
            else:
                with open(os.path.join(a.checkpoint, "config.json")) as f:
                    config = json.load(f)
                vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
                prompt = prompt_of_length(a.prompt_len, vocab)
            result = run_airllm(a.checkpoint, a.work, prompt, a.new_tokens, a.device, drop_cache=a.drop_cache,
                                prefetching=not a.no_prefetching, partial=partial)
        code = 0
    except BaseException as e:  # noqa: BLE001 - the caller reads the error from the JSON
        if isinstance(e, SystemExit) and e.code == 0:
            raise
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(), "partial": partial}
        code = 1
    text = json.dumps(result, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
