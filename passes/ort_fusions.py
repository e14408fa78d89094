"""ort-fusions: onnxscript's ONNX Runtime fusions (contrib ops the CPU and CUDA providers implement).

RMSNorm -> SimplifiedLayerNormalization, residual Add + RMSNorm -> SkipSimplifiedLayerNormalization,
scaled dot-product attention -> MultiHeadAttention, MatMul chains -> FusedMatMul. The graph then runs
only on ONNX Runtime: `lower --target ort` applies it, portable exports do not.

onnxscript's GroupQueryAttention fusion is left out on purpose: it derives sequence lengths from an HF
attention mask this graph does not have, and decodes wrong tokens (measured on the tiny Qwen3 pair:
ORT rejects the block-verify call). RoPE is fused by our own `rope-fusion` pass (run it first).
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import optimize
from onnxscript.rewriter import rewrite
from onnxscript.rewriter.ort_fusions import ORT_PATTERN_REWRITE_RULES
from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
from onnxscript.rewriter.ort_fusions.sdpa import fuse_sdpa
from onnxscript.rewriter.ort_fusions.sdpa_via_mha import replace_sdpa_by_mha
from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

from .base import PassContext


def run(ir_model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    common_passes.ShapeInferencePass()(ir_model)
    optimize(ir_model, inline=False)  # dflash::MoE stays one node (moe-fusion)
    fused = {
        "rms_normalization": fuse_rms_normalization(ir_model),
        "skip_rms_normalization": fuse_skip_rms_normalization(ir_model),
        "sdpa": fuse_sdpa(ir_model, apply_shape_inference=True),
    }
    fused["multi_head_attention"] = replace_sdpa_by_mha(ir_model)
    optimize(ir_model, inline=False)  # dflash::MoE stays one node (moe-fusion)
    rewrite(ir_model, ORT_PATTERN_REWRITE_RULES)
    common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1)(ir_model)
    common_passes.RemoveInitializersFromInputsPass()(ir_model)
    return ir_model, {"fused": {name: n for name, n in fused.items() if n}}
