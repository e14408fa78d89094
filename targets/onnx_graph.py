"""Proto-level helpers shared by the ORT lowering's graph rewrites (targets/ort_*.py): who produces and
who reads each value, node attributes, and the tidy-up after a rewrite (dead nodes, reshape round trips,
topological order). The rewrites load graph structure only, so nothing here touches weights."""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx import helper


class GraphView:
    """Producers and consumers of a GraphProto's values, for the proto-level rewrites."""

    def __init__(self, graph: onnx.GraphProto):
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    return a.shape is not None and b.shape is not None and a.shape.rank() == b.shape.rank() and \
        all(x == y and (isinstance(x, int) or x.value is not None) for x, y in zip(a.shape, b.shape))


def _drop_round_trip_reshapes(graph: ir.Graph) -> int:
    """Remove Reshape chains whose output has the shape of the chain's input (the exporter's
    [b, s, heads * hd] -> [b, s, heads, hd] views that the rewrite flattens back): their readers read the
    input. Each removed Reshape is one kernel launch less per step."""
    removed = 0
    for node in list(graph):
        if node.op_type != "Reshape" or node.outputs[0].is_graph_output():
            continue
        source = node.inputs[0]
        while source.producer() is not None and source.producer().op_type == "Reshape" and len(source.uses()) == 1:
            source = source.producer().inputs[0]
        if _same_shape(source, node.outputs[0]):
            ir.convenience.replace_all_uses_with(node.outputs[0], source)
            removed += 1
    return removed


def tidied(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` without dead nodes and reshape round trips, in topological order."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

    ir_model = ir.serde.deserialize_model(model)
    RemoveUnusedNodesPass()(ir_model)  # first, so that the replaced attention's readers no longer count as uses
    if _drop_round_trip_reshapes(ir_model.graph):
        RemoveUnusedNodesPass()(ir_model)
    TopologicalSortPass()(ir_model)
    return ir.serde.serialize_model(ir_model)


