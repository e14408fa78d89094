"""cleanup: onnxscript's optimizer (constant folding, dead code) then onnx-ir's CSE and shape inference."""

from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    RemoveUnusedNodesPass,
    ShapeInferencePass,
)

from dflash_onnx.passes.base import PassContext


def run(ir_model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    onnxscript.optimizer.optimize(ir_model, onnx_shape_inference=False, inline=False)  # dflash::MoE stays one node
    for step in (CommonSubexpressionEliminationPass(), RemoveUnusedNodesPass()):
        step(ir_model)
    try:
        ShapeInferencePass()(ir_model)
        inferred = True
    except Exception:  # inference is best-effort: large models can exceed protobuf's 2 GB limit
        inferred = False
    return ir_model, {"shape_inference": inferred}
