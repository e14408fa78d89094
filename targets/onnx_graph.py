"""Proto-level helpers shared by the ORT lowering's graph rewrites (targets/ort_*.py): who produces and
who reads each value, node attributes, small constants and declared shapes, and the tidy-up after a rewrite (dead nodes, reshape round trips,
topological order). The rewrites load graph structure only, so nothing here touches weights."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper


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


def constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """An initializer stored in the graph (None for a computed value, or one kept in the external data file,
    which structure-only loading leaves unread)."""
    for tensor in graph.initializer:
        if tensor.name == name and tensor.data_location != TensorProto.EXTERNAL:
            return numpy_helper.to_array(tensor)
    return None


def constant_ints(graph: onnx.GraphProto, name: str) -> list[int] | None:
    value = constant(graph, name)
    return None if value is None else value.reshape(-1).tolist()


def value_shape(graph: onnx.GraphProto, name: str) -> list | None:
    """The declared shape of a value (ints and dim names), None when the graph declares none."""
    for value in (*graph.value_info, *graph.input, *graph.output):
        if value.name == name and value.type.tensor_type.HasField("shape"):
            return [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]
    return None


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


