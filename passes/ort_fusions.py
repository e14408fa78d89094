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

from dflash_onnx.passes.base import PassContext

# the fused norms whose scale ORT binds to the normalized input's type, and the scale's input index
# (SimplifiedLayerNormalization takes a scale of another type, and returns that type)
NORM_SCALE = {"SkipSimplifiedLayerNormalization": 2}


def _cast_norm_scales(model: ir.Model) -> int:
    """Zero-centred RMSNorms (Qwen3.5: x_norm * (1 + w), computed in float32 and cast back) fuse with a float32
    scale beside float16 inputs, which ORT refuses to load: the scale is cast to the input's type (the norm still
    computes in float32 inside the kernel; the scale is rounded to float16 first), and a result the fusion left
    typed float32 is returned in the input's type and cast for its users. Returns the scales cast."""
    added = 0
    for node in list(model.graph):
        index = NORM_SCALE.get(node.op_type) if node.domain in ("", "com.microsoft") else None
        if index is None or len(node.inputs) <= index:
            continue
        source, scale = node.inputs[0], node.inputs[index]
        if source is None or scale is None or source.dtype is None or scale.dtype in (None, source.dtype):
            continue
        cast = ir.node("Cast", [scale], attributes={"to": source.dtype})
        cast.outputs[0].dtype, cast.outputs[0].shape = source.dtype, scale.shape
        model.graph.insert_before(node, cast)
        node.replace_input_with(index, cast.outputs[0])
        added += 1
        out = node.outputs[0]
        if out.dtype not in (None, source.dtype):  # the norm's result was the float32 product: cast back for its users
            wanted, uses = out.dtype, list(out.uses())
            out.dtype = source.dtype
            back = ir.node("Cast", [out], attributes={"to": wanted})
            back.outputs[0].dtype, back.outputs[0].shape = wanted, out.shape
            model.graph.insert_after(node, back)
            for user, position in uses:
                user.replace_input_with(position, back.outputs[0])
    return added


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
    fused["norm_scales_cast"] = _cast_norm_scales(ir_model)
    common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1)(ir_model)
    common_passes.RemoveInitializersFromInputsPass()(ir_model)
    return ir_model, {"fused": {name: n for name, n in fused.items() if n}}
