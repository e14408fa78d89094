"""Gemma 4's routed experts in int4 / int8: dflash::GeluTanhExperts inlined, the expert weights its body gathers
read through com.microsoft::GatherBlockQuantized.

The export's function body (exporter/models/gelu_experts.py) gathers the experts a call's tokens chose,
`Gather(gate_up_proj, chosen)` and `Gather(down_proj, chosen)`, and multiplies the call's tokens by them. ONNX
Runtime's QMoE cannot take its place: it routes by itself and gates with SwiGLU, Gemma 4 with gelu-tanh and its
router's own weights. So the quantized form keeps that body and quantizes what it gathers: each of those Gathers
becomes GatherBlockQuantized over the blocks MatMulNBits and QMoE use (symmetric, along each row's input axis,
the zero point implicit), which dequantizes the chosen experts only. The MatMuls reading them stay float, so a
token's result is computed the same way in a call of any size, as in the float form.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import InlinePass

from artifacts.graph_files import GELU_EXPERTS_OP, MOE_DOMAIN

from .experts import QuantizedExperts, lazy_initializer


def _is_gelu_experts(function: ir.Function) -> bool:
    return function.domain == MOE_DOMAIN and function.name == GELU_EXPERTS_OP


def calls(model: ir.Model) -> list[ir.Node]:
    return [node for node in model.graph if node.domain == MOE_DOMAIN and node.op_type == GELU_EXPERTS_OP]


def quantize(model: ir.Model, bits: int, block_size: int, quantizer) -> tuple[int, dict[str, str]]:
    """Every dflash::GeluTanhExperts of `model` inlined, each expert weight it gathers quantized in blocks of
    `block_size` (symmetric: `quantizer` must be); returns how many weights, and why others stay float."""
    nodes = calls(model)
    if not nodes:
        return 0, {}
    weights: dict[str, ir.Value] = {}
    kept = {}
    for node in nodes:
        for value in node.inputs[3:5]:
            if value is None or value.const_value is None:
                kept[node.name] = "the experts' weights are not constants"
            elif value.shape[2] % block_size:
                kept[node.name] = f"{value.name}'s input size {value.shape[2]} is not a multiple of block {block_size}"
            else:
                weights[value.name] = value
    InlinePass(criteria=_is_gelu_experts)(model)
    model.functions.pop((MOE_DOMAIN, GELU_EXPERTS_OP, ""), None)
    if not any(node.domain == MOE_DOMAIN for node in model.graph):
        model.opset_imports.pop(MOE_DOMAIN, None)
    done = 0
    for name, value in weights.items():
        gathers = [node for node, _ in value.uses() if node.op_type == "Gather" and node.domain == ""
                   and node.attributes.get_int("axis", 0) == 0 and node.inputs[0] is value]
        if not gathers:
            continue
        source = value.const_value
        experts, rows, k = source.shape
        parts = QuantizedExperts(source, False, quantizer)
        packed = lazy_initializer(model, f"{name}_Q{bits}", ir.DataType.UINT8, [experts, rows, k * bits // 8],
                                  parts.part(0))
        scales = lazy_initializer(model, f"{name}_scales", source.dtype, [experts, rows, k // block_size],
                                  parts.part(1))
        for gather in gathers:
            replacement = ir.node("GatherBlockQuantized", [packed, gather.inputs[1], scales],
                                  {"gather_axis": 0, "quantize_axis": 2, "block_size": block_size, "bits": bits},
                                  domain="com.microsoft", name=f"{gather.name}_Q{bits}", num_outputs=1)
            output, result = gather.outputs[0], replacement.outputs[0]
            result.type, result.shape, result.name, output.name = output.type, output.shape, output.name, None
            model.graph.insert_before(gather, replacement)
            output.replace_all_uses_with(result, replace_graph_outputs=True)
            model.graph.remove(gather, safe=True)
        done += 1
    if done:
        model.opset_imports.setdefault("com.microsoft", 1)
    return done, kept
