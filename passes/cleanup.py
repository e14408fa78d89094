"""cleanup: onnxscript's optimizer (constant folding, dead code) then onnx-ir's CSE and shape inference."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    RemoveUnusedNodesPass,
    ShapeInferencePass,
)


def run(model: onnx.ModelProto, graph: str, options: dict) -> tuple[onnx.ModelProto, dict]:
    ir_model = ir.serde.deserialize_model(model)
    onnxscript.optimizer.optimize(ir_model, onnx_shape_inference=False)
    for step in (CommonSubexpressionEliminationPass(), RemoveUnusedNodesPass()):
        step(ir_model)
    try:
        ShapeInferencePass()(ir_model)
        inferred = True
    except Exception:  # inference is best-effort: large models can exceed protobuf's 2 GB limit
        inferred = False
    return ir.serde.serialize_model(ir_model), {"shape_inference": inferred}
