"""The PyTorch pair with its weights rounded as the lossy passes a manifest records round them, by a quantizer of
its own: `parity` allows a transformed export to leave the float pair by what this reference moves, so a pass's
tolerance comes from outside the pass (not from the bound it declares).

int4 / int8: every weight matrix the pass would quantize (at least one block deep on its input axis; not an
embedding, nor a mixture-of-experts router, which stays float; the vocab projection only with `lm_head`) rounded to
the nearest of 2**bits levels per block of `block_size` along its last axis (an expert tensor's blocks fall along its
last axis whatever its layout: the size of the rounding is what the reference measures), symmetric or with a zero
point; with `accuracy_level` 4 the activations entering a rounded linear layer are rounded to int8 per block as
ONNX Runtime's kernel does. fp16: the pair run in float16.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from dflash_onnx.runtime.manifest import on_off

ROUNDING_PASSES = ("int4", "int8", "fp16")


def round_blocks(weight: torch.Tensor, bits: int, block_size: int, symmetric: bool = True) -> torch.Tensor:
    """`weight` with each block of `block_size` along its last axis rounded to 2**bits levels (nearest)."""
    shape = weight.shape
    width = shape[-1]
    pad = -width % block_size
    blocks = nn.functional.pad(weight.float(), (0, pad)).reshape(*shape[:-1], -1, block_size)
    if symmetric:
        top = 2 ** (bits - 1) - 1
        scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
        levels = torch.round(blocks / scale).clamp(-top - 1, top)
        rounded = levels * scale
    else:
        low = blocks.amin(-1, keepdim=True).clamp_max(0)
        high = blocks.amax(-1, keepdim=True).clamp_min(0)
        scale = ((high - low) / (2 ** bits - 1)).clamp_min(1e-12)
        zero = torch.round(-low / scale)
        rounded = (torch.round(blocks / scale + zero).clamp(0, 2 ** bits - 1) - zero) * scale
    return rounded.reshape(*shape[:-1], -1)[..., :width].to(weight.dtype)


def _round_activations(block_size: int):
    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        return (round_blocks(x, 8, block_size), *args[1:]) if x.shape[-1] >= block_size else args

    return hook


def _experts(config) -> int:
    config = getattr(config, "text_config", config)
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)


def _rounded_weights(module: nn.Module, bits: int, options: dict, vocab_size: int, experts: int,
                     stack: ExitStack) -> None:
    block_size = int(options.get("block_size", 64))
    symmetric = on_off(options.get("symmetric"), True)
    with_head = on_off(options.get("lm_head"), False)
    names = {id(p): n for n, p in module.named_parameters()}
    for param in {id(p): p for p in module.parameters()}.values():
        name = names[id(param)]
        if param.dim() < 2 or not param.is_floating_point() or param.shape[-1] < block_size or "embed" in name:
            continue
        if (param.dim() == 2 and experts and param.shape[0] == experts) or \
                (vocab_size in param.shape and not with_head):
            continue
        original = param.data
        param.data = round_blocks(original, bits, block_size, symmetric)
        stack.callback(setattr, param, "data", original)
    if int(options.get("accuracy_level", 4) or 0) == 4:
        for layer in module.modules():
            if isinstance(layer, nn.Linear) and layer.in_features >= block_size and \
                    (with_head or vocab_size not in (layer.in_features, layer.out_features)):
                stack.callback(layer.register_forward_pre_hook(_round_activations(block_size)).remove)


def _half(module: nn.Module, stack: ExitStack) -> None:
    originals = {id(t): (t, t.data) for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()}
    for tensor, data in originals.values():
        stack.callback(setattr, tensor, "data", data)
    for tensor, data in originals.values():
        tensor.data = data.half()


@contextmanager
def rounded(graphs: dict[str, nn.Module], passes: list[dict], vocab_size: int, config=None) -> Iterator[bool]:
    """Within it, the modules of `graphs` ("target", "draft") hold their weights rounded as `passes` (a manifest's
    records) round them; yields whether any pass rounds. The float weights are back on leaving."""
    experts = _experts(config) if config is not None else 0
    with ExitStack() as stack:
        applied = False
        for record in passes:
            name, options = record["name"], record.get("options", {})
            if name not in ROUNDING_PASSES:
                continue
            applied = True
            chosen = options.get("graphs", "both")
            for graph, module in graphs.items():
                if chosen not in ("both", graph):
                    continue
                if name == "fp16":
                    _half(module, stack)
                else:
                    _rounded_weights(module, int(name[3:]), options, vocab_size, experts, stack)
        yield applied
