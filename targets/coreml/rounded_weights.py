"""The weights as a `--bits` package holds them, for the check's PyTorch reference.

coremltools' `linear_symmetric` `per_block` quantization (the lowering's `--bits`): every 2-D weight of more than
its weight_threshold values, taken in float16, split into blocks of `group_size` input channels of one row; a
float16 scale per block, max|w| / (2**(bits-1) - 1); values rounded to signed integers in +-(2**(bits-1) - 1).
The check runs its float32 reference with those weights rounded the same way (written here from that rule, and
tested against coremltools' own quantizer), so a correct package differs from it by float16 compute only, and the
check keeps float16's tolerance at 4 and 8 bits, where a comparison with the unrounded weights could not tell a
defect from rounding (a Qwen3-4B-shaped int4 pair: 0.76 of the logit scale).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dflash_onnx.targets.coreml.sizes import QUANTIZED_FROM


def quantized(weight: torch.Tensor, group_size: int) -> bool:
    """Whether coremltools quantizes `weight`: 2-D, more than its weight_threshold values, rows that split into
    blocks of `group_size`."""
    return weight.dim() == 2 and weight.numel() > QUANTIZED_FROM and weight.shape[1] % group_size == 0


def rounded(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """`weight` [rows, inputs] quantized block-wise as coremltools does and dequantized, in float32; unchanged
    where coremltools leaves it float16 (`quantized`)."""
    if not quantized(weight, group_size):
        return weight.float()
    rows, inputs = weight.shape
    levels = 2 ** (bits - 1) - 1
    # float16 arithmetic throughout, as coremltools computes on the float16 weights
    blocks = weight.detach().to(torch.float16).reshape(rows, inputs // group_size, group_size)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / levels
    integers = torch.clamp(torch.round(blocks / torch.where(scale > 0, scale, 1.0)), -levels, levels)
    return (integers * scale).float().reshape(rows, inputs)


@contextmanager
def rounded_weights(module: nn.Module, bits: int, group_size: int) -> Iterator[None]:
    """Every parameter under `module` that coremltools quantizes replaced by its rounded copy (`rounded`) for the
    duration, put back after; parameters sharing a tensor (tied) share the copy."""
    owners = {id(m): m for m in module.modules()}.values()
    kept = [(owner, dict(owner._parameters)) for owner in owners]
    copies: dict[tuple, torch.Tensor] = {}
    try:
        for owner, own in kept:
            for name, param in own.items():
                if param is None or not param.is_floating_point() or not quantized(param, group_size):
                    continue
                key = (param.data_ptr(), tuple(param.shape), param.stride())
                if key not in copies:
                    copies[key] = rounded(param.detach(), bits, group_size).to(param.dtype)
                owner._parameters[name] = nn.Parameter(copies[key], requires_grad=False)
        yield
    finally:
        for owner, own in kept:
            owner._parameters.update(own)
