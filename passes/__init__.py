"""Graph passes: ONNX -> ONNX transformations of exported graphs, each a function plus a report.

A pass is `run(model: onnx.ModelProto, graph: "target" | "draft", options: dict) -> (model, details)`;
`apply_pipeline` (passes/pipeline.py) measures nodes and bytes around each one and writes the report.
`bound` is the largest logit difference against the untransformed graph the pass is allowed, relative
to the largest |logit| of the untransformed graph (tested on the tiny random pairs, whose 64-wide random
matrices are far harder to quantize than trained checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx
import onnx_ir as ir

PassFunction = Callable[[onnx.ModelProto, str, dict], "tuple[onnx.ModelProto, dict]"]


@dataclass(frozen=True)
class GraphPass:
    name: str
    run: PassFunction
    bound: float
    lossy: bool
    help: str
    calibrated: bool = False  # run() gets options["calibration_feeds"]: recorded inputs of this graph
    # the same rewrite on an onnx-ir model in place, returning the details: a pipeline of such passes loads
    # the graph with its weights memory-mapped instead of read into memory (structure-only rewrites)
    run_ir: Callable[[ir.Model, str, dict], dict] | None = None


def registry() -> dict[str, GraphPass]:
    from . import cleanup, fp16, ort_fusions, quantize, rope_fusion

    passes = [
        GraphPass("cleanup", cleanup.run, 1e-5, False, "constant folding, dead code and CSE, shape inference"),
        GraphPass("rope-fusion", rope_fusion.run, 1e-5, False,
                  "one RotaryEmbedding per q/k rotation, cos/sin once per position stream "
                  "(form=com.microsoft|onnx|hoist)", run_ir=rope_fusion.run_ir),
        GraphPass("ort-fusions", ort_fusions.run, 1e-5, False,
                  "ONNX Runtime contrib fusions (onnxscript): SimplifiedLayerNormalization, "
                  "SkipSimplifiedLayerNormalization, RotaryEmbedding, MultiHeadAttention; ORT only",
                  run_ir=ort_fusions.run_ir),
        GraphPass("int8", quantize.int8, 0.15, True, "block-wise int8 weight-only MatMulNBits"),
        GraphPass("int4", quantize.int4, 0.75, True, "block-wise int4 weight-only MatMulNBits"),
        GraphPass("fp16", fp16.run, 1e-2, True,
                  "float16 weights and activations, fp32 norm/softmax islands, draft fc pre-scaled, overflow check",
                  calibrated=True),
    ]
    return {p.name: p for p in passes}
