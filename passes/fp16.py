"""fp16: weights and activations to float16 (ONNX Runtime's converter), graph I/O kept float32.

Norm statistics (Pow/ReduceMean/Sqrt/Reciprocal), Softmax and the RoPE trigonometry stay float32
islands; values beyond float16's range are clamped by the converter and counted in the report.
"""

from __future__ import annotations

import onnx

FP32_ISLANDS = ["Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax", "Cos", "Sin", "Range", "CumSum"]


def run(model: onnx.ModelProto, graph: str, options: dict) -> tuple[onnx.ModelProto, dict]:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(model, keep_io_types=True, op_block_list=FP32_ISLANDS,
                                         disable_shape_infer=True)
    casts = sum(n.op_type == "Cast" for n in converted.graph.node)
    return converted, {"fp32_islands": FP32_ISLANDS, "casts": casts}
