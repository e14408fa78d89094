"""Gemma 4's routed experts in int4 / int8 for ONNX Runtime: each dflash::GeluTanhExperts as two QMoE calls (int4),
or its gathered weights read through GatherBlockQuantized (int8, or where the two calls do not fit).

The export's function (dflash_onnx/exporter/models/gelu_experts.py) takes the router's chosen experts and weights and
computes `down(gelu_tanh(gate(x)) * up(x))`. ONNX Runtime's QMoE reads int4 experts in place at MatMulNBits'
speed (GatherBlockQuantized unpacks int4 to float slowly, int8 fast), but computes `fc2(act(fc1(x)))` with a
unary activation or SwiGLU, not Gemma 4's gelu-tanh gate. So, where the gate and up rows fit in the hidden size
(2 x intermediate <= hidden, as in Gemma 4 26B-A4B: 1408 of 2816), the pass splits the expert at that product,
one QMoE on each side:

- first: fc1 = gate_up [E, 2I, H], identity, fc2 = a placement [E, H, 2I] (ones at (i, i)): each row's
  gate and up in its first 2I columns;
- between them, in the graph: FastGelu (the tanh form) of the gate times the up, zero-padded to H columns;
- second: fc1 = a selection [E, I, H] (ones at (i, i)), identity, fc2 = down [E, H, I].

Ones and zeros are exact in the symmetric blocks (scale -1/8, code 0). The placement and selection read as many
bytes per chosen expert as gate_up and down, so a token reads twice its experts' weights, in place, instead of
the copy a `Gather` makes; one placement and one selection serve every layer of the same shape. The kernels get
each token once per chosen expert, twice, routed to that expert alone, the graph weights and adds the results in
rank order, and padding rows skip the experts, as for the other families' QMoE (passes/experts.py).

For int8, and for int4 where the rows do not fit, the function is inlined and each weight it gathers becomes
GatherBlockQuantized over the same blocks, which dequantizes only the chosen experts, to float on every call.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import InlinePass

from dflash_onnx.artifacts.graph_files import GELU_EXPERTS_OP, MOE_DOMAIN
from dflash_onnx.passes.experts import (
    QuantizedExperts,
    expanded_rows,
    insert_nodes,
    int64s,
    kept_rows,
    lazy_initializer,
    weighted_sum,
)
from dflash_onnx.runtime.errors import DFlashError


def _is_gelu_experts(function: ir.Function) -> bool:
    return function.domain == MOE_DOMAIN and function.name == GELU_EXPERTS_OP


def calls(model: ir.Model) -> list[ir.Node]:
    return [node for node in model.graph if node.domain == MOE_DOMAIN and node.op_type == GELU_EXPERTS_OP]


def _refusal(node: ir.Node, block_size: int) -> str | None:
    for value in node.inputs[3:5]:
        if value is None or value.const_value is None:
            return "the experts' weights are not constants"
        if value.shape[2] % block_size:
            return f"{value.name}'s input size {value.shape[2]} is not a multiple of block {block_size}"
    return None


def _splits_in_qmoe(node: ir.Node, bits: int, block_size: int) -> bool:
    """Whether the two-QMoE form applies: int4 (GatherBlockQuantized unpacks int8 as fast as a float `Gather`
    copies, and QMoE's int8 form was measured to move a decode step's logits by 0.005 of their scale between the
    export and its buffer-form lowering), the gate and up rows fitting in the hidden size, k known."""
    if bits != 4:
        return False
    hidden, rows = node.inputs[3].shape[2], node.inputs[3].shape[1]
    k = node.inputs[1].shape[1] if node.inputs[1].shape is not None and len(node.inputs[1].shape) == 2 else None
    return isinstance(k, int) and rows <= hidden and hidden % block_size == 0


class _Identities:
    """Quantized [E, rows, columns] matrices of ones at (i, i): one initializer pair per shape, shared by layers."""

    def __init__(self, model: ir.Model, bits: int, block_size: int, quantizer):
        self.model, self.bits, self.block_size, self.quantizer = model, bits, block_size, quantizer
        self.made: dict[tuple[int, int, int, ir.DataType], tuple[ir.Value, ir.Value]] = {}

    def _one_expert(self, rows: int, columns: int, dtype: ir.DataType) -> tuple[np.ndarray, np.ndarray]:
        eye = np.eye(rows, columns, dtype=np.float32)
        packed, scales, _ = self.quantizer.qbits_block_quant(np.ascontiguousarray(eye.T))
        packed, scales = packed.reshape(rows, -1), scales.reshape(rows, -1).astype(dtype.numpy())
        if self.bits == 4:
            codes = np.stack([packed & 15, packed >> 4], -1).reshape(rows, columns).astype(np.float32) - 8
        else:
            codes = packed.astype(np.float32) - 128
        restored = (codes.reshape(rows, -1, self.block_size) * scales.astype(np.float32)[..., None]).reshape(
            rows, columns)
        if not np.array_equal(restored, eye):  # a quantizer whose blocks do not hold 0 and 1 exactly
            raise DFlashError(f"int{self.bits}: the experts' placement matrix does not quantize exactly")
        return packed, scales

    def get(self, experts: int, rows: int, columns: int, dtype: ir.DataType) -> tuple[ir.Value, ir.Value]:
        key = (experts, rows, columns, dtype)
        if key not in self.made:
            name = f"experts_identity_{experts}x{rows}x{columns}"

            def part(index: int):
                return lambda: np.ascontiguousarray(np.broadcast_to(
                    self._one_expert(rows, columns, dtype)[index][None], (experts, *self._shape(rows, columns)[index])))

            packed_shape, scale_shape = self._shape(rows, columns)
            self.made[key] = (
                lazy_initializer(self.model, f"{name}_Q{self.bits}", ir.DataType.UINT8, [experts, *packed_shape],
                                 part(0)),
                lazy_initializer(self.model, f"{name}_scales", dtype, [experts, *scale_shape], part(1)))
        return self.made[key]

    def _shape(self, rows: int, columns: int) -> tuple[tuple[int, int], tuple[int, int]]:
        return (rows, columns * self.bits // 8), (rows, columns // self.block_size)


def _quantized(model: ir.Model, value: ir.Value, bits: int, block_size: int, quantizer) -> tuple[ir.Value, ir.Value]:
    source = value.const_value
    experts, rows, k = source.shape
    parts = QuantizedExperts(source, False, quantizer)
    return (lazy_initializer(model, f"{value.name}_Q{bits}", ir.DataType.UINT8, [experts, rows, k * bits // 8],
                             parts.part(0)),
            lazy_initializer(model, f"{value.name}_scales", source.dtype, [experts, rows, k // block_size],
                             parts.part(1)))


def _two_qmoe(model: ir.Model, node: ir.Node, bits: int, block_size: int, quantizer, identities: _Identities,
              accuracy_level: int | None) -> None:
    """`node` -> QMoE (gate and up, placed) -> FastGelu(gate) * up -> QMoE (selected, down), weighted by the
    router's given weights (see the module's docstring)."""
    x, index, given, gate_up, down = node.inputs
    experts, rows, hidden = gate_up.shape
    intermediate, k = rows // 2, index.shape[1]
    dtype = gate_up.const_value.dtype
    gate_up_q, down_q = (_quantized(model, value, bits, block_size, quantizer) for value in (gate_up, down))
    placement = identities.get(experts, hidden, rows, dtype)
    selection = identities.get(experts, intermediate, hidden, dtype)
    kept = kept_rows(model)
    tokens, chosen, weights = x, index, given
    if kept:  # padding rows skip the experts (passes/experts.py)
        tokens, chosen, weights = (insert_nodes(model, node, [ir.node("Gather", [value, kept[0]], {"axis": 0})])
                                   for value in (x, index, given))
    expanded, routes = expanded_rows(model, node, tokens, chosen, x, k, hidden, experts)
    weights = insert_nodes(model, node, [ir.node("Cast", [weights], {"to": ir.DataType.FLOAT})])
    attributes = {"k": 1, "normalize_routing_weights": 1, "activation_type": "identity", "expert_weight_bits": bits,
                  "block_size": block_size, **({"accuracy_level": accuracy_level} if accuracy_level else {})}
    first = ir.node("QMoE", [expanded, routes, *gate_up_q, None, *placement, None], attributes,
                    domain="com.microsoft", name=f"{node.name}_gate_up", num_outputs=1)
    gate = ir.node("Slice", [first.outputs[0], int64s([0]), int64s([intermediate]), int64s([1])])
    up = ir.node("Slice", [first.outputs[0], int64s([intermediate]), int64s([rows]), int64s([1])])
    gelu = ir.node("FastGelu", [gate.outputs[0]], domain="com.microsoft")  # the tanh form, as gelu_pytorch_tanh
    product = ir.node("Mul", [gelu.outputs[0], up.outputs[0]])
    padded = ir.node("Pad", [product.outputs[0], int64s([0, 0, 0, hidden - intermediate])])
    second = ir.node("QMoE", [padded.outputs[0], routes, *selection, None, *down_q, None], attributes,
                     domain="com.microsoft", name=f"{node.name}_down", num_outputs=1)
    insert_nodes(model, node, [first, gate, up, gelu, product, padded, second])
    result = weighted_sum(model, second, second.outputs[0], weights, k, hidden, x, kept[1] if kept else None)
    output = node.outputs[0]
    result.type, result.shape, result.name, output.name = output.type, output.shape, output.name, None
    output.replace_all_uses_with(result, replace_graph_outputs=True)
    model.graph.remove(node, safe=True)


def _fold_shapes(model: ir.Model, value: ir.Value) -> None:
    """Each `Shape` of the float weight `value` (the inlined body reads gate_up's to split gate from up) as a
    constant: otherwise that one read keeps the whole float weight in the file beside its quantized copy (measured
    on the tiny Gemma 4 MoE pair: every layer's float gate_up stayed, int8's weights 1.0 MB instead of 0.5)."""
    if value.shape is None or not all(isinstance(dim, int) for dim in value.shape):
        return
    dims = list(value.shape)
    for shape in [use for use, _ in value.uses() if use.op_type == "Shape" and use.domain == ""]:
        start, end = shape.attributes.get_int("start", 0), shape.attributes.get_int("end", len(dims))
        constant = ir.node("Constant", [], {"value": ir.tensor(np.array(dims[start:end], np.int64))})
        output, result = shape.outputs[0], constant.outputs[0]
        result.type, result.shape, result.name, output.name = output.type, output.shape, output.name, None
        model.graph.insert_before(shape, constant)
        output.replace_all_uses_with(result, replace_graph_outputs=True)
        model.graph.remove(shape, safe=True)


def _gathered(model: ir.Model, nodes: list[ir.Node], bits: int, block_size: int, quantizer,
              kept: dict[str, str]) -> int:
    """`nodes` inlined, the weights their bodies gather read through GatherBlockQuantized; how many weights (a
    weight no Gather reads, from an export whose function ran every expert, goes into `kept`)."""
    weights = {value.name: value for node in nodes for value in node.inputs[3:5]}  # a weight once, if shared
    InlinePass(criteria=_is_gelu_experts)(model)
    done = 0
    for value in weights.values():
        gathers = [use for use, _ in value.uses() if use.op_type == "Gather" and use.domain == ""
                   and use.attributes.get_int("axis", 0) == 0 and use.inputs[0] is value]
        if not gathers:
            kept[value.name] = ("exported before the experts' function gathered the chosen experts (every expert "
                                "runs, in float): export again to quantize them")
            continue
        packed, scales = _quantized(model, value, bits, block_size, quantizer)
        _fold_shapes(model, value)
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
    return done


def quantize(model: ir.Model, bits: int, block_size: int, quantizer,
             accuracy_level: int | None = None) -> tuple[dict[str, int], dict[str, str]]:
    """Every dflash::GeluTanhExperts of `model` with its experts in `bits` (symmetric blocks: `quantizer` must
    be): as two QMoE where the gate and up rows fit in the hidden size, else through GatherBlockQuantized; returns
    how many of each form, and why others stay float."""
    kept, qmoe, gathered = {}, [], []
    for node in calls(model):
        why = _refusal(node, block_size)
        if why:
            kept[node.name] = why
        else:
            (qmoe if _splits_in_qmoe(node, bits, block_size) else gathered).append(node)
    identities = _Identities(model, bits, block_size, quantizer)
    for node in qmoe:
        _two_qmoe(model, node, bits, block_size, quantizer, identities, accuracy_level)
    counts = {"two_qmoe": len(qmoe)}
    if gathered:
        counts["gathered_weights"] = _gathered(model, gathered, bits, block_size, quantizer, kept)
    if not calls(model):
        model.functions.pop((MOE_DOMAIN, GELU_EXPERTS_OP, ""), None)
    if not any(node.domain == MOE_DOMAIN for node in model.graph):
        model.opset_imports.pop(MOE_DOMAIN, None)
    if qmoe or gathered:
        model.opset_imports.setdefault("com.microsoft", 1)
    return {name: count for name, count in counts.items() if count}, kept
