"""The precision plan of the compile: which nodes stay float32 when `-convert-to-fp16` converts the rest.

RMSNorm squares its input: x^2 leaves float16 once |x| reaches 256, far below the activations' own limit
(65504), so every RMSNorm's nodes are listed, found by the module the exporter recorded for each node
(QEfficient lists its CustomRMSNorm outputs the same way for the models that need it). The rest of the graph
is float16 on the device. Rotary tables (no in-graph trigonometry) and the scaled fc are the other half of
the plan, in the graphs themselves.
"""

from __future__ import annotations

import ast

import onnx

NORM_SUFFIX = "RMSNorm"
X_SQUARED_LIMIT = 256.0  # |x| at which x * x overflows float16 (256^2 = 65536 > 65504)
FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _modules(node: onnx.NodeProto) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.class_hierarchy":
            try:
                return [str(name) for name in ast.literal_eval(prop.value)]
            except (ValueError, SyntaxError):
                return []
    return []


def _float_values(model: onnx.ModelProto) -> set[str]:
    graph = model.graph
    values = list(graph.value_info) + list(graph.output)
    return {v.name for v in values if v.type.tensor_type.elem_type in FLOATS}


def norm_outputs(model: onnx.ModelProto) -> list[str]:
    """Float outputs of the nodes inside RMSNorm modules, in graph order."""
    floats = _float_values(model)
    return [name for node in model.graph.node if any(m.endswith(NORM_SUFFIX) for m in _modules(node)[:-1])
            for name in node.output if name in floats]


def draw_outputs(model: onnx.ModelProto, inputs: tuple[str, ...] = ("sample_uniform", "sample_temperature")
                 ) -> list[str]:
    """Float outputs of the nodes that depend on `inputs` (a DSpark draft's chain: the softmax at the temperature,
    its running sum, the uniform's point, and each row after a draw), in graph order: kept float32 so each token is
    drawn from the row the graph returns for it, at float32's rounding as on the other backends."""
    floats, reached = _float_values(model), set(inputs)
    kept = []
    for node in model.graph.node:  # graph order is topological
        if any(name in reached for name in node.input):
            reached.update(node.output)
            kept += [name for name in node.output if name in floats]
    return kept


def plan_report(fp32_outputs: dict[str, list[str]], calibration: dict) -> dict:
    """What the plan keeps in float32 and why, with the calibration's pre-norm peak against x^2's limit."""
    peak = calibration.get("norm_input_peak", 0.0)
    return {"fp32_nodes": {graph: len(names) for graph, names in fp32_outputs.items()},
            "rotary": "tables gathered by position", "norm_input_peak": peak,
            "norm_input_peak_at": calibration.get("norm_input_peak_at"),
            "x_squared_limit": X_SQUARED_LIMIT, "norms_would_overflow_in_fp16": peak >= X_SQUARED_LIMIT}
