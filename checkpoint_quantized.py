"""Checkpoints published quantized, read as the weights they stand for.

Some of the largest checkpoints exist only quantized: DeepSeek-V3 and R1, and the ``-FP8``
releases of Qwen3, store each linear's weight as float8 e4m3 codes with one float32 scale per
block of its rows and columns (``<name>_scale_inv``, blocks of ``weight_block_size``, 128 x 128;
transformers' ``quant_method: "fp8"``). The streamed export (checkpoint.py) reads such a weight as
its codes times its block's scale, in float32, which it then converts to the program's dtype as
it converts any tensor: the weight transformers' own dequantization of the checkpoint gives.
The scales are read beside their weights and are not weights of the program themselves.

Any other ``quantization_config`` (GPTQ, AWQ, bitsandbytes, per-tensor float8, ...) is refused
at once, naming its method: reading its integer codes as weights would be a silent wrong model.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from hostswap.checkpoint import CheckpointError

BLOCK_FP8 = "fp8"  # transformers' quant_method of block-scaled float8 checkpoints
SCALE_SUFFIX = "_scale_inv"  # beside "<linear>.weight": "<linear>.weight_scale_inv"
FP8_CODES = (torch.float8_e4m3fn,)


@dataclasses.dataclass(frozen=True)
class BlockScaledFp8:
    """Float8 codes with one float32 scale per ``block`` (rows, columns) of each weight."""

    block: tuple[int, int]

    def scale_name(self, name: str) -> str:
        return name + SCALE_SUFFIX

    def is_scale(self, name: str) -> bool:
        return name.endswith(SCALE_SUFFIX)

    def weight_of(self, scale_name: str) -> str:
        return scale_name[: -len(SCALE_SUFFIX)]

    def dequantize(self, name: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``codes`` (a 2-D float8 weight) times its blocks' ``scale``, in float32."""
        rows, cols = self.block
        if codes.dim() != 2:
            raise CheckpointError(f"tensor '{name}' is float8 of {codes.dim()} dimensions; block-scaled float8 weights have 2")
        want = (-(-codes.shape[0] // rows), -(-codes.shape[1] // cols))
        if tuple(scale.shape) != want:
            raise CheckpointError(f"tensor '{name}' is float8 {list(codes.shape)} in blocks of {rows} x {cols}, so its scales "
                                           f"'{self.scale_name(name)}' must be {list(want)}, not {list(scale.shape)}")
        full = scale.float().repeat_interleave(rows, 0)[: codes.shape[0]].repeat_interleave(cols, 1)[:, : codes.shape[1]]
        return codes.float() * full


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
    if method == BLOCK_FP8 and isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return BlockScaledFp8((int(block[0]), int(block[1])))
    what = ("float8 without weight_block_size (per-tensor scales)" if method == BLOCK_FP8 else f"quant_method {method!r}")
    raise CheckpointError(
        f"{path} says the checkpoint is quantized ({what}); hostswap reads unquantized checkpoints and block-scaled float8 ones "
        "(quant_method 'fp8' with weight_block_size, as DeepSeek-V3 and Qwen3's FP8 releases). Use the unquantized release, or "
        "dequantize it once with transformers and save_pretrained; hostswap.llm.quantize then gives int8 or int4 weights")
