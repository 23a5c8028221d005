"""FSDP2 training with hostswap's optimizer offloads against FSDP2's own CPUOffloadPolicy.

    python bench/fsdp.py --gpus 2                     # launches itself under torch.distributed.run
    python bench/fsdp.py --gpus 2 --device cpu --layers 1 --hidden 128 --steps 2   # the paths, on gloo

A transformers Llama (random init, fp32 masters sharded by ``fully_shard`` per decoder layer,
bf16 compute through ``MixedPrecisionPolicy``) trains on random tokens, one configuration
after another in the same processes:

- ``AdamW``: FSDP2 with ``torch.optim.AdamW`` on the GPU shards (parameters, gradients and
  moments all on the GPU);
- ``CPUOffloadPolicy``: FSDP2's own offload: sharded parameters, gradients and the optimizer
  step on the host (``torch.optim.AdamW`` on CPU tensors);
- ``OffloadAdamW``: moments in pinned host memory, the update on the GPU chunk by chunk;
- ``OffloadAdamW + offload_grads``: the reduce-scattered gradient shards go to pinned host
  memory as they are made;
- the same with bf16 shards on the GPU and their fp32 masters in host memory
  (``offload_master``): the GPU keeps only the bf16 working weights;
- ``CPUOffloadPolicy + offload_quants``: FSDP2's offload, each Linear shard with a persistent
  int8 (or float8) copy in pinned host memory that its all-gathers send instead of the fp32
  master (hostswap/fsdp_quants.py): a quarter of the bytes over the link, half of bf16's
  between the ranks.

Each row: the median step time (forward, backward and optimizer step) of ``--steps`` steps after
two warm-up steps, tokens/s over all GPUs, and the peak GPU memory of a step on rank 0 (and the
largest over ranks; each above what was allocated before the configuration's model was built), with the peak of forward and backward and what stays allocated after the
backward (read after a synchronization between backward and step, which the timed steps share). Losses of the first steps are compared with ``AdamW``'s. Rows go to
``bench/results/fsdp_<device>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from weights import add_row, environment, result_path  # noqa: E402

MASTERS = "OffloadAdamW, bf16 shards, fp32 masters on the host + offload_grads"
QUANTS = {"CPUOffloadPolicy + offload_quants int8": "int8", "CPUOffloadPolicy + offload_quants float8": "float8"}
CONFIGS = ("AdamW", "CPUOffloadPolicy", "OffloadAdamW", "OffloadAdamW + offload_grads", MASTERS, *QUANTS)


def build(args, config: str, device: torch.device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from hostswap.optim import OffloadAdamW

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75), num_hidden_layers=args.layers,
                      num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=max(1, args.hidden // 512),
                      max_position_embeddings=args.seq, bos_token_id=None, eos_token_id=None)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)  # fp32: the masters FSDP2 shards
    if config == MASTERS:
        model.to(torch.bfloat16)  # the shards on the GPU are bf16; OffloadAdamW keeps their fp32 masters
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options = {"mesh": mesh}
    if device.type == "cuda":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    quants = None
    if config in QUANTS:  # each Linear shard's int8/float8 copy on the host is what goes to the GPU and between ranks
        from hostswap.fsdp_quants import offload_quants

        quants = offload_quants(model, QUANTS[config])
    if config.startswith("CPUOffloadPolicy"):
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    params = list(model.parameters())
    if config.startswith("OffloadAdamW"):
        opt = OffloadAdamW(params, lr=1e-4, weight_decay=0.1, offload_grads=config.endswith("offload_grads"), offload_master=config == MASTERS)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)
    return model, opt, sum(p.numel() for p in params), quants


def run_rank(args) -> None:
    import torch.distributed as dist

    from hostswap.optim import _local
    from hostswap.tensor_parallel import init_from_environment

    rank, world = init_from_environment(args.device)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank)).to(device)
    rows = []
    for config in CONFIGS:
        gc.collect()  # the last configuration's model and optimizer: FSDP2's modules hold reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # whatever outlived it
        model, opt, params, quants = build(args, config, device)
        losses, times, memory = [], [], []
        cuda = device.type == "cuda"
        for step in range(args.steps + 2):
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            dist.barrier()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if cuda and step >= 2:  # untimed steps only: the synchronization would stall the step
                torch.cuda.synchronize(device)
                backward_peak, after_backward = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
                grads_on_gpu = sum(_local(g).numel() * g.element_size() for g in (p.grad for p in model.parameters()) if g is not None and g.is_cuda)
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize(device)
                if step >= 2:
                    memory.append((backward_peak - baseline, after_backward - baseline, torch.cuda.max_memory_allocated(device) - baseline, grads_on_gpu))
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        seconds = statistics.median(times[2:])
        peak = max(m[2] for m in memory) if memory else None
        everyone = [None] * world
        dist.all_gather_object(everyone, peak)
        gib = lambda i: max(m[i] for m in memory) / 2**30 if memory else None  # noqa: E731
        rows.append({"configuration": config, "gpus": world, "parameters": params, "step_s": seconds,
                     "tokens_per_s": args.batch * args.seq * world / seconds,
                     "peak_gib_rank0": peak / 2**30 if peak else None, "peak_gib_max": max(everyone) / 2**30 if peak else None,
                     "backward_peak_gib_rank0": gib(0), "after_backward_gib_rank0": gib(1), "gradients_on_gpu_gib_rank0": gib(3),
                     "host_gib": (getattr(opt, "host_bytes", 0) + (quants.host_bytes if quants else 0)) / 2**30, "losses": losses,
                     **({"quantized_gib_to_gpu_per_step": quants.bytes_h2d / (args.steps + 2) / 2**30,
                         "quantizations_per_step": quants.quantizations / (args.steps + 2)} if quants else {})})
        del model, opt
    if rank == 0:
        with open(args.rows, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2, help="processes (one per GPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_run:
        run_rank(args)
        # its rows are written and its process group destroyed: skip the interpreter's teardown,
        # where a native thread left joinable (in a library, not here) now and then aborts the
        # rank ("terminate called without an active exception", no Python frame) and fails the run
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    device = torch.device(args.device)
    path = result_path(args.out, "fsdp", device)
    result = {"benchmark": "fsdp", "environment": environment(device), "rows": [],
              "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "batch": args.batch, "seq": args.seq, "steps": args.steps}}
    rows_file = os.path.join(args.out, ".fsdp_rows.json")
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in ("device", "layers", "hidden", "vocab", "batch", "seq", "steps")]
    # --standalone: a free rendezvous port, so that two runs on one machine never meet;
    # PYTHONFAULTHANDLER: a rank that aborts in C++ prints where its Python stood
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
                          os.path.abspath(__file__), "--rank-run", "--rows", rows_file, *passed], capture_output=True, text=True,
                         env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    if run.returncode != 0:
        add_row(result, {"gpus": args.gpus, "error": run.stderr[-8000:]}, path)
        return 1
    with open(rows_file) as f:
        rows = json.load(f)
    os.remove(rows_file)
    reference = rows[0]
    for row in rows:
        row["speedup_over_cpu_offload_policy"] = row["tokens_per_s"] / next(r for r in rows if r["configuration"] == "CPUOffloadPolicy")["tokens_per_s"]
        row["max_loss_diff_vs_adamw"] = max(abs(a - b) for a, b in zip(row["losses"], reference["losses"]))
        add_row(result, row, path, shown={k: v for k, v in row.items() if k != "losses"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
