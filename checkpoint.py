"""Export a transformers checkpoint folder for generation without loading its weights.

The model is built from its config on the meta device (accelerate's ``init_empty_weights``)
and traced there with meta inputs: nothing is allocated or read for a weight, and every tensor
the tracer sees is on one device (torch 2.11 refuses meta weights beside CPU inputs). Buffers
computed at construction (rotary tables) are kept aside and put back by name once the program
is lowered. The program is lowered as ``hostswap.llm.export`` does, and the ``.ptd`` is then written one tensor at a time, each
read from its safetensors shard (plain reads: nothing stays mapped), converted to the program's dtype and hashed
as it is written (``passes/lowering.py: save_streamed``). Peak memory is the traced program
plus about one tensor; the weights are read once and written once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable

import torch

from hostswap.checkpoint_names import CheckpointNames, ConversionError
from hostswap.llm import GenerationError, export_programs
from hostswap.passes.ptd_writer import PtdTensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def has_safetensors(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a safetensors checkpoint (one file, or shards with an index)."""
    return any(os.path.exists(os.path.join(os.fspath(folder), name)) for name in (SINGLE_FILE, INDEX_FILE))


class CheckpointError(GenerationError):
    """A checkpoint folder hostswap cannot stream from; the message names the shard or tensor."""


# safetensors' dtype names (the format's header)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    shard: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute, in the shard
    nbytes: int


def read_safetensors_header(path: str, shard: str, folder: str) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its header alone; refuses a file whose
    header or data is cut short, naming the shard."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise CheckpointError(f"shard {shard} of {folder} is truncated or not safetensors: its header says {length} bytes, the file has {size}")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise CheckpointError(f"shard {shard} of {folder} has an unreadable header: {e}") from None
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"tensor '{name}' in shard {shard} of {folder} has a header entry hostswap cannot read: {info!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise CheckpointError(f"tensor '{name}' in shard {shard} of {folder} spans {end - begin} bytes; {info['dtype']} {list(shape)} needs {nbytes}")
        if 8 + length + end > size:
            raise CheckpointError(f"shard {shard} of {folder} is truncated: tensor '{name}' ends at byte {8 + length + end}, the file has {size}")
        tensors[name] = StoredTensor(shard, dtype, shape, 8 + length + begin, nbytes)
    return tensors


class SafetensorsCheckpoint:
    """The tensors of a checkpoint's safetensors shards, by name, each read when asked (plain
    reads into its own buffer: no mapping stays resident, so memory holds one tensor). A
    block-scaled float8 checkpoint's weights are read as their codes times their scales
    (checkpoint_quantized.py), and its scales are not among its tensors."""

    def __init__(self, folder: str | os.PathLike):
        from hostswap.checkpoint_quantized import SCALE_SUFFIX, checkpoint_quantization

        self.folder = os.fspath(folder)
        self.quantization = checkpoint_quantization(self.folder)
        index_path = os.path.join(self.folder, INDEX_FILE)
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    shard_of = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path} is not a safetensors index (a JSON object with a weight_map): {e}") from None
        elif os.path.exists(os.path.join(self.folder, SINGLE_FILE)):
            shard_of = None
        else:
            found = sorted(f for f in os.listdir(self.folder) if f.endswith((".bin", ".pt", ".pth", ".gguf"))) if os.path.isdir(self.folder) else []
            what = f"its weights are in {', '.join(found[:3])}" if found else "it holds no weights"
            raise CheckpointError(
                f"{self.folder} has no safetensors ({SINGLE_FILE} or {INDEX_FILE}): {what}. hostswap streams safetensors shards; "
                "convert once with transformers (AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder), which holds "
                "the whole model in RAM once), or export the loaded model with hostswap.llm.export"
            )
        shards = sorted(set(shard_of.values())) if shard_of is not None else [SINGLE_FILE]
        self.tensors: dict[str, StoredTensor] = {}
        for shard in shards:
            path = os.path.join(self.folder, shard)
            if not os.path.exists(path):
                holds = next(name for name, s in shard_of.items() if s == shard)
                raise CheckpointError(f"shard {shard} of {self.folder} is missing (the index puts '{holds}' in it)")
            self.tensors.update(read_safetensors_header(path, shard, self.folder))
        if shard_of is not None:
            # the index decides which names the checkpoint has
            self.tensors = {name: t for name, t in self.tensors.items() if name in shard_of}
        self.scales: dict[str, StoredTensor] = {}  # a float8 weight's scales, by the weight's name
        if self.quantization is not None:
            for name in [n for n in self.tensors if self.quantization.is_scale(n)]:
                self.scales[self.quantization.weight_of(name)] = self.tensors.pop(name)
            for weight, scale in self.scales.items():
                stored = self.tensors.get(weight)
                if stored is None:
                    raise CheckpointError(f"tensor '{weight}{SCALE_SUFFIX}' in shard {scale.shard} of {self.folder} scales a weight '{weight}' "
                                          "the checkpoint does not hold")
                problem = self.quantization.problem(stored.dtype, stored.shape, scale.dtype, scale.shape)
                if problem is not None:
                    raise CheckpointError(f"tensor '{weight}' in shard {stored.shard} of {self.folder} {problem}")
        for name, t in self.tensors.items():
            if t.dtype.is_floating_point and t.dtype.itemsize == 1 and name not in self.scales:
                raise CheckpointError(f"tensor '{name}' in shard {t.shard} of {self.folder} is {t.dtype} with no scales beside it "
                                      f"('{name}{SCALE_SUFFIX}'{'' if self.quantization else ' and no quantization_config in config.json'}): "
                                      "its codes are not the weight")
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shard_of(self, name: str) -> str:
        return self.tensors[name].shard

    def tensor(self, name: str, dequantized_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` as the checkpoint stores it; a float8 weight as codes x scales, in
        float32, or in ``dequantized_dtype`` where given (the product rounded once)."""
        out = self._read(name, self.tensors[name])
        if name in self.scales:
            return self.quantization.dequantize(out, self._read(self.quantization.scale_name(name), self.scales[name]), dequantized_dtype)
        return out

    def _read(self, name: str, stored: StoredTensor) -> torch.Tensor:
        out = torch.empty(stored.shape, dtype=stored.dtype)
        with open(os.path.join(self.folder, stored.shard), "rb") as f:
            f.seek(stored.offset)
            got = f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
        if got != stored.nbytes:
            raise CheckpointError(f"tensor '{name}' of shard {stored.shard} ({self.folder}) ends past the file's end: {got} of {stored.nbytes} bytes read")
        self.bytes_read += got
        return out


def _meta_model(folder: str, dtype: torch.dtype | None):
    """The checkpoint's model with its parameters and buffers on the meta device, the values of
    the buffers it computed at construction (by program FQN), and the dtype it holds."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder} has no config a transformers model can be built from: {e}") from None
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        pass  # the config's own
    model.tie_weights()
    values, on_meta = {}, {}
    for module_name, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type != "meta":
                values[f"{MODEL_PREFIX}{module_name}.{name}" if module_name else MODEL_PREFIX + name] = buffer
                module._buffers[name] = on_meta.setdefault(id(buffer), buffer.to("meta"))
    return model.eval(), values, dtype


# where transformers' exportable wrapper holds the model: the prefix of every program FQN
MODEL_PREFIX = "model."


def _checkpoint_names(model, prefix: str = MODEL_PREFIX) -> dict[str, list[str]]:
    """Program FQN -> the names the checkpoint may store that tensor under (the model's own
    name first, then the names of tensors tied to it)."""
    by_object: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_object.setdefault(id(tensor), []).append(name)
    names = {}
    for aliases in by_object.values():
        for name in aliases:
            names[prefix + name] = [name] + [a for a in aliases if a != name]
    return names


class _LinearQuantizer:
    """torchao weight-only quantization of a meta model's linears (shapes only, for tracing), and
    of each linear's real weight when the writer asks for one of its inner tensors."""

    def __init__(self, model, scheme: str):
        from torchao.quantization import quantize_

        from hostswap.llm import QUANTIZATION_SCHEMES, int4_device, int4_plan, int8_config
        from hostswap.passes.quantized_linear import is_torchao_tensor

        if scheme not in QUANTIZATION_SCHEMES:
            raise GenerationError(f"quantization must be one of {list(QUANTIZATION_SCHEMES)}, got {scheme!r}")
        self._quantize = quantize_
        cannot = f"torchao cannot quantize this model to {scheme}"
        if scheme == "int8":
            self.config = int8_config()
            self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        else:
            linears, self.config = int4_plan(model, cannot)
            self.device = int4_device(cannot)
        self.shapes: dict[str, tuple[int, ...]] = {}  # program FQN of a quantized weight -> its full-precision shape
        for name, linear in linears:
            shape = tuple(linear.weight.shape)
            try:
                quantize_(linear, self.config)
            except (ImportError, NotImplementedError, RuntimeError, ValueError, AssertionError) as e:
                raise GenerationError(f"{cannot}: {name}: {type(e).__name__}: {e}") from e
            if is_torchao_tensor(linear.weight):
                self.shapes[f"{MODEL_PREFIX}{name}.weight"] = shape
        self._last: tuple[str, dict[str, torch.Tensor]] | None = None  # the linear quantized last, its inner tensors

    def weight_of(self, fqn: str) -> str | None:
        """The quantized weight whose inner tensor ``fqn`` is (``...weight_qdata``), else None."""
        head, _, inner = fqn.rpartition(".weight_")
        return f"{head}.weight" if inner and f"{head}.weight" in self.shapes else None

    def inner_tensor(self, fqn: str, full_precision: Callable[[str, tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
        """Inner tensor ``fqn`` of its linear's quantized weight; ``full_precision(weight fqn,
        shape)`` reads the weight. One kernel reads a linear's inner tensors, so they are written
        one after the other: the last linear's are kept until another is asked for."""
        from hostswap.passes.quantized_linear import describe

        weight = self.weight_of(fqn)
        if self._last is None or self._last[0] != weight:
            self._last = None  # the last linear's tensors go before the next is made
            out_features, in_features = self.shapes[weight]
            linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
            linear.weight = torch.nn.Parameter(full_precision(weight, self.shapes[weight]).to(self.device), requires_grad=False)
            self._quantize(linear, self.config)
            names, inner, _layout = describe(linear.weight, weight.removeprefix(MODEL_PREFIX).removesuffix(".weight"))
            self._last = (weight, {f"{weight}_{n}": t.detach().cpu() for n, t in zip(names, inner)})
        return self._last[1][fqn]


def export_checkpoint(folder: str | os.PathLike, out: str | os.PathLike, *, max_seq_len: int, prefill_chunk: int | None = None, long_prefill_chunk: int | str | None = "auto",
                      dtype: torch.dtype | str | None = None, prefetch_depth: int = 1, gather_from_host: bool = True,
                      progress: Callable[[str], None] | None = None, show_bar: bool = False, quantize: str | None = None,
                      max_batch_size: int | None = None, speculate_k: int | None = None, tensor_parallel: int | None = None,
                      fuse_linears: bool = False):
    """Write ``<out>.pte`` and ``<out>.ptd`` for the transformers causal LM in ``folder`` (its
    config and safetensors shards) without loading the model: the same program, weight bytes
    and weights digest as ``hostswap.llm.export`` of the loaded model. ``dtype``: the weights'
    dtype in the program (default: the config's); each tensor is converted as it is read.
    ``show_bar``: a progress bar of bytes written, GB/s and time left. ``quantize``: ``"int8"`` or
    ``"int4"``, as ``hostswap.llm.quantize`` applies them, each linear's weight quantized when its
    turn to be written comes (on the GPU when there is one; int4 needs one). ``max_batch_size``:
    a program for that many sequences at once (``hostswap.batching``). ``speculate_k``: a verify
    method for speculative decoding (``hostswap.speculative``). ``tensor_parallel``: one program
    and ``.ptd`` per rank of that many, written side by side: each tensor is read once and
    split as it is written (hostswap/tensor_parallel.py); returns the lists of their paths.
    ``fuse_linears``: as ``hostswap.llm.export``'s, for a program held whole on the device (a
    draft); a stacked weight is written as its parts, read in turn and concatenated."""
    import contextlib

    from hostswap.passes.lowering import save_streamed_together

    folder = os.fspath(folder)
    checkpoint = SafetensorsCheckpoint(folder)
    say = progress or (lambda _msg: None)
    say(f"building {folder}'s model on the meta device (no weights loaded)")
    model, buffer_values, dtype = _meta_model(folder, dtype)
    names = _checkpoint_names(model)
    stored_as = CheckpointNames(model, checkpoint.tensors)  # transformers' renamings and conversions (experts stacked from per-expert linears)
    quantizer = None
    if quantize is not None:
        say(f"quantizing the linear layers to {quantize} on the meta device (shapes only; each weight is quantized as it is written)")
        quantizer = _LinearQuantizer(model, quantize)
    plan = None
    if tensor_parallel is not None:
        from hostswap.llm import prepare_for_export
        from hostswap.tensor_parallel import TensorParallelError, plan_tensor_parallel

        if quantizer is not None or speculate_k is not None or fuse_linears:
            raise TensorParallelError("tensor_parallel cannot be combined with quantize, speculate_k or fuse_linears yet")
        prepare_for_export(model)  # experts routed first: their tables are what the plan splits
        plan = plan_tensor_parallel(model, tensor_parallel)
    full_shapes = {MODEL_PREFIX + n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    shards = {MODEL_PREFIX + s.name: s for s in plan.shards} if plan else {}
    stacked: dict = {}  # a fused linear's stacked parameter -> its parts (passes/fuse_sibling_linears.py)

    def tensor_for(entry) -> torch.Tensor:
        """The whole tensor of ``entry``, read (and converted) from the checkpoint."""
        if entry.fqn in stacked:
            # the parts' names do not reuse ``dtype``: Python 3.12 inlines a comprehension, and its
            # loop variable would shadow the export's dtype in the quantizer's lambda below
            return torch.cat([tensor_for(PtdTensor(part, part_dtype, part_shape)) for part, part_shape, part_dtype in stacked[entry.fqn]])
        if quantizer is not None and quantizer.weight_of(entry.fqn):
            return quantizer.inner_tensor(entry.fqn, lambda fqn, shape: tensor_for(PtdTensor(fqn, dtype, shape)))
        candidates = names.get(entry.fqn, ())
        converted = next((n for n in candidates if stored_as.is_converted(n)), None)
        if converted is not None:
            sources = stored_as.sources(converted)
            stored = " + ".join(sources[:2]) + (" + ..." if len(sources) > 2 else "")
            try:
                # float8 sources in the program's dtype before they are stacked: one copy of a block's experts in float32 would be
                # twice the bf16 table (the cast rounds each element the same before or after the stack)
                in_dtype = entry.dtype if entry.dtype.is_floating_point else None
                tensor = stored_as.build(converted, lambda name: checkpoint.tensor(name, in_dtype))
            except ConversionError as e:
                raise CheckpointError(f"{folder}: {e}") from None
            return _checked(tensor, entry, stored, f"built from {len(sources)} tensors of")
        stored = next((s for n in candidates for s in stored_as.sources(n) if s in checkpoint), None)
        if stored is None:
            raise CheckpointError(f"tensor '{entry.fqn.removeprefix(MODEL_PREFIX)}' of the model is in no shard of {folder}")
        return _checked(checkpoint.tensor(stored), entry, stored, f"in shard {checkpoint.shard_of(stored)} of")

    def _checked(tensor, entry, stored: str, where: str) -> torch.Tensor:
        if tuple(tensor.shape) != entry.shape:
            raise CheckpointError(f"tensor '{stored}' {where} {folder} has shape {list(tensor.shape)}; "
                                  f"the model built from its config has {list(entry.shape)}")
        if not (tensor.dtype.is_floating_point or tensor.dtype == entry.dtype):
            raise CheckpointError(f"tensor '{stored}' {where} {folder} is {tensor.dtype}; the model holds {entry.dtype}")
        return tensor.to(entry.dtype)

    bar = []  # created when the writing starts, so its rate and time left are the writing's

    def start(entries) -> None:
        if show_bar:
            from tqdm import tqdm

            bar.append(tqdm(total=sum(e.nbytes for e in entries), unit="B", unit_scale=True, unit_divisor=1024, desc="writing weights",
                            dynamic_ncols=True))

    def written(entry) -> None:
        if bar:
            bar[0].update(entry.nbytes)

    def programs_of(rank: int | None) -> tuple[dict, dict]:
        from hostswap.tensor_parallel import TENSOR_PARALLEL, sharded

        with sharded(model, plan, rank) if plan else contextlib.nullcontext():
            programs, constants = export_programs(model, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk, long_prefill_chunk=long_prefill_chunk,
                                                  prefetch_depth=prefetch_depth,
                                                  gather_from_host=gather_from_host, progress=progress, device="meta",
                                                  max_batch_size=max_batch_size, speculate_k=speculate_k, fuse_linears=fuse_linears,
                                                  stacked=stacked)
        if plan:
            say(f"rank {rank} of {plan.world} traced")
            constants[TENSOR_PARALLEL] = [rank, plan.world]
        return programs, constants

    ranks = list(range(plan.world)) if plan else [None]
    traced = [programs_of(rank) for rank in ranks]
    if plan:
        from hostswap.tensor_parallel import rank_path

        paths = [rank_path(out, rank) for rank in ranks]
        # the ranks' .ptds are written side by side, each weight's turn coming for every rank
        # at once: a tensor of the checkpoint is read once and split, not once per rank
        last: list = []

        def piece_for(entry, rank: int) -> torch.Tensor:
            if entry.fqn not in shards:
                return tensor_for(entry)
            if not last or last[0] != entry.fqn:
                last[:] = [entry.fqn, tensor_for(PtdTensor(entry.fqn, entry.dtype, full_shapes[entry.fqn]))]
            return shards[entry.fqn].piece(last[1], rank, plan.world)
    else:
        paths = [out]
        piece_for = lambda entry, _: tensor_for(entry)  # noqa: E731
    try:
        written_paths = save_streamed_together([programs for programs, _ in traced], paths, piece_for,
                                               constant_methods=[constants for _, constants in traced], progress=progress, on_start=start,
                                               on_written=written, values=buffer_values)
    finally:
        if bar:
            bar.pop().close()
    say(f"read {checkpoint.bytes_read / 2**20:.1f} MiB from {folder}'s shards")
    if plan is None:
        return written_paths[0]
    return [pte for pte, _ in written_paths], [ptd for _, ptd in written_paths]
