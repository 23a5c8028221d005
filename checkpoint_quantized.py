"""Checkpoints published quantized, read as the weights they stand for.

Some of the largest checkpoints exist only quantized: DeepSeek-V3 and R1, and the ``-FP8``
releases of Qwen3, store each linear's weight as float8 e4m3 codes with one float32 scale per
block of its rows and columns (``<name>_scale_inv``, blocks of ``weight_block_size``, 128 x 128;
transformers' ``quant_method: "fp8"``). The streamed export (checkpoint.py) reads such a weight as
its codes times its block's scale, in float32, then in the program's dtype. A partial last block
(a dimension that is not a whole number of blocks) takes its own block's scale, as DeepSeek's
reference dequantization does; where the blocks divide the weight, the result is the one
transformers' dequantizing load gives. The scales are read beside their weights and are not
weights of the program themselves. Everything is checked from the shards' headers when the
checkpoint is opened, before anything is traced or written.

Any other ``quantization_config`` (GPTQ, AWQ, bitsandbytes, compressed-tensors, per-tensor
float8, ...) is refused at once, naming its method, and so are scales that are not multipliers
(UE8M0 exponents), weights that are not e4m3 codes, and grids that do not fit their weight:
read as weights, their codes would be a silently wrong model.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from hostswap.checkpoint import CheckpointError

BLOCK_FP8 = "fp8"  # transformers' quant_method of block-scaled float8 checkpoints
SCALE_SUFFIX = "_scale_inv"  # beside "<linear>.weight": "<linear>.weight_scale_inv"
CODE_DTYPES = (torch.float8_e4m3fn,)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # multipliers


@dataclasses.dataclass(frozen=True)
class BlockScaledFp8:
    """Float8 e4m3 codes with one scale per ``block`` (rows, columns) of each 2-D weight."""

    block: tuple[int, int]

    def scale_name(self, name: str) -> str:
        return name + SCALE_SUFFIX

    def is_scale(self, name: str) -> bool:
        return name.endswith(SCALE_SUFFIX)

    def weight_of(self, scale_name: str) -> str:
        return scale_name[: -len(SCALE_SUFFIX)]

    def problem(self, weight_dtype: torch.dtype, weight_shape: tuple[int, ...], scale_dtype: torch.dtype, scale_shape: tuple[int, ...]) -> str | None:
        """Why a weight and its scales, as their headers describe them, cannot be read as codes x
        scales (None: they can). Checked for every weight when the checkpoint is opened."""
        if weight_dtype not in CODE_DTYPES:
            return f"is {weight_dtype} with scales beside it; block-scaled float8 weights are {', '.join(map(str, CODE_DTYPES))} codes"
        if scale_dtype not in SCALE_DTYPES:  # a byte per scale is an exponent (UE8M0) or a code, not a multiplier
            return f"has {scale_dtype} scales; hostswap reads block scales stored as {', '.join(str(d).removeprefix('torch.') for d in SCALE_DTYPES)}"
        if len(weight_shape) != 2:
            return f"is float8 of {len(weight_shape)} dimensions; hostswap reads block-scaled float8 weights of 2"
        rows, cols = self.block
        want = (-(-weight_shape[0] // rows), -(-weight_shape[1] // cols))
        if tuple(scale_shape) != want:
            return f"is float8 {list(weight_shape)} in blocks of {rows} x {cols}, so its scales must be {list(want)}, not {list(scale_shape)}"
        return None

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``codes`` (checked by ``problem``) times its blocks' ``scale``, each product in float32
        (a partial last block takes its own scale), then in ``dtype`` where given. One block of
        rows at a time: the float32 weight is the only full-size temporary."""
        rows, cols = self.block
        out = codes.float()
        for i, start in enumerate(range(0, out.shape[0], rows)):
            out[start : start + rows].mul_(scale[i].float().repeat_interleave(cols)[: out.shape[1]])
        return out if dtype is None else out.to(dtype)


def checkpoint_quantization(folder: str | os.PathLike) -> BlockScaledFp8 | None:
    """How the checkpoint in ``folder`` is quantized, from its ``config.json``: None where it is
    not; a ``BlockScaledFp8``; else ``CheckpointError`` naming the method."""
    path = os.path.join(os.fspath(folder), "config.json")
    try:
        with open(path) as f:
            quantization = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # no readable config: the model's own build reports that
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    block = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    if method == BLOCK_FP8 and block is not None:
        if isinstance(block, (list, tuple)) and len(block) == 2 and all(type(b) is int and b > 0 for b in block):
            return BlockScaledFp8((block[0], block[1]))
        raise CheckpointError(f"{path}: quantization_config's weight_block_size {block!r} is not two whole numbers above 0")
    what = "float8 without weight_block_size (per-tensor scales)" if method == BLOCK_FP8 else f"quant_method {method!r}"
    raise CheckpointError(
        f"{path} says the checkpoint is quantized ({what}); hostswap reads unquantized checkpoints and block-scaled float8 ones "
        "(quant_method 'fp8' with weight_block_size, as DeepSeek-V3's and Qwen3's FP8 releases). Use the model's unquantized "
        "release; hostswap.llm.quantize and export-llm --quantize then give int8 or int4 weights")
