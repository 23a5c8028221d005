"""The server end to end: concurrent OpenAI clients against the same program driven from Python.

    python bench/serve.py --layers 12 [--clients 1,8,32] [--budget floor] [--new-tokens 64]

The transformers Llama of bench/generate.py (random bf16 weights, no end-of-sequence token, so
every completion runs to ``max_tokens``) is exported once with ``max_batch_size`` = the largest
client count, beside a word-level tokenizer of its vocabulary. For each count C:

- Python: ``BatchGenerator.generate`` on C prompts of ``--prompt`` token ids, timed whole
  (chunked prefill included);
- server: ``hostswap serve`` in a subprocess at the same budget; C threads each send one
  streaming ``/v1/completions`` request with the same token-id prompt through the ``openai``
  client, all released at once. The row times from the first request sent to the last stream
  closed, and per client the first chunk's arrival.

Both count C x ``--new-tokens`` tokens over their wall time; the row's ratio is server over
Python. Rows go to ``bench/results/serve_<device>.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from generate import llama, sync  # noqa: E402
from weights import environment, result_path, save_result  # noqa: E402

from hostswap import batching  # noqa: E402
from hostswap.schedules.serialization import load_weight_schedules  # noqa: E402
from hostswap.schedules.weight_schedule import load_floor_bytes  # noqa: E402

MODEL = "bench-llama"


def word_tokenizer(vocab_size: int, folder: str) -> None:
    """A tokenizer of ``vocab_size`` words ("w0" ...), saved where ``hostswap serve`` reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(base: str, budget_mb: float, device: torch.device) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "hostswap.cli", "serve", base, "--device", device.type, "--port", str(port), "--model-id", MODEL,
                                "--budget-mb", str(budget_mb), "--max-queue", "256"], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read()[-3000:]}")
        try:
            if json.loads(urllib.request.urlopen(url + "/health", timeout=1).read())["status"] == "ok":
                return process, url
        except (OSError, ValueError):
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not start in 600 s")


def measure_server(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    gate = threading.Barrier(len(prompts) + 1)

    def one(prompt: list[int]) -> dict:
        gate.wait()
        sent = time.perf_counter()
        first, text, finish = None, [], None
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True):
            first = first or time.perf_counter()
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return {"sent": sent, "first": first, "done": time.perf_counter(), "words": len("".join(text).split()), "finish": finish}

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        gate.wait()
        start = time.perf_counter()
        runs = [f.result() for f in futures]
    seconds = max(r["done"] for r in runs) - start
    assert all(r["finish"] == "length" for r in runs), [r["finish"] for r in runs]
    return {"seconds": seconds, "tokens_per_s": len(prompts) * new_tokens / seconds,
            "first_chunk_s_mean": sum(r["first"] - r["sent"] for r in runs) / len(runs),
            "words_per_completion_min": min(r["words"] for r in runs)}


def measure_python(pte: str, ptd: str, budget_bytes: int, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict:
    with batching.BatchGenerator(pte, ptd, weight_offload_budget_mb=budget_bytes / 2**20, device=device) as b:
        sync()
        start = time.perf_counter()
        out = b.generate(prompts, new_tokens, eos_token_id=[])
        sync()
        seconds = time.perf_counter() - start
    assert all(len(tokens) == new_tokens for tokens in out)
    return {"seconds": seconds, "tokens_per_s": len(prompts) * new_tokens / seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--budget", default="floor", help="floor, or a share of the weights such as 50%%")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    clients = [int(c) for c in args.clients.split(",")]
    result = {"environment": environment(device), "layers": args.layers, "prompt": args.prompt, "new_tokens": args.new_tokens, "budget": args.budget, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    path = result_path(args.out, "serve", device)
    model = llama(args.layers)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, model.config.vocab_size, (max(clients), args.prompt), generator=g).tolist()
    with tempfile.TemporaryDirectory() as folder:
        base = os.path.join(folder, MODEL)
        pte, ptd = batching.export(model, base, max_seq_len=args.prompt + args.new_tokens + 1, max_batch_size=max(clients), prefill_chunk=args.prompt)
        word_tokenizer(model.config.vocab_size, base + ".tokenizer")
        schedules = load_weight_schedules(pte)
        total, floor = schedules["decode"].total_bytes, load_floor_bytes(schedules)
        budget = floor if args.budget == "floor" else max(floor, int(total * float(args.budget.rstrip("%")) / 100))
        result["budget_bytes"] = budget
        for c in clients:
            result["rows"].append({"clients": c, "python": measure_python(pte, ptd, budget, prompts[:c], args.new_tokens, device)})
        process, url = start_server(base, budget / 2**20, device)
        try:
            for row in result["rows"]:
                row["server"] = measure_server(url, prompts[: row["clients"]], args.new_tokens)
                row["server_over_python"] = row["server"]["tokens_per_s"] / row["python"]["tokens_per_s"]
                print(json.dumps(row), flush=True)
                save_result(result, path)
        finally:
            process.terminate()
            process.wait(60)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
