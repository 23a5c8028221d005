"""The ``hostswap`` command: export and run generation, inspect an emitted schedule, run the demo."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def _open_pair(pte: str, ptd: str | None, require_ptd: bool):
    """(program, PtdFile or None) of a ``.pte`` and its ``.ptd`` (default: beside it), checked
    to be one save's pair; raises ArtifactError."""
    import os

    from hostswap.runtime.ptd import open_pair
    from hostswap.schedules.pte_program import read_program, read_program_bytes

    data = read_program_bytes(pte)
    program = read_program(data, pte)
    ptd = ptd or os.path.splitext(pte)[0] + ".ptd"
    if not require_ptd and not os.path.exists(ptd):
        return program, None
    return program, open_pair(pte, data, program, ptd)


def _inspect(args) -> int:
    from hostswap.schedules import ScheduleError
    from hostswap.schedules.artifacts import ArtifactError
    from hostswap.schedules.serialization import decode_program

    try:
        program, weights = _open_pair(args.pte, args.ptd, require_ptd=args.ptd is not None)
        schedules = decode_program(program, args.pte)
        if weights is not None:
            weights.close()
        if args.method is None and len(schedules) != 1:
            raise ScheduleError(f"{args.pte} has schedules for methods {list(schedules)}; name one with --method")
        if args.method is not None and args.method not in schedules:
            raise ScheduleError(f"{args.pte} has no schedule for method '{args.method}' (it has {list(schedules)})")
        schedule = schedules[args.method or next(iter(schedules))]
    except (ArtifactError, ScheduleError) as e:
        print(f"hostswap inspect: {e}", file=sys.stderr)
        return 2
    budget = None if args.budget_mb is None else int(args.budget_mb * 2**20)
    if args.host_budget_mb is not None and (budget is None or args.host_budget_mb < 0):
        print("hostswap inspect: --host-budget-mb needs --budget-mb (the GPU budget decides what is streamed) and a number of MB, 0 or more", file=sys.stderr)
        return 2
    host_budget = None if args.host_budget_mb is None else int(args.host_budget_mb * 2**20)
    if args.expert_host_cache_mb is not None and host_budget is None:
        print("hostswap inspect: --expert-host-cache-mb needs --host-budget-mb (the host memory the streamed weights take beside it)", file=sys.stderr)
        return 2
    try:
        experts_host = _experts_host_tier(schedule, budget, args) if host_budget is not None and schedule.expert_blocks else None
    except ValueError as e:
        print(f"hostswap inspect: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(schedule.to_dict(budget, host_budget, experts_host), indent=2))
    else:
        print(schedule.table(budget, host_budget, experts_host))
    if args.plot:
        schedule.plot(args.plot, budget)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _experts_host_tier(schedule, budget: int, args) -> dict | None:
    """Where the routed experts' tables would be in host memory (runtime/host_tier.py), "auto"
    counting this machine's RAM now, as plain data for the schedule's views. The budget is
    split as the rest of the report splits it (the scratch of a device that gathers picks)."""
    from hostswap.runtime.host_tier import plan_placement

    if budget < schedule.load_floor_bytes:
        return None  # the report says it does not load
    # the pool's and the resident experts' share, as a Module's
    _, _, tiers, plan = plan_placement(schedule, budget - schedule.expert_scratch_bytes, True, args.host_budget_mb, args.expert_host_cache_mb or "auto")
    return {"on_disk": plan.on_disk, "table_bytes": plan.table_bytes, "host_cache_bytes": plan.cache_bytes, "pinned_bytes": plan.pinned_bytes,
            "slots_per_block": dict(plan.slots), "host_read_bytes": tiers.host_read_bytes, "explain": plan.explain()}


def _verify(args) -> int:
    from hostswap.runtime.ptd import verify_showing_progress
    from hostswap.schedules.artifacts import ArtifactError

    try:
        _, weights = _open_pair(args.pte, args.ptd, require_ptd=True)
        with weights:
            nbytes, seconds = verify_showing_progress(weights)
    except ArtifactError as e:
        print(f"hostswap verify: {e}", file=sys.stderr)
        return 1
    print(f"{weights.path}: {len(weights.entries)} weights, {nbytes / 2**30:.2f} GiB match their checksums and {args.pte} "
          f"({seconds:.2f} s, {nbytes / max(seconds, 1e-9) / 1e9:.1f} GB/s)")
    return 0


def _demo(args) -> int:
    from hostswap.demo import run_demo

    return run_demo(out_dir=args.out, budget_factor=args.budget_factor, device=args.device)


# a Hugging Face hub repository name, which export-llm loads (downloading it) where no folder has
# that name; any other name that is no folder is a mistyped path, refused before the hub is asked
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _export_llm(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    import hostswap.llm as llm

    def say(message: str) -> None:
        print(f"[hostswap export-llm] {message}", file=sys.stderr, flush=True)

    from hostswap.checkpoint import export_checkpoint, has_safetensors

    speculate_k = args.speculate_k if args.speculate_k is not None else (4 if args.draft else None)
    if not os.path.isdir(args.checkpoint) and not HUB_NAME.fullmatch(args.checkpoint):
        print(f"hostswap export-llm: no checkpoint folder at {args.checkpoint} (a folder with the model's config.json and weights, "
              "or a Hugging Face hub name, owner/model)", file=sys.stderr)
        return 2
    if args.out.endswith(("/", os.sep)) or os.path.isdir(args.out):
        print(f"hostswap export-llm: --out is a path prefix (it writes <out>.pte, <out>.ptd, <out>.tokenizer), and {args.out} names a folder: "
              f"give a name in it, e.g. {os.path.join(args.out, 'model')}", file=sys.stderr)
        return 2
    if args.draft and args.quantize:
        print("hostswap export-llm: --draft quantizes a copy of the full-precision weights; export the target without --quantize", file=sys.stderr)
        return 2
    if args.tensor_parallel is not None and (args.draft or args.speculate_k):
        print("hostswap export-llm: --tensor-parallel cannot be combined with --draft or --speculate-k yet", file=sys.stderr)
        return 2
    try:
        if has_safetensors(args.checkpoint) and not args.in_memory:
            # streamed from the shards, one tensor at a time (quantized as it is written): no model in memory
            pte, ptd = export_checkpoint(args.checkpoint, args.out, max_seq_len=args.max_seq_len, prefill_chunk=args.prefill_chunk,
                                         long_prefill_chunk=args.long_prefill_chunk,
                                         dtype=args.dtype, progress=say, show_bar=sys.stderr.isatty(), quantize=args.quantize,
                                         max_batch_size=args.max_batch_size, speculate_k=speculate_k, tensor_parallel=args.tensor_parallel)
            if args.draft:
                say(f"writing the draft: the same checkpoint quantized to {args.draft}, to {args.out}.draft")
                export_checkpoint(args.checkpoint, args.out + ".draft", max_seq_len=args.max_seq_len, prefill_chunk=args.prefill_chunk,
                                  long_prefill_chunk=args.long_prefill_chunk, dtype=args.dtype, progress=say, quantize=args.draft, fuse_linears=True)
        else:
            why = "--in-memory" if args.in_memory else "the checkpoint has no safetensors shards to stream"
            say(f"loading {args.checkpoint} into memory ({why})")
            try:
                model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype) if args.dtype else "auto")
            except (OSError, ValueError) as e:
                print(f"hostswap export-llm: cannot load {args.checkpoint}: {e}", file=sys.stderr)
                return 2
            if args.quantize:
                say(f"quantizing the weights to {args.quantize} (torchao, weight-only)")
                llm.quantize(model, args.quantize)
            if args.draft:  # quantized from a copy, before the target is exported (export changes the model in place)
                import copy

                say(f"writing the draft: the same weights quantized to {args.draft}, to {args.out}.draft")
                draft = llm.quantize(copy.deepcopy(model), args.draft)
                llm.export(draft, args.out + ".draft", max_seq_len=args.max_seq_len, prefill_chunk=args.prefill_chunk,
                           long_prefill_chunk=args.long_prefill_chunk, progress=say, fuse_linears=True)
            pte, ptd = llm.export(model, args.out, max_seq_len=args.max_seq_len, prefill_chunk=args.prefill_chunk,
                                  long_prefill_chunk=args.long_prefill_chunk, progress=say,
                                  max_batch_size=args.max_batch_size, speculate_k=speculate_k, tensor_parallel=args.tensor_parallel)
    except (llm.GenerationError, OSError) as e:  # OSError: a full disk (DiskFullError names the file), an unwritable folder
        print(f"hostswap export-llm: {e}", file=sys.stderr)
        return 2
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.checkpoint).save_pretrained(args.out + ".tokenizer")
        say(f"tokenizer saved to {args.out}.tokenizer")
    except (OSError, ValueError):
        say("the checkpoint has no tokenizer: give prompts with --prompt-ids")
    print("\n".join([*pte, *ptd]) if args.tensor_parallel is not None else f"{pte}\n{ptd}")
    return 0


COMPILED_HELP = ("run decode as one TorchInductor graph: fewer, fused kernels, for a budget that holds every weight but the routed "
                 "experts (the first load compiles)")
EXPERT_PREFETCH_HELP = ("MoE: each block with an expert cache prefetches the top-k the block before it predicts, at most N of them missing "
                        "(default 0: none; pays where experts are small, see docs/design.md)")
EXPERT_CACHE_POLICY_HELP = ("MoE: which expert a device cache, or a host cache of experts on disk, evicts: lfu (default), the one "
                            "picked (a host cache: asked for) least often lately, or lru, the least recently used")
EXPERT_HOST_CACHE_HELP = ("MoE: pinned host memory for experts read from the .ptd on disk (MB), or auto (the default): the expert tables stay "
                          "pinned where the RAM available at load holds them besides the other weights, else they are read from disk "
                          "into a cache of what it leaves")


def _long_chunk(text: str):
    """``--long-prefill-chunk``: a number of tokens, ``auto``, or 0 for none."""
    if text == "auto":
        return text
    try:
        tokens = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of tokens, 'auto' or 0 (none), got {text!r}") from None
    return None if tokens == 0 else tokens


def _budget_mb(text: str):
    """--budget-mb: "auto" or a number of MB."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of MB or auto, got {text!r}") from None


def _pinned_bandwidth(device) -> float:
    """Pinned host-to-device bytes per second on ``device``, from one 256 MiB copy after a warm-up."""
    import torch

    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return src.numel() / (start.elapsed_time(end) / 1e3)


def _generate(args) -> int:

    import torch

    import hostswap.llm as llm
    from hostswap.text_stream import TokenPrinter

    base = args.program[:-4] if args.program.endswith(".pte") else args.program
    from hostswap.tensor_parallel import TensorParallelError, rank_program

    try:
        program, rank, device = rank_program(base, args.device)
    except (TensorParallelError, RuntimeError) as e:
        print(f"hostswap generate: {e}", file=sys.stderr)
        return 2
    shown = rank == 0  # under torchrun every rank generates the same tokens; rank 0 shows them
    if not os.path.isfile(program + ".pte"):
        print(f"hostswap generate: no program at {program}.pte: give the path prefix export-llm wrote (its --out)", file=sys.stderr)
        return 2
    if args.speculate_k is not None and args.draft is None:
        print("hostswap generate: --speculate-k sets the draft's tokens per round: give --draft too", file=sys.stderr)
        return 2
    tokenizer = None
    if args.prompt_ids is None:
        if args.prompt is None:
            print("hostswap generate: give --prompt (with a tokenizer saved by export-llm) or --prompt-ids", file=sys.stderr)
            return 2
        try:
            from transformers import AutoTokenizer

            if not os.path.isdir(base + ".tokenizer"):  # a name that is no folder would be looked up on the Hugging Face hub
                raise OSError(base + ".tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(base + ".tokenizer")
        except (OSError, ValueError):
            print(f"hostswap generate: no tokenizer at {base}.tokenizer: give --prompt-ids 1,2,3", file=sys.stderr)
            return 2
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        try:
            ids = torch.tensor([[int(t) for t in args.prompt_ids.split(",") if t.strip()]], dtype=torch.long)
        except ValueError:
            print(f"hostswap generate: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}", file=sys.stderr)
            return 2
    from hostswap.schedules.pte_program import constant_method_outputs, read_program

    try:  # before a load, which for a large model takes minutes
        max_seq_len = (constant_method_outputs(read_program(program + ".pte"), llm.MAX_SEQ_LEN) or [None])[0]
    except (OSError, ValueError):
        max_seq_len = None  # the load names what is wrong with the file
    if max_seq_len is not None and ids.shape[1] + args.max_new_tokens > max_seq_len:
        print(f"hostswap generate: the prompt ({ids.shape[1]} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds the program's "
              f"max_seq_len={max_seq_len}: ask for at most {max(0, max_seq_len - ids.shape[1])} new tokens, or export with a larger --max-seq-len",
              file=sys.stderr)
        return 2
    from hostswap.sampling import SamplingError, SamplingParams

    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                                  seed=args.seed)
    except SamplingError as e:
        print(f"hostswap generate: {e}", file=sys.stderr)
        return 2
    try:
        draft = args.draft
        if draft is not None and draft == "":  # --draft alone: the one export-llm --draft wrote beside the program
            draft = base + ".draft"
        with llm.Generator(program + ".pte", program + ".ptd", weight_offload_budget_mb=args.budget_mb, host_memory_budget_mb=args.host_budget_mb,
                           device=device, policy=args.policy, draft=draft, speculate_k=args.speculate_k if draft else None,
                           draft_ahead=args.draft_ahead, expert_prefetch=args.expert_prefetch, compiled=(llm.DECODE,) if args.compiled else False,
                           expert_host_cache_mb=args.expert_host_cache_mb, expert_cache_policy=args.expert_cache_policy) as g:
            print(f"loaded{f' rank {rank}' if g.tensor_parallel else ''}: {g.memory_report()}", file=sys.stderr, flush=True)
            if tokenizer is not None and shown:
                print(args.prompt, end="", flush=True)
            printer = TokenPrinter(tokenizer.decode if tokenizer else None, ids[0].tolist()) if shown else None
            g.generate(ids, args.max_new_tokens, sampling=sampling, on_token=printer)
            if not shown:
                return 0
            printer.finish()
            print()
            line = g.summary()
            if g.last_speculation is not None:
                spec = g.last_speculation
                line += (f"; speculative: {spec.tokens_per_pass:.2f} tokens per weight pass, {100 * (spec.acceptance or 0):.0f} % of "
                         f"{spec.drafted} drafted tokens accepted (draft {spec.draft_seconds:.2f} s, verify {spec.verify_seconds:.2f} s"
                         + (f"; {spec.ahead_rounds} of {spec.passes} rounds drafted during the pass before" if g.draft_ahead else "") + ")")
            per_token = g.stats["bytes_streamed_per_token"]
            if device.type == "cuda" and per_token:
                bound = per_token / _pinned_bandwidth(device) * 1e3
                line += f"; bound {bound:.2f} ms/token (streamed bytes / pinned H2D{'; disk reads not counted' if g.stats['bytes_from_disk_per_token'] else ''})"
            print(line, file=sys.stderr)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"hostswap generate: {e}", file=sys.stderr)
        return 2
    return 0


def _serve(args) -> int:
    import torch

    try:
        from hostswap.server import serve
    except ImportError as e:
        print(f"hostswap serve needs FastAPI and uvicorn ({e}): pip install 'hostswap[serve]'", file=sys.stderr)
        return 2
    base = args.program[:-4] if args.program.endswith(".pte") else args.program
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def ready(generator) -> None:
        print(f"hostswap serve: {base} on {device} at http://{args.host}:{args.port}/v1 (model '{args.model_id or os.path.basename(base)}'); "
              + generator.memory_report().replace("\n", "; "), file=sys.stderr, flush=True)

    try:
        serve(base, budget_mb=args.budget_mb, device=device, host=args.host, port=args.port, api_key=args.api_key or os.environ.get("HOSTSWAP_API_KEY"),
              max_queue=args.max_queue, model_id=args.model_id, on_ready=ready, expert_prefetch=args.expert_prefetch, compiled=args.compiled,
              expert_host_cache_mb=args.expert_host_cache_mb, expert_cache_policy=args.expert_cache_policy)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"hostswap serve: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    from hostswap.runtime.expert_cache import DEFAULT_POLICY, POLICIES

    parser = argparse.ArgumentParser(prog="hostswap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print the weight schedule stored in a .pte")
    p.add_argument("pte")
    p.add_argument("--ptd", help="the weights file to check the program against (default: the .ptd beside the .pte, if there is one)")
    p.add_argument("--method", help="the method whose schedule to show (a program with several, e.g. decode)")
    p.add_argument("--budget-mb", type=float, help="also tell whether this budget loads and what each policy streams")
    p.add_argument("--host-budget-mb", type=float, help="with --budget-mb: also place each streamed weight in pinned host memory or on disk "
                   "within this many MB of pinned weights, as generate --host-budget-mb does")
    p.add_argument("--expert-host-cache-mb", type=_budget_mb,
                   help="with --host-budget-mb: the routed experts' host slots, as generate takes it (default auto: what this machine's RAM leaves now)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--plot", metavar="FILE", help="draw weight bytes per kernel with floor and budget lines (.png or .svg)")
    p.set_defaults(func=_inspect)
    v = sub.add_parser("verify", help="check every weight byte of a .ptd against the checksums hostswap.save recorded")
    v.add_argument("pte")
    v.add_argument("ptd", nargs="?", help="default: the .ptd beside the .pte")
    v.set_defaults(func=_verify)
    e = sub.add_parser("export-llm", help="write a transformers causal LM as a prefill/decode program with a KV cache, streamed from its shards")
    e.add_argument("checkpoint", help="a local transformers checkpoint folder (or a hub name)")
    e.add_argument("--out", required=True, help="path prefix: writes <out>.pte, <out>.ptd and <out>.tokenizer/")
    e.add_argument("--max-seq-len", type=int, required=True, help="KV cache positions: prompt plus new tokens")
    e.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill call (default: 128, or --max-seq-len where that is shorter)")
    e.add_argument("--long-prefill-chunk", type=_long_chunk, default="auto",
                   help="tokens per call of a second prefill method for long prompts, each call one pass over the streamed weights "
                        "(default: 512 where --max-seq-len is at least that and --prefill-chunk shorter; 0: none)")
    e.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="the weights' dtype in the program (default: the checkpoint's)")
    e.add_argument("--in-memory", action="store_true", help="load the model into memory and export it (default: stream the safetensors shards, "
                   "one tensor at a time)")
    e.add_argument("--quantize", choices=["int8", "int4"], help="torchao weight-only quantization of the linear layers before export (int4: torchao's tinygemm layout; "
                   "needs a CUDA GPU and bf16 weights, --dtype bfloat16)")
    e.add_argument("--max-batch-size", type=int, default=None, help="a KV cache of this many slots: serve decodes that many sequences per weight pass, "
                   "each at its own position (default: one sequence)")
    e.add_argument("--speculate-k", type=int, default=None, help="add a verify method that checks this many drafted tokens in one pass (generate --draft)")
    e.add_argument("--draft", choices=["int8", "int4"], help="also write <out>.draft: the same checkpoint quantized, as a draft held on the device "
                   "(implies --speculate-k 4 unless given)")
    e.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="write one program and .ptd per rank of N, each with its shard of the weights, for torchrun --nproc-per-node N "
                        "-m hostswap.cli generate")
    e.set_defaults(func=_export_llm)
    g = sub.add_parser("generate", help="stream greedy tokens from a program written by export-llm")
    g.add_argument("program", help="the path prefix given to export-llm (or its .pte)")
    g.add_argument("--budget-mb", type=_budget_mb, default="auto",
                   help="GPU memory for weights (MB), or auto (the default): the free memory less the KV cache, the activations and a margin, "
                        "capped at the weights' total; a number below the floor fails with the minimum")
    g.add_argument("--host-budget-mb", type=_budget_mb, default="auto",
                   help="pinned host memory for streamed weights (MB), or auto (the default): 75%% of the RAM available at load; "
                        "weights beyond it are read from the .ptd on disk ahead of their copies (0: all of them)")
    g.add_argument("--prompt", help="text, encoded with the tokenizer export-llm saved")
    g.add_argument("--prompt-ids", help="comma-separated token ids, for a program without a tokenizer")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy; above 0: sample, on the device")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens whose probabilities reach p")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="above 1: tokens already in the text become less likely")
    g.add_argument("--seed", type=int, default=None, help="the same seed samples the same tokens")
    g.add_argument("--draft", nargs="?", const="", default=None, metavar="PREFIX",
                   help="decode speculatively with this draft program, held on the device (alone: the draft export-llm --draft wrote beside the program)")
    g.add_argument("--speculate-k", type=int, default=None, help="tokens the draft proposes per round (default: all the program's verify method checks)")
    g.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="with --draft, greedy: draft the next round while each verify pass streams the weights (default: on a GPU)")
    g.add_argument("--policy", choices=["planned", "lru"], default="planned")
    g.add_argument("--expert-prefetch", type=int, default=0, metavar="N", help=EXPERT_PREFETCH_HELP)
    g.add_argument("--expert-cache-policy", choices=list(POLICIES), default=DEFAULT_POLICY, help=EXPERT_CACHE_POLICY_HELP)
    g.add_argument("--expert-host-cache-mb", type=_budget_mb, default="auto", help=EXPERT_HOST_CACHE_HELP)
    g.add_argument("--compiled", action="store_true", help=COMPILED_HELP)
    g.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    g.set_defaults(func=_generate)
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) over a program written by export-llm")
    sv.add_argument("program", help="the path prefix given to export-llm (or its .pte); its tokenizer is read from <program>.tokenizer")
    sv.add_argument("--budget-mb", type=_budget_mb, default="auto", help="GPU memory for weights (MB), or auto (the default), as generate takes it")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on /v1 routes (default: $HOSTSWAP_API_KEY, else none)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests that may wait for their turn; more are answered 429 (default 64)")
    sv.add_argument("--model-id", help="the model name clients send (default: the program's file name)")
    sv.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    sv.add_argument("--expert-prefetch", type=int, default=0, metavar="N", help=EXPERT_PREFETCH_HELP)
    sv.add_argument("--expert-cache-policy", choices=list(POLICIES), default=DEFAULT_POLICY, help=EXPERT_CACHE_POLICY_HELP)
    sv.add_argument("--expert-host-cache-mb", type=_budget_mb, default="auto", help=EXPERT_HOST_CACHE_HELP)
    sv.add_argument("--compiled", action="store_true", help=COMPILED_HELP)
    sv.set_defaults(func=_serve)
    d = sub.add_parser("demo", help="streamed generation with a built-in random-weight transformers Llama (no downloads)")
    d.add_argument("--out", default="out", help="folder for demo.pte / demo.ptd (default: out)")
    d.add_argument("--budget-factor", type=float, default=1.5, help="budget as a multiple of the floor (default 1.5)")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    d.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
