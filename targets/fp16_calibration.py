"""Float16 calibration of the PyTorch pair for lowerings that fold the draft's fc into the target graph
(AI 100, CoreML): the largest activation on random prompts, and the power-of-two scale for fc's output."""

from __future__ import annotations

import sys

import torch

from dflash_onnx.passes.fp16_range import FP16_MAX, power_of_two_scale


def calibrate_fc_scale(tapped, draft, vocab_size: int, mask_token_id: int, block_size: int, prompts: int = 4,
                       length: int = 64, seed: int = 0) -> dict:
    """Run target and draft on random prompts: the largest activation anywhere (is float16 safe?), the largest
    RMSNorm input (whose square leaves float16 at 256), and the fc scale keeping fc's output squares (RMSNorm)
    inside float16: |fc(x)| / scale <= 128."""
    largest = {"value": 0.0, "where": ""}
    norm_input = {"value": 0.0, "where": ""}

    def norm_hook(name):
        def record(_module, args):
            peak = float(args[0].detach().float().abs().max()) if args[0].numel() else 0.0
            if peak > norm_input["value"]:
                norm_input.update(value=peak, where=name)
        return record

    def hook(name):
        def record(_module, _args, output):
            for tensor in output if isinstance(output, tuple) else (output,):
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
                    peak = float(tensor.detach().float().abs().max())
                    if peak > largest["value"]:
                        largest.update(value=peak, where=name)
        return record

    modules = [(f"target.{n}", m) for n, m in tapped.lm.named_modules() if n]
    modules += [(f"draft.{n}", m) for n, m in draft.named_modules() if n]
    handles = [module.register_forward_hook(hook(name)) for name, module in modules]
    # hidden_norm reads fc's output, which the graphs divide by the scale: accounted for below
    handles += [module.register_forward_pre_hook(norm_hook(name)) for name, module in modules
                if type(module).__name__.endswith("RMSNorm") and name != "draft.hidden_norm"]
    generator = torch.Generator().manual_seed(seed)
    fc_peak = 0.0
    try:
        with torch.no_grad():
            for _ in range(prompts):
                ids = torch.randint(0, vocab_size, (1, length), generator=generator)
                out = tapped(ids, torch.arange(length)[None], *tapped.empty_cache(dtype=tapped.lm.dtype))
                fc_peak = max(fc_peak, float(draft.fc(out[2]).float().abs().max()))
                block = torch.full((1, block_size), mask_token_id)
                block[0, 0] = out[1][0, -1]
                draft(block, out[2], torch.arange(length + block_size)[None], *draft.empty_cache(dtype=out[2].dtype))
    finally:
        for handle in handles:
            handle.remove()
    scale = power_of_two_scale(fc_peak)
    if fc_peak / scale > norm_input["value"]:
        norm_input.update(value=fc_peak / scale, where="draft.hidden_norm (fc output / fc scale)")
    return {"largest_activation": largest["value"], "largest_activation_at": largest["where"],
            "fc_output_peak": fc_peak, "fc_scale": scale, "fp16_overflow": largest["value"] > FP16_MAX,
            "norm_input_peak": norm_input["value"], "norm_input_peak_at": norm_input["where"]}


def calibrate_for_fp16(tapped, draft, manifest, compiler_flag: str = "") -> dict:
    """`calibrate_fc_scale` for an export's pair, with a warning on stderr when an activation overflows."""
    calibration = calibrate_fc_scale(tapped, draft, manifest.vocab_size, manifest.mask_token_id, manifest.block_size)
    if calibration["fp16_overflow"]:
        note = f" ({compiler_flag})" if compiler_flag else ""
        print(f"warning: activation {calibration['largest_activation']:.3g} at "
              f"{calibration['largest_activation_at']} overflows float16{note}", file=sys.stderr)
    return calibration
