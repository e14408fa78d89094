"""tidy: dead nodes, reshape round trips and topological order, after the structural rewrites.

A rewrite that replaces an attention leaves the exporter's `[b, s, heads * hd] -> [b, s, heads, hd]` views
around it flattened back to where they began: a Reshape chain whose output has the shape of its input.
Their readers read the input instead; each removed Reshape is one kernel launch less per step.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from dflash_onnx.passes.base import PassContext


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    return a.shape is not None and b.shape is not None and a.shape.rank() == b.shape.rank() and \
        all(x == y and (isinstance(x, int) or x.value is not None) for x, y in zip(a.shape, b.shape))


def drop_round_trip_reshapes(graph: ir.Graph) -> int:
    """Bypass every Reshape chain whose output has the declared shape of the chain's input; returns how many."""
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


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    RemoveUnusedNodesPass()(model)  # first, so that replaced nodes' readers no longer count as uses
    removed = drop_round_trip_reshapes(model.graph)
    if removed:
        RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    return model, {"reshape_round_trips_removed": removed}
