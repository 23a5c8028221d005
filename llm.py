"""Streamed text generation with a transformers causal LM: one program, a KV cache on the GPU.

``export`` turns a transformers ``*ForCausalLM`` into one ExecuTorch program whose methods
read the same ``.ptd``: ``prefill`` (a chunk of ``prefill_chunk`` tokens), for long prompts
``prefill_long`` (a chunk of ``long_prefill_chunk``), and ``decode`` (one token). The KV
cache is program state: a static cache of ``max_seq_len`` positions that every method
updates, kept on the device across calls and outside the weight budget. ``Generator`` loads
the program with one weight pool for every method and generates
greedily, as transformers' ``generate(do_sample=False)`` does with the same static cache.

Prefill takes fixed chunks, not a dynamic length: the runtime plans every activation at load
for fixed shapes, and a fixed shape can be captured in a CUDA graph. A prompt is prefilled
chunk by chunk, each call taking the shortest chunk that holds the rest of the prompt, else
the longest (hostswap/prefill_chunks.py); its last chunk is padded, and the padding's cache slots, all after the last
prompt token, are masked out and then overwritten by decode.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import torch

from hostswap import kv_shapes
from hostswap.prefill_chunks import AUTO, PREFILL_LONG, ChunkError, long_prefill_chunk_for, padded, prefill_calls
from hostswap.sampling import SamplingParams, TokenChooser, check_drawn, warm_up_sampling

PREFIX = "hostswap_llm_"
MAX_SEQ_LEN = PREFIX + "max_seq_len"
PREFILL_CHUNK = PREFIX + "prefill_chunk"
LONG_PREFILL_CHUNK = PREFIX + "long_prefill_chunk"  # the tokens ``prefill_long`` takes, where the program has it
EOS_TOKEN_IDS = PREFIX + "eos_token_ids"
VOCAB_SIZE = PREFIX + "vocab_size"
SPECULATE_K = PREFIX + "speculate_k"
MAX_BATCH_SIZE = PREFIX + "max_batch_size"  # a batched program's slots (hostswap/batching.py)
PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"
DEFAULT_PREFILL_CHUNK = 128  # the most tokens a prefill call takes unless asked (less where max_seq_len is shorter)


class GenerationError(ValueError):
    """A model, program or request that generation cannot serve; the message names it."""


def prepare_for_export(model) -> None:
    """Ready a transformers causal LM for tracing, in place: on the CPU (or meta), eval, its
    torchao linears and MoE experts swapped for hostswap's kernels, the cache on, sdpa."""
    if not hasattr(model, "generation_config") or not hasattr(model, "config"):
        raise GenerationError(f"hostswap.llm.export takes a transformers causal LM (a *ForCausalLM), got {type(model).__name__}")
    model.eval()
    if any(t.device.type not in ("cpu", "meta") for t in (*model.parameters(), *model.buffers())):
        model.cpu()  # a program's weights live in host memory: it is exported from there
    from hostswap.passes.quantized_linear import prepare_quantized

    prepare_quantized(model)  # torchao quantized linears: one kernel reads each weight's packed data and scales
    from hostswap.experts import route_experts

    route_experts(model)  # MoE experts: a kernel that reads only the experts the router picks
    model.config.use_cache = True
    if "head_dim" in vars(model.config) and model.config.head_dim is None:
        # attention computes it (Mixtral's config leaves it None); transformers' static cache reads the attribute as given
        model.config.head_dim = model.config.hidden_size // model.config.num_attention_heads
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")


def static_cache_wrapper(model, max_seq_len: int):
    """transformers' exportable decoder with a static cache of ``max_seq_len`` positions, each
    layer's sized as its attention writes it (hostswap/kv_shapes.py)."""
    prepare_for_export(model)
    return _exportable(model, max_seq_len)


def cache_shapes(model) -> list[kv_shapes.LayerCacheShape]:
    """Per layer of ``model`` (ready for export: ``prepare_for_export``), the heads and widths
    its attention caches per position."""
    return kv_shapes.layer_shapes(_exportable(model, 1).model)


def _exportable(model, max_seq_len: int):
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    config = model.generation_config
    # what the wrapper reads, when it is made, of the cache to build; the model's own after
    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static", max_length=max_seq_len,
        cache_config={"batch_size": 1, "max_cache_len": max_seq_len},
        eos_token_id=config.eos_token_id, bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
    )
    try:
        wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_seq_len)
    except (ValueError, AssertionError, TypeError, AttributeError) as e:
        raise GenerationError(f"{type(model).__name__} has no static-cache export in transformers: {e}") from e
    finally:
        model.generation_config = config
    kv_shapes.fit(wrapper.model, next(model.parameters()).device)  # the config's head shapes are not every attention's
    return wrapper


INT4_GROUP_SIZE = 128
QUANTIZATION_SCHEMES = ("int4", "int8")  # what quantize() applies


def quantize(model, scheme: str):
    """torchao weight-only quantization of ``model``'s linear layers, in place; returns the model.

    ``int8``: ``Int8WeightOnlyConfig()``, on the device the model is on (CPU or CUDA).
    ``int4``: ``Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")``,
    int4 packed for PyTorch's own tinygemm kernel (``aten._weight_int4pack_mm``), the int4
    layout of torchao that needs no other package (its default, "plain", and "preshuffled" run
    on mslk kernels). It packs and runs on CUDA only (compute capability 8.0 and newer) and
    takes bf16 weights: each linear is moved to the GPU, quantized and moved back, so a model on
    the CPU stays there and the GPU holds one bf16 weight at a time. Linears whose input
    features are not a multiple of 128 stay unquantized (torchao skips them); the tinygemm
    layout pads input features to a multiple of 1024. Both leave torch.compile's settings alone
    (``set_inductor_config=False``): the program runs torchao's eager kernels, except int8
    decode rows on CUDA, which run ``kernels/int8_weight_only.py``."""
    from torchao.quantization import quantize_

    if scheme not in QUANTIZATION_SCHEMES:
        raise GenerationError(f"quantization must be one of {list(QUANTIZATION_SCHEMES)}, got {scheme!r}")
    cannot = f"torchao cannot quantize this model to {scheme} here"
    if scheme == "int8":
        try:
            quantize_(model, int8_config())
        except (ImportError, NotImplementedError, RuntimeError, ValueError) as e:
            raise GenerationError(f"{cannot}: {type(e).__name__}: {e}") from e
        return model
    linears, config = int4_plan(model, cannot)
    quantize_each(linears, config, int4_device(cannot), quantize_, cannot)
    return model


def int8_config():
    """torchao's weight-only int8, leaving torch.compile's settings alone."""
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig(set_inductor_config=False)


def int4_device(cannot: str) -> torch.device:
    """The CUDA device int4 packs on; refuses a machine without one of compute capability 8.0+."""
    if not torch.cuda.is_available():
        raise GenerationError(f"{cannot}: int4 (torchao's tile_packed_to_4d layout, PyTorch's tinygemm kernel) packs and runs on CUDA only, "
                              "and no CUDA device is available")
    capability = torch.cuda.get_device_capability()
    if capability[0] < 8:
        raise GenerationError(f"{cannot}: the tinygemm int4 kernel needs a GPU of compute capability 8.0 or newer, this one is "
                              f"{capability[0]}.{capability[1]}")
    return torch.device("cuda", torch.cuda.current_device())


def int4_plan(model, cannot: str = "torchao cannot quantize this model to int4"):
    """([(name, linear)] that int4 quantizes, torchao's config): the linears not yet quantized
    whose input features are whole groups of 128, which must hold bf16 weights."""
    from torchao.quantization import Int4WeightOnlyConfig

    from hostswap.passes.quantized_linear import is_torchao_tensor

    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not is_torchao_tensor(m.weight)
               and m.in_features % INT4_GROUP_SIZE == 0]
    other = [f"{name} ({m.weight.dtype})" for name, m in linears if m.weight.dtype != torch.bfloat16]
    if other:  # the model's own fault first, whatever the machine
        raise GenerationError(f"{cannot}: int4 takes bfloat16 weights, and {len(other)} linear layers are not ({', '.join(other[:3])}); "
                              "convert the model first (model.to(torch.bfloat16), or hostswap export-llm --dtype bfloat16)")
    return linears, Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d", version=2, set_inductor_config=False)


def quantize_each(linears, config, device: torch.device, quantize_fn, cannot: str = "torchao cannot quantize this model") -> None:
    """Quantize each (name, linear) on ``device`` with ``quantize_fn`` (torchao's ``quantize_``)
    and move it back where it was: the device holds one high-precision weight at a time."""
    for name, linear in linears:
        home = linear.weight.device
        try:
            quantize_fn(linear, config, device=device)  # quantize_ moves the linear to the device first
        except (ImportError, NotImplementedError, RuntimeError, ValueError, AssertionError) as e:
            raise GenerationError(f"{cannot}: {name}: {type(e).__name__}: {e}") from e
        linear.to(home)


def reset_state(ep) -> None:
    """Zero the state (KV cache) a program holds: where the runtime starts it. The programs of
    one wrapper hold its cache tensors themselves, so this resets all of them."""
    from hostswap.passes.weight_offload import state_buffers, weight_tensor

    for fqn in state_buffers(ep):
        weight_tensor(ep, fqn).zero_()


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GenerationError(f"{name} must be a positive int, got {value!r}")


def default_prefill_chunk(max_seq_len: int) -> int:
    """The prefill chunk when none is given: ``DEFAULT_PREFILL_CHUNK``, or the whole cache where that is shorter."""
    return min(DEFAULT_PREFILL_CHUNK, max_seq_len)


def check_long_prefill_chunk(asked, *, prefill_chunk: int, max_seq_len: int) -> int | None:
    """The long prefill chunk an export writes (hostswap/prefill_chunks.py), or None."""
    try:
        return long_prefill_chunk_for(asked, prefill_chunk=prefill_chunk, max_seq_len=max_seq_len)
    except ChunkError as e:
        raise GenerationError(str(e)) from None


def prefill_methods(prefill_chunk: int, long_prefill_chunk: int | None) -> dict[str, int]:
    """A program's prefill methods and the tokens each call takes."""
    return {PREFILL: prefill_chunk, **({PREFILL_LONG: long_prefill_chunk} if long_prefill_chunk else {})}


def check_prefill_chunks(prefill_chunk: int | None, long_prefill_chunk, max_seq_len: int) -> dict[str, int]:
    """The prefill methods an export writes (``prefill_methods``), its chunk arguments checked
    and their defaults taken: the one check of ``export`` and ``hostswap.batching.export``."""
    if prefill_chunk is None:
        prefill_chunk = default_prefill_chunk(max_seq_len)
    _check_positive_int("prefill_chunk", prefill_chunk)
    if prefill_chunk > max_seq_len:
        raise GenerationError(f"prefill_chunk={prefill_chunk} is longer than max_seq_len={max_seq_len}")
    return prefill_methods(prefill_chunk, check_long_prefill_chunk(long_prefill_chunk, prefill_chunk=prefill_chunk, max_seq_len=max_seq_len))


def prefill_constants(chunks: dict[str, int]) -> dict[str, int]:
    """The constant methods that tell a loaded program's prefill chunks."""
    return {PREFILL_CHUNK: chunks[PREFILL], **({LONG_PREFILL_CHUNK: chunks[PREFILL_LONG]} if PREFILL_LONG in chunks else {})}


def loaded_prefill_methods(module, prefill_chunk: int, long_prefill_chunk: int | None, max_seq_len: int, writer: str) -> dict[str, int]:
    """``prefill_methods`` of a loaded program, as its constants give them; a long chunk
    without its method, or a chunk the cache cannot hold, is refused, naming ``writer``, the
    export that writes both."""
    if long_prefill_chunk is not None and PREFILL_LONG not in module.schedules:
        raise GenerationError(f"{module.pte_path} gives a long prefill chunk but has no method {PREFILL_LONG!r} that reads weights: write it with {writer}")
    for name, chunk in (("prefill_chunk", prefill_chunk), ("long_prefill_chunk", long_prefill_chunk)):
        if chunk is not None and not 1 <= chunk <= max_seq_len:
            raise GenerationError(f"{module.pte_path} gives {name}={chunk}, which a cache of max_seq_len={max_seq_len} positions cannot take: write it with {writer}")
    return prefill_methods(prefill_chunk, long_prefill_chunk)


def export(model, path: str | os.PathLike, *, max_seq_len: int, prefill_chunk: int | None = None, long_prefill_chunk: int | str | None = AUTO, prefetch_depth: int = 1,
           gather_from_host: bool = True, progress: Callable[[str], None] | None = None, max_batch_size: int | None = None,
           speculate_k: int | None = None, tensor_parallel: int | None = None, fuse_linears: bool = False):
    """Write ``<path>.pte`` (methods ``prefill``, ``prefill_long`` where written, and
    ``decode``, their schedules, the KV cache as state) and ``<path>.ptd`` (the weights) for a transformers causal LM; returns both paths.

    The model is changed in place: moved to the CPU if it is elsewhere (a model quantized on
    the GPU, say), and its torchao quantized linears swapped by ``prepare_quantized``.
    ``prefill_chunk``: tokens per prefill call (default ``min(128, max_seq_len)``).
    ``long_prefill_chunk``: tokens per call of a second prefill method, ``prefill_long``, that
    takes the bulk of a long prompt (one weight pass per call; hostswap/prefill_chunks.py):
    default ``"auto"``, 512 where ``max_seq_len`` is at least that and ``prefill_chunk``
    shorter; None for none.
    ``gather_from_host``: as in ``apply_weight_offload`` (an untied token table stays in host
    memory, read a row per token). ``max_batch_size``: write a program for that many sequences
    at once, each at its own position (run it with ``hostswap.batching.BatchGenerator``).
    ``speculate_k``: add a ``verify`` method that checks that many drafted tokens in one pass
    (``Generator(..., draft=...)``). ``tensor_parallel``: write one program and ``.ptd`` per rank
    of that many, each with its shard of the weights (hostswap/tensor_parallel.py); returns the
    lists of their paths. ``fuse_linears``: linears that read one input run as one
    (passes/fuse_sibling_linears.py), for a program held whole on the device, such as a draft."""
    from hostswap.passes import save

    if tensor_parallel is not None:
        from hostswap.tensor_parallel import export_ranks

        return export_ranks(model, path, world=tensor_parallel, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                            long_prefill_chunk=long_prefill_chunk, prefetch_depth=prefetch_depth, gather_from_host=gather_from_host, progress=progress,
                            max_batch_size=max_batch_size, speculate_k=speculate_k)
    programs, constants = export_programs(model, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk, long_prefill_chunk=long_prefill_chunk,
                                          prefetch_depth=prefetch_depth, fuse_linears=fuse_linears,
                                          gather_from_host=gather_from_host, progress=progress, max_batch_size=max_batch_size,
                                          speculate_k=speculate_k)
    return save(programs, path, constant_methods=constants, progress=progress)


def export_checkpoint(folder: str | os.PathLike, path: str | os.PathLike, **options) -> tuple[str, str]:
    """``export`` of the model in a checkpoint folder without loading it: the weights are read
    from its safetensors shards one tensor at a time (``hostswap.checkpoint``)."""
    from hostswap.checkpoint import export_checkpoint as stream

    return stream(folder, path, **options)


def export_programs(model, *, max_seq_len: int, prefill_chunk: int | None = None, long_prefill_chunk: int | str | None = AUTO, prefetch_depth: int = 1,
                    gather_from_host: bool = True,
                    progress: Callable[[str], None] | None = None, device: str = "cpu", max_batch_size: int | None = None,
                    speculate_k: int | None = None, fuse_linears: bool = False, stacked: dict | None = None) -> tuple[dict, dict]:
    """The probed ``prefill`` (and ``prefill_long``) and ``decode`` programs of ``export``, and the constant methods
    that describe them, before lowering. ``device``: of the example inputs, the model's own
    (``"meta"`` for a model traced without values). ``max_batch_size``: a KV cache of that many
    slots, for ``hostswap.batching.BatchGenerator`` (hostswap/batching.py). ``speculate_k``: a
    ``verify`` method of ``speculate_k + 1`` tokens, for speculative decoding with a draft
    (hostswap/speculative.py). ``stacked``: a dict that takes the parameters ``fuse_linears``
    stacked, each with its parts (``FuseSiblingLinearsPass.stacked``), for a writer that reads
    weights by name."""
    from hostswap.passes import apply_weight_offload
    from hostswap.passes.fuse_sibling_linears import fuse_sibling_linears

    if max_batch_size is not None:
        from hostswap import batching

        if speculate_k is not None:
            raise GenerationError("speculate_k and max_batch_size cannot be combined yet: export a batched program or a speculative one")
        if fuse_linears:
            raise GenerationError("fuse_linears and max_batch_size cannot be combined yet: fused linears are for a draft, which is not batched")

        return batching.export_programs(model, max_seq_len=max_seq_len, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk,
                                        long_prefill_chunk=long_prefill_chunk, prefetch_depth=prefetch_depth, gather_from_host=gather_from_host, progress=progress, device=device)

    _check_positive_int("max_seq_len", max_seq_len)
    prefills = check_prefill_chunks(prefill_chunk, long_prefill_chunk, max_seq_len)
    if speculate_k is not None:
        _check_positive_int("speculate_k", speculate_k)
        if speculate_k + 1 > max_seq_len:
            raise GenerationError(f"speculate_k={speculate_k} needs {speculate_k + 1} positions; max_seq_len={max_seq_len}")
    say = progress or (lambda _msg: None)
    wrapper = static_cache_wrapper(model, max_seq_len)
    programs = {}
    # verify: the last accepted token and k drafted ones, checked in one pass (hostswap/speculative.py)
    methods = (*prefills.items(), (DECODE, 1)) + (((VERIFY, speculate_k + 1),) if speculate_k is not None else ())
    for name, length in methods:
        say(f"exporting {name} ({length} token{'s' if length > 1 else ''})")
        ids = torch.zeros(1, length, dtype=torch.long, device=device)
        with torch.no_grad():
            ep = wrapper.export(input_ids=ids, cache_position=torch.arange(length, dtype=torch.long, device=device))
            reset_state(ep)
        if fuse_linears:
            parts = fuse_sibling_linears(ep)
            if stacked is not None:
                stacked.update(parts)
        programs[name] = apply_weight_offload(ep, prefetch_depth=prefetch_depth, gather_from_host=gather_from_host)
    eos = _eos_ids(model)
    vocab = model.get_input_embeddings().num_embeddings
    return programs, {MAX_SEQ_LEN: max_seq_len, **prefill_constants(prefills), VOCAB_SIZE: vocab, **({EOS_TOKEN_IDS: eos} if eos else {}),
                      **({SPECULATE_K: speculate_k} if speculate_k is not None else {})}


# A method call: (method, token ids [1, n], position of the first) -> logits [1, n, vocab].
Step = Callable[[str, torch.Tensor, "int | torch.Tensor"], torch.Tensor]  # (method, token ids, first position or positions)


def prefill(step: Step, ids: torch.Tensor, chunks: dict[str, int], max_seq_len: int) -> torch.Tensor:
    """Run the prompt ``ids`` [1, n] through the cache; the logits after its last token.

    ``chunks``: the program's prefill methods and the tokens each takes (``prefill_methods``,
    a Generator's ``prefill_chunks``). Each call takes the shortest chunk that holds
    the rest of the prompt, else the longest, and a last one that would run past the cache
    starts earlier (hostswap/prefill_chunks.py). The last call is padded: its padding's cache
    slots come after the prompt, masked, then overwritten by decode."""
    last = None
    for call in prefill_calls(ids.shape[1], chunks, max_seq_len):
        last = step(call.method, padded(ids[:, call.start : call.end], chunks[call.method]), call.start)[0, call.tokens - 1]
    return last


class DeviceTokens:
    """Tokens chosen on the device, read by the host in order without waiting for later steps.

    Each pushed token is copied to a pinned host buffer behind an event of its own; ``pop``
    waits for that event alone. ``int()`` of a CUDA tensor would wait for every step queued
    after it. On the CPU a token is read as it is.
    """

    def __init__(self, device: torch.device, capacity: int):
        self.cuda = device.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.long, pin_memory=self.cuda)
        self.events: list = []
        self.pushed = 0
        self.popped = 0

    def push(self, token: torch.Tensor) -> None:
        self.host[self.pushed : self.pushed + 1].copy_(token.reshape(1), non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self.events.append(event)
        self.pushed += 1

    def pop(self) -> int:
        if self.cuda:
            self.events[self.popped].synchronize()
            self.events[self.popped] = None
        token = int(self.host[self.popped])
        self.popped += 1
        return token


def decode_tokens(step: Step, logits: torch.Tensor, position: int, max_new_tokens: int, eos=frozenset(),
                  on_token: Callable[[int], None] | None = None, choose=None, logprobs: list | None = None) -> list[int]:
    """Tokens from the logits after the prompt, greedy unless ``choose`` is given: the first from
    ``logits``, the rest one decode call each, the first at ``position``; stops after
    ``max_new_tokens`` or at ``eos``.
    ``choose`` (a ``sampling.TokenChooser``) picks each token instead of ``argmax``, on the
    device; the device tensors of its log-probabilities are appended to ``logprobs``.

    The host reads each token one step behind the device. A token is chosen on the device
    (argmax) and fed to the next decode call as a device tensor, with its position, so that
    step is queued before the host waits for the token: the device runs step after step with
    no gap for the host's own work between them (reading, printing, the next call's Python),
    which on an H100 cost about 0.4 ms a token. An end-of-sequence token is known one step
    late: the step queued after it runs, and its token is dropped.
    """
    device = logits.device

    def pick(row: torch.Tensor) -> torch.Tensor:
        if choose is None:
            return row.argmax().reshape(1, 1)
        token, logprob = choose(row)
        if logprobs is not None:
            logprobs.append(logprob)
        return token

    token = pick(logits.reshape(-1, logits.shape[-1])[-1])
    positions = torch.tensor([position], dtype=torch.long).to(device)
    tokens = DeviceTokens(device, max_new_tokens)
    tokens.push(token)
    new: list[int] = []
    while True:
        if tokens.pushed < max_new_tokens:
            # a draw's NO_TOKEN goes to the host, which raises on it, and not into the model
            token = pick(step(DECODE, token if choose is None else token.clamp(min=0), positions)[0, -1])
            positions = positions + 1
            tokens.push(token)
        new.append(check_drawn(tokens.pop()))
        if on_token:
            on_token(new[-1])
        if len(new) == max_new_tokens or new[-1] in eos:
            return new


@dataclasses.dataclass
class GenerationStats:
    """What the last ``generate`` call measured (host wall time, synchronised)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # every decode step after the first token
    bytes_streamed_prefill: int = 0
    bytes_streamed_decode: int = 0
    bytes_from_disk_decode: int = 0  # of those, read from the .ptd (the disk tier)
    expert_bytes_decode: int = 0  # routed experts' rows the MoE kernels read in place (besides the streamed bytes)
    expert_bytes_prefill: int = 0  # the same, while the prompt was prefilled

    @property
    def ms_per_token(self) -> float | None:
        steps = self.new_tokens - 1
        return self.decode_seconds / steps * 1e3 if steps > 0 else None

    @property
    def tokens_per_second(self) -> float | None:
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else None

    @property
    def bytes_streamed_per_token(self) -> float | None:
        steps = self.new_tokens - 1
        return self.bytes_streamed_decode / steps if steps > 0 else None

    @property
    def bytes_from_disk_per_token(self) -> float | None:
        steps = self.new_tokens - 1
        return self.bytes_from_disk_decode / steps if steps > 0 else None

    @property
    def expert_bytes_per_token(self) -> float | None:
        steps = self.new_tokens - 1
        return self.expert_bytes_decode / steps if steps > 0 else None


class Generator:
    """A program written by ``hostswap.llm.export``, loaded for greedy generation.

    One pool serves every method within ``weight_offload_budget_mb`` (default ``"auto"``: the
    device's free memory less the KV cache, the activations and a margin, capped at the
    weights' total; ``memory_report()`` says what it chose); the KV cache and the activation
    arenas live on the device beside it. ``cuda_graph`` (default: on CUDA with the planned
    policy) captures decode, whose shapes are static, as a CUDA graph; prefill runs eagerly.

    ``draft`` (a program's path prefix, or a loaded Generator) decodes speculatively
    (hostswap/speculative.py). A draft given by path is held whole on the device, its decode
    compiled into one graph by TorchInductor where ``compile_draft`` (default: on CUDA, where
    possible: a draft that cannot be compiled runs as the executor runs it, with a warning;
    True: compiled or an error), since a resident draft's step is bound by its kernel
    launches, not its bytes. ``draft_ahead`` (greedy decoding; default: on CUDA, where it
    measured faster at every k and budget): the draft drafts the next round on a stream of its
    own while the streamed verify pass runs.

    ``warm_up`` (default on) runs a call of each prefill method, one decode step and one sampled choice at
    load, then zeroes the KV cache: the one-time costs of a first call (graph capture, kernel
    selection, compilation and first launch, first use of the copy paths) are paid there and reported on their own
    (``warm_up_seconds``), so every ``generate`` call, the first included, measures
    steady-state speed. Other keywords go to ``hostswap.runtime.Module``.
    """

    def __init__(self, pte_path, data_path=None, *, weight_offload_budget_mb: float | str = "auto", device="cuda", policy: str = "planned",
                 cuda_graph: bool | None = None, warm_up: bool = True, draft=None, speculate_k: int | None = None, compile_draft: bool | None = None,
                 draft_ahead: bool | None = None, **module_options):
        from hostswap.runtime import Module
        from hostswap.runtime.module import check_device_argument

        device = check_device_argument(device)
        if not isinstance(warm_up, bool):
            raise GenerationError(f"warm_up must be True or False, got {warm_up!r}")
        where_possible = cuda_graph is None  # by default, decode is graphed unless weights come from the disk
        if cuda_graph is None:
            cuda_graph = device.type == "cuda" and policy == "planned"
        # a draft goes on the device first: the target's budget ("auto" included) is what it leaves
        self._owns_draft = draft is not None and not isinstance(draft, Generator)
        if compile_draft is not None and not isinstance(compile_draft, bool):
            raise GenerationError(f"compile_draft must be True, False or None, got {compile_draft!r}")
        if draft_ahead is not None and not isinstance(draft_ahead, bool):
            raise GenerationError(f"draft_ahead must be True, False or None, got {draft_ahead!r}")
        if draft_ahead and draft is None:
            raise GenerationError("draft_ahead drafts the next round during each verify pass: it needs a draft")
        # on the CPU the steps ahead would run in line, before the pass: nothing to gain
        self.draft_ahead = (draft is not None and device.type == "cuda") if draft_ahead is None else draft_ahead
        if compile_draft is not None and not self._owns_draft:
            raise GenerationError("compile_draft applies to a draft given by its path; a loaded draft Generator keeps how it was loaded (load it with compiled=...)")
        draft = _open_draft(draft, device, device.type == "cuda" if compile_draft is None else compile_draft, compile_draft is None) if self._owns_draft else draft
        try:
            self.module = Module(pte_path, data_path, weight_offload_budget_mb=weight_offload_budget_mb, device=device,
                                 policy=policy, cuda_graph=(DECODE,) if cuda_graph else False, cuda_graph_where_possible=where_possible, **module_options)
        except (ValueError, RuntimeError) as e:  # BudgetError, PoolCreationError: what does not fit
            if draft is None:
                raise
            weights, cache = draft.module.budget_bytes, draft.module.state_bytes
            if self._owns_draft:
                draft.close()
            raise type(e)(f"{e}. The draft on {device} holds {(weights + cache) / 2**20:.1f} MiB besides: "
                          f"weights {weights / 2**20:.1f} MiB, KV cache {cache / 2**20:.1f} MiB") from e
        try:
            missing = [m for m in (PREFILL, DECODE) if m not in self.module.schedules]
            if missing:
                raise GenerationError(f"{pte_path} has no method {missing[0]!r} that reads weights: write it with hostswap.llm.export")
            if MAX_BATCH_SIZE in self.module.method_names():
                raise GenerationError(f"{pte_path} is a batched program (export with max_batch_size): run it with hostswap.batching.BatchGenerator")
            from hostswap.tensor_parallel import program_ranks

            self.tensor_parallel = program_ranks(self.module)  # (rank, world), checked against this process group
            self.max_seq_len = self._constant(MAX_SEQ_LEN)
            self.prefill_chunk = self._constant(PREFILL_CHUNK)
            self.long_prefill_chunk = self._constant(LONG_PREFILL_CHUNK) if LONG_PREFILL_CHUNK in self.module.method_names() else None
            # method -> tokens a call takes
            self.prefill_chunks = loaded_prefill_methods(self.module, self.prefill_chunk, self.long_prefill_chunk, self.max_seq_len, "hostswap.llm.export")
            self.vocab_size = self._constant(VOCAB_SIZE)
            self.eos_token_ids = frozenset(self.module.run_method(EOS_TOKEN_IDS, []) if EOS_TOKEN_IDS in self.module.method_names() else [])
            self.device = device
            self.speculate_k = self._constant(SPECULATE_K) if SPECULATE_K in self.module.method_names() else None  # the verify width less one
            self.draft_k = self._draft_k(speculate_k) if draft is not None else None  # tokens drafted per round
            if draft is not None:
                from hostswap.speculative import check_draft

                check_draft(self, draft)
            self.draft = draft
            if draft is not None and self.module.cuda_graph:
                self.module.graph_method(VERIFY)  # each round's one streamed pass: launched from the host, its kernels would cost more than its copies
            self.last_speculation = None  # SpeculationStats of the last generate with a draft
            self.last = GenerationStats()
            self.last_logprobs: list[float] | None = None  # of the last generate's new tokens, when asked for
            self.warm_up_seconds = self._warm_up() if warm_up else None
        except BaseException:
            self.module.close()
            if self._owns_draft:
                draft.close()
            raise

    def _draft_k(self, asked) -> int | None:
        if self.speculate_k is None:
            raise GenerationError(f"{self.module.pte_path} has no verify method: export the target with speculate_k=k to decode with a draft")
        if asked is None:
            return None  # chosen each round from the measured acceptance and costs
        if isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= self.speculate_k:
            raise GenerationError(f"speculate_k must be an int from 1 to {self.speculate_k} (the program's verify method checks {self.speculate_k}), got {asked!r}")
        return asked

    def _warm_up(self) -> float:
        """One call of each prefill method, one decode step on token 0 and one sampled choice from its
        logits, then the KV cache zeroed as at load; returns the seconds it took."""
        self._sync()
        start = time.perf_counter()
        for method, chunk in self.prefill_chunks.items():
            self._step(method, torch.zeros(1, chunk, dtype=torch.long), 0)
        logits = self._step(DECODE, torch.zeros(1, 1, dtype=torch.long).to(self.device), torch.zeros(1, dtype=torch.long).to(self.device))
        warm_up_sampling(logits)
        if self.draft is not None:
            width = self.speculate_k + 1
            self._step(VERIFY, torch.zeros(1, width, dtype=torch.long).to(self.device), torch.arange(width, dtype=torch.long).to(self.device))
        self._sync()
        self.module.reset_state()
        self._sync()
        return time.perf_counter() - start

    def _constant(self, name: str) -> int:
        if name not in self.module.method_names():
            raise GenerationError(f"{self.module.pte_path} lacks {name}: write it with hostswap.llm.export")
        (value,) = self.module.run_method(name, [])
        return int(value)

    def _step(self, method: str, ids: torch.Tensor, position: "int | torch.Tensor") -> torch.Tensor:
        """Logits of ``ids`` at ``position`` onwards, or at the positions given as a tensor."""
        positions = position if isinstance(position, torch.Tensor) else torch.arange(position, position + ids.shape[1], dtype=torch.long)
        (logits,) = self.module.run_method(method, [ids, positions])
        return logits

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: int | list[int] | None = None,
                 on_token: Callable[[int], None] | None = None, sampling=None, logprobs: bool = False) -> torch.Tensor:
        """Greedy tokens after ``input_ids`` ([1, n] or [n]); returns prompt + new tokens as
        [1, n + new], as transformers' ``generate`` does. Stops after ``max_new_tokens`` or at an
        end-of-sequence token (the program's, or ``eos_token_id``). ``on_token`` sees each new
        token as it comes. ``sampling``: a ``hostswap.sampling.SamplingParams`` (temperature,
        top-k, top-p, repetition penalty, seed), chosen on the device; ``logprobs``: keep each
        new token's log-probability in ``last_logprobs``."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise GenerationError(f"sampling must be a hostswap.sampling.SamplingParams, got {type(sampling).__name__}")
        self.module.ensure_open()
        if not isinstance(input_ids, torch.Tensor):
            raise GenerationError(f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
        ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise GenerationError(f"input_ids must hold one sequence ([1, n] or [n]), got shape {tuple(input_ids.shape)}")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise GenerationError(f"input_ids must be integer token ids, got {ids.dtype}")
        prompt = ids.shape[1]
        if prompt < 1:
            raise GenerationError("input_ids is empty: give at least one prompt token")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise GenerationError(f"input_ids holds token id {bad}, outside the model's vocabulary of {self.vocab_size} ids (0..{self.vocab_size - 1})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if prompt + max_new_tokens > self.max_seq_len:
            raise GenerationError(
                f"prompt ({prompt} tokens) + max_new_tokens ({max_new_tokens}) = {prompt + max_new_tokens} exceeds the "
                f"program's max_seq_len={self.max_seq_len}; export with a larger max_seq_len"
            )
        if eos_token_id is None:
            eos = self.eos_token_ids
        else:
            eos = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
            if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
                raise GenerationError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}")
        if self.draft is not None and (logprobs or (sampling is not None and sampling.repetition_penalty != 1.0)):
            raise GenerationError("decoding with a draft keeps no log-probabilities and takes no repetition penalty: load without draft= for them")
        ids = ids.to(torch.long).cpu()
        stats = GenerationStats(prompt_tokens=prompt)
        self._sync()
        experts0 = self.module.expert_bytes_read
        t0, bytes0 = time.perf_counter(), self.module.pool.stats.bytes_h2d
        last = prefill(self._step, ids, self.prefill_chunks, self.max_seq_len)
        if self.draft is not None:  # the draft reads the prompt too: a cost per prompt, counted with the target's prefill
            self.draft.module.ensure_open()
            prefill(self.draft._step, ids, self.draft.prefill_chunks, self.draft.max_seq_len)
        self._sync()
        t1, bytes1, disk1, experts1 = time.perf_counter(), self.module.pool.stats.bytes_h2d, self.module.disk_bytes_read, self.module.expert_bytes_read
        stats.prefill_seconds, stats.bytes_streamed_prefill, stats.expert_bytes_prefill = t1 - t0, bytes1 - bytes0, experts1 - experts0
        chosen: list = []
        sampling = sampling or SamplingParams()
        if self.draft is not None:
            from hostswap.speculative import Sampler, SpeculationStats, speculate

            self.last_speculation = SpeculationStats()
            sampler = None if sampling.greedy else Sampler(sampling, self.device)
            first = int(last.argmax()) if sampler is None else sampler.draw(sampler.probabilities(last))
            new = speculate(self, self.draft, first, prompt, self.draft_k, max_new_tokens, eos, on_token, self.last_speculation, sampler,
                            self.draft_ahead)
            self.last_logprobs = None
        else:
            choose = None if sampling.argmax and not logprobs else TokenChooser(sampling, self.device, self.vocab_size, ids)
            new = decode_tokens(self._step, last, prompt, max_new_tokens, eos, on_token, choose, chosen if logprobs else None)
            self.last_logprobs = torch.cat(chosen)[: len(new)].tolist() if logprobs else None
        self._sync()
        stats.decode_seconds = time.perf_counter() - t1
        stats.bytes_streamed_decode = self.module.pool.stats.bytes_h2d - bytes1
        stats.bytes_from_disk_decode = self.module.disk_bytes_read - disk1
        stats.expert_bytes_decode = self.module.expert_bytes_read - experts1
        stats.new_tokens = len(new)
        self.last = stats
        return torch.cat([ids, torch.tensor([new], dtype=torch.long)], dim=1)

    @property
    def stats(self) -> dict:
        """The last generation's timings and the module's memory and pool counters."""
        s = self.last
        module = self.module.stats
        return {
            "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens,
            "prefill_ms": s.prefill_seconds * 1e3, "ms_per_token": s.ms_per_token, "tokens_per_s": s.tokens_per_second,
            "bytes_streamed_prefill": s.bytes_streamed_prefill, "expert_bytes_prefill": s.expert_bytes_prefill,
            "bytes_streamed_per_token": s.bytes_streamed_per_token, "bytes_from_disk_per_token": s.bytes_from_disk_per_token,
            "expert_bytes_per_token": s.expert_bytes_per_token, "expert_reads": module["expert_reads"],
            "expert_host_cache": module["expert_host_cache"], "expert_disk_bytes_read": module["expert_disk_bytes_read"],
            "kv_cache_bytes": module["state_bytes"], "host_budget_bytes": module["host_budget_bytes"],
            "activation_arena_bytes": module["activation_arena_bytes"], "weight_budget_bytes": module["budget_bytes"],
            "hits": module["hits"], "misses": module["misses"], "bytes_h2d": module["bytes_h2d"],
            # one-time costs, apart from the steady-state speed above
            "load_s": self.module.load_seconds, "warm_up_s": self.warm_up_seconds,
        }

    def memory_report(self) -> str:
        """Device memory by kind, as loaded, and how an ``"auto"`` budget was chosen."""
        m = self.module.stats
        memory = (f"{self.device}: weights {m['budget_bytes'] / 2**20:.1f} MiB (budget; floor {(self.module.schedule.floor_bytes + self.module.expert_scratch_bytes) / 2**20:.1f} MiB), "
                  f"KV cache {m['state_bytes'] / 2**20:.1f} MiB, activations {m['activation_arena_bytes'] / 2**20:.1f} MiB; "
                  f"host memory pinned for streaming {m['pinned_host_bytes'] / 2**20:.1f} MiB")
        auto = self.module.auto_budget
        tiers = self.module.tiers
        experts = self.module.expert_host_plan
        eager = ("; decode runs eagerly (no CUDA graph) while weights come from disk" if (tiers.disk or experts.on_disk) and self.device.type == "cuda" else "")
        host = self.module.host_budget.explain(tiers) + (f"; {experts.explain(self.module.expert_cache_policy)}" if self.module.schedule.expert_blocks else "")
        lines = ([] if auto is None else [auto.explain(self.device)]) + [memory, host + eager]
        return "\n".join(lines)

    def summary(self) -> str:
        """The last generation's steady-state speed and memory, then the one-time costs apart."""
        s = self.stats
        ms = f"{s['ms_per_token']:.2f} ms/token, {s['tokens_per_s']:.1f} tokens/s" if s["ms_per_token"] is not None else "one token"
        per_token = s["bytes_streamed_per_token"]
        disk = f", {s['bytes_from_disk_per_token'] / 2**20:.1f} MiB/token from disk" if s["bytes_from_disk_per_token"] else ""
        if s["expert_bytes_per_token"]:
            disk += f", routed experts read in place {s['expert_bytes_per_token'] / 2**20:.1f} MiB/token"
        cached = [r for r in s["expert_reads"].values() if r["cache_policy"]]
        lookups = sum(r["cache_hits"] + r["cache_misses"] for r in cached)
        if lookups:
            prefetched = sum(r["prefetched"] for r in cached)
            guessed = f", {sum(r['prefetch_hits'] for r in cached) / prefetched:.0%} of {prefetched} guessed experts read" if prefetched else ""
            if not prefetched and any(r["prefetch"] for r in cached):  # guessing, but no guess found an expert missing (or none ran)
                guessed = ", no guessed expert copied"
            disk += (f" (expert cache: {min(r['cache_slots'] for r in cached)} experts a block on the device, {cached[0]['cache_policy']}, "
                     f"{sum(r['cache_hits'] for r in cached) / lookups:.0%} of decode lookups hit since load{guessed})")
        host = s["expert_host_cache"].values()
        if host:  # experts read from the disk through pinned host slots
            picks = sum(c["hits"] + c["misses"] for c in host)
            disk += (f"; experts from disk: {min(c['slots'] for c in host)} a block in host memory, "
                     f"{sum(c['hits'] for c in host) / max(1, picks):.0%} of picks found there since load")
        once = f"load {s['load_s']:.2f} s" + (f", warm-up {s['warm_up_s']:.2f} s" if s["warm_up_s"] is not None else ", no warm-up (the first call's costs are in its times)")
        return (f"prefill {s['prefill_ms']:.1f} ms ({s['prompt_tokens']} tokens), {ms}, {s['new_tokens']} new tokens; "
                f"streamed {per_token / 2**20 if per_token is not None else 0:.1f} MiB/token{disk}; device memory: weights "
                f"{s['weight_budget_bytes'] / 2**20:.1f} MiB, KV cache {s['kv_cache_bytes'] / 2**20:.1f} MiB, "
                f"activations {s['activation_arena_bytes'] / 2**20:.1f} MiB; one-time: {once}")

    def close(self) -> None:
        self.module.close()
        if self.draft is not None and self._owns_draft:
            self.draft.close()

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_draft(draft, device: torch.device, compiled: bool, where_possible: bool) -> "Generator":
    """The draft program at a path prefix (or its .pte), loaded with every weight on the device;
    ``compiled``: its decode method compiled into one graph (runtime/compiled_method.py), or
    where that is possible (``where_possible``: else run as the executor runs it, with a warning)."""
    from hostswap.schedules.serialization import load_weight_schedules

    base = os.fspath(draft)
    base = base[:-4] if base.endswith(".pte") else base
    schedules = load_weight_schedules(base + ".pte")
    resident = max(s.all_resident_budget_bytes for s in schedules.values())
    return Generator(base + ".pte", base + ".ptd", weight_offload_budget_mb=resident / 2**20, device=device, compiled=(DECODE,) if compiled else False,
                     compiled_where_possible=where_possible)
