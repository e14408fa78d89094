"""fp16: weights and activations to float16 (ONNX Runtime's converter), graph I/O kept float32.

Norm statistics (Pow/ReduceMean, the epsilon Add, Sqrt/Reciprocal), Softmax and RoPE (the angles
position * inv_freq, which reach ctx_len radians, and their Cos/Sin) stay float32 islands. Before
converting the draft, its fc (n_taps*hidden -> hidden, summing several layers' features) is divided by
a power of two so its output stays well inside float16: hidden_norm follows it, and RMSNorm is scale
invariant, so the draft's output is unchanged. Then every float tensor of the graph is measured on
calibration feeds and an activation beyond float16's range is reported as a warning.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx import numpy_helper
from onnx_ir.passes.common import ShapeInferencePass

from dflash_onnx.passes.base import PassContext, loaded_proto
from dflash_onnx.passes.calibration import activation_peaks
from dflash_onnx.passes.fp16_range import fp16_range_report, power_of_two_scale

FP32_ISLANDS = ["Pow", "ReduceMean", "Sqrt", "Reciprocal", "Softmax", "Cos", "Sin", "Range", "CumSum"]
DRAFT_FEATURES = "target_hidden"


def _draft_fc(model: onnx.ModelProto) -> tuple[onnx.NodeProto, onnx.TensorProto] | None:
    """The MatMul applying fc to the target features, and its weight initializer."""
    producers = {o: n for n in model.graph.node for o in n.output}
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        source = producers.get(node.input[0])
        reads_features = node.input[0] == DRAFT_FEATURES or (
            source is not None and source.op_type == "Cast" and source.input[0] == DRAFT_FEATURES)
        weight = node.input[1]
        if weight in producers and producers[weight].op_type == "Transpose":
            weight = producers[weight].input[0]
        if reads_features and weight in initializers:
            return node, initializers[weight]
    return None


def _scale_fc(model: onnx.ModelProto, feeds: list[dict]) -> dict:
    found = _draft_fc(model)
    if found is None:
        return {"fc_scale": None, "fc_note": f"no MatMul reads {DRAFT_FEATURES} through a constant weight"}
    node, weight = found
    peak = max(activation_peaks(model, feeds).get(node.output[0], 0.0), 0.0)
    scale = power_of_two_scale(peak)
    if scale > 1:
        values = numpy_helper.to_array(weight)
        weight.CopyFrom(numpy_helper.from_array((values / scale).astype(values.dtype), weight.name))
    return {"fc_output_peak": peak, "fc_scale": scale}


def _with_value_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """The converter casts around fp32 islands only where it knows a tensor's type: infer missing ones."""
    known = {v.name for v in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    if all(o in known or not o for n in model.graph.node for o in n.output):
        return model
    ir_model = ir.serde.deserialize_model(model)
    ShapeInferencePass(strict_mode=False)(ir_model)  # works on large models (weights set aside)
    return ir.serde.serialize_model(ir_model)


def _island_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes kept float32: the island op types, the epsilon Add between a norm's mean and its Sqrt (it
    holds the mean square, which float16 cannot), and the RoPE angle computation feeding Cos/Sin."""
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def norm_epsilon(node: onnx.NodeProto) -> bool:
        return node.op_type == "Add" and any(
            producers.get(i) is not None and producers[i].op_type == "ReduceMean" for i in node.input) and any(
            c.op_type == "Sqrt" for c in consumers.get(node.output[0], []))

    # RoPE angles (position * inv_freq, up to ctx_len radians) need float32's resolution: keep every
    # node upstream of a Cos/Sin in float32, not just the trigonometry.
    angle_nodes, pending = set(), [n for n in model.graph.node if n.op_type in ("Cos", "Sin")]
    while pending:
        node = pending.pop()
        for name in node.input:
            source = producers.get(name)
            if source is not None and id(source) not in angle_nodes:
                angle_nodes.add(id(source))
                pending.append(source)
    return [n for n in model.graph.node if n.op_type in FP32_ISLANDS or norm_epsilon(n) or id(n) in angle_nodes]


def _drop_round_trips(model: onnx.ModelProto) -> int:
    """The converter casts every float32 island's output to float16 and back before the next island
    (Pow -> fp16 -> fp32 -> ReduceMean): read the float32 value directly instead. Returns how many."""
    producers = {o: n for n in model.graph.node for o in n.output}

    def cast_to(node: onnx.NodeProto | None) -> int | None:
        return None if node is None or node.op_type != "Cast" else onnx.helper.get_attribute_value(node.attribute[0])

    graph_outputs = {o.name for o in model.graph.output}
    replaced = {}
    for node in model.graph.node:
        narrowing = producers.get(node.input[0]) if node.op_type == "Cast" else None
        if cast_to(node) == onnx.TensorProto.FLOAT and cast_to(narrowing) == onnx.TensorProto.FLOAT16 \
                and node.output[0] not in graph_outputs:
            replaced[node.output[0]] = narrowing.input[0]
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            if name in replaced:
                node.input[index] = replaced[name]
    used = {i for n in model.graph.node for i in n.input} | graph_outputs
    while True:  # drop the casts nothing reads any more
        dead = [n for n in model.graph.node if n.op_type == "Cast" and n.output[0] not in used]
        if not dead:
            break
        for node in dead:
            model.graph.node.remove(node)
        used = {i for n in model.graph.node for i in n.input} | graph_outputs
    return len(replaced)


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    graph, model = context.graph, loaded_proto(model)
    for index, node in enumerate(model.graph.node):  # the converter blocks nodes by name
        node.name = node.name or f"{node.op_type}_{index}"
    feeds = context.calibration_feeds or []
    island_nodes = _island_nodes(model)
    details: dict = {"fp32_islands": FP32_ISLANDS, "fp32_nodes": len(island_nodes)}
    if feeds:
        if graph == "draft":
            details.update(_scale_fc(model, feeds))
        islands = {o for n in island_nodes for o in n.output}
        peaks = {name: peak for name, peak in activation_peaks(model, feeds).items() if name not in islands}
        details.update(fp16_range_report(peaks))  # what will be computed in float16
        if details["fp16_overflow"]:
            where = details["largest_activation_at"]
            message = (f"{graph}: activation {details['largest_activation']:.3g} at {where} "
                       "exceeds float16's range; it will saturate")
            details["warnings"] = [message]
    converted = convert_float_to_float16(_with_value_types(model), keep_io_types=True, op_block_list=FP32_ISLANDS,
                                         node_block_list=[n.name for n in island_nodes], disable_shape_infer=True)
    details["float16_round_trips_removed"] = _drop_round_trips(converted)
    details["casts"] = sum(n.op_type == "Cast" for n in converted.graph.node)
    return ir.from_proto(converted), details
