"""Dense Llama-shaped bf16 checkpoints of a given size, written straight to safetensors shards.

For the export benchmark (bench/export.py) and the tests: ``config.json`` of a transformers
``LlamaConfig``, ``model-0000i-of-0000n.safetensors`` shards of at most ``shard_bytes`` and
``model.safetensors.index.json``, as ``save_pretrained`` lays them out, without building the
model. Each tensor's bytes are a window, at a random offset, of one pool of random bf16 values
(normal, std 0.02) and go to the file straight from the pool: memory holds the pool and one
shard's header, nothing is computed per byte, and the shards are written by parallel threads,
so the writing runs at the disk's speed.

    llama3_8b()            # hidden 4096, 32 layers, GQA 32/8, vocab 128256: 16.06 GB
    llama_of_size(2e9)     # a smaller Llama shape, its layers chosen to come near 2 GB
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192)
# (hidden, intermediate, heads, kv heads, vocab) of Llama shapes, largest first
SHAPES = ((4096, 14336, 32, 8, 128256), (2048, 5632, 32, 8, 32000), (1024, 2816, 16, 4, 32000), (512, 1376, 8, 2, 8192), (256, 688, 4, 2, 2048))
POOL_BYTES = 64 * 2**20


def _config(**fields):
    from transformers import LlamaConfig

    return LlamaConfig(**{"max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "bfloat16", **fields})


def llama3_8b():
    """Llama 3 8B's shape (hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads,
    vocab 128256): 8.03 B parameters, 16.06 GB in bf16."""
    return _config(**LLAMA3_8B)


def _parameters(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> tuple[int, int]:
    """(parameters outside the layers: embedding, head and final norm; parameters of one layer)."""
    head_dim = hidden // heads
    layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate + 2 * hidden
    return 2 * vocab * hidden + hidden, layer


def llama_of_size(nbytes: float):
    """A Llama config of about ``nbytes`` in bf16: the largest of SHAPES whose embedding and
    head take at most half of it, with the layers that come nearest (at least one)."""
    for shape in SHAPES:
        outside, layer = _parameters(*shape)
        if 2 * outside <= nbytes / 2 or shape == SHAPES[-1]:
            break
    hidden, intermediate, heads, kv_heads, vocab = shape
    layers = max(1, round((nbytes / 2 - outside) / layer))
    return _config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads)


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors (name -> shape) in the model's order: what ``save_pretrained``
    writes for ``config``'s model (its parameters, a tied one once)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def checkpoint_bytes(config) -> int:
    """The bytes of ``config``'s checkpoint in bf16 (its tensors' data, the headers aside)."""
    return sum(math.prod(shape) * 2 for shape in tensor_shapes(config).values())


def _pool(seed: int) -> memoryview:
    values = (torch.randn(POOL_BYTES // 2, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    return memoryview(values.view(torch.uint8).numpy())


def _write_shard(path: str, tensors: list[tuple[str, tuple[int, ...]]], pool: memoryview, seed: int, sync: bool) -> None:
    """One safetensors file: the 8-byte little-endian header length, the JSON header (padded
    with spaces to 8 bytes, as the safetensors library does), then each tensor's bytes in the
    header's order, back to back."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    rng = random.Random(seed)
    with open(path, "wb", buffering=0) as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, shape in tensors:
            left, at = math.prod(shape) * 2, rng.randrange(len(pool) // 2) * 2  # whole bf16 values
            while left:
                piece = pool[at : at + left]
                f.write(piece)
                left -= len(piece)
                at = 0
        if sync:
            os.fsync(f.fileno())


def write_checkpoint(folder: str | os.PathLike, config, *, shard_bytes: float = 4e9, seed: int = 0, threads: int = 8, sync: bool = True) -> dict:
    """Write ``config``'s model as a random bf16 safetensors checkpoint in ``folder`` (created):
    config.json, shards of at most ``shard_bytes`` (a larger tensor gets one of its own) and
    the index. ``sync``: each shard is fsynced before it counts as written. Returns what was
    written: bytes, tensors, shards, the largest tensor's bytes and the seconds it took."""
    folder = os.fspath(folder)
    os.makedirs(folder)
    start = time.perf_counter()
    config.dtype = torch.bfloat16  # the shards hold bf16: the config says so, as a real checkpoint's does
    config.save_pretrained(folder)
    shapes = tensor_shapes(config)
    shards, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    pool = _pool(seed)
    with ThreadPoolExecutor(max(1, min(threads, len(shards)))) as workers:
        for done in [workers.submit(_write_shard, os.path.join(folder, name), tensors, pool, seed + i, sync)
                     for i, (name, tensors) in enumerate(zip(names, shards))]:
            done.result()
    total = sum(math.prod(s) * 2 for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": {t: name for name, tensors in zip(names, shards) for t, _ in tensors}}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return {"bytes": total, "tensors": len(shapes), "shards": len(shards), "largest_tensor_bytes": max(math.prod(s) * 2 for s in shapes.values()),
            "layers": config.num_hidden_layers, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "seconds": time.perf_counter() - start}
