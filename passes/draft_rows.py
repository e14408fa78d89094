"""draft-rows: the draft's K/V outputs become the new context rows only; the runner keeps the rest.

The exported draft returns `present = Concat(past, new rows)` and then concatenates the block's keys
and values to that again for its attention: two copies of the whole context cache per step. Here each
`present` output becomes the new rows alone and the attention reads `Concat(past, new rows, block)`,
one copy; the runner (runners.RowsDraft) appends the rows to a preallocated buffer whose filled prefix
it feeds back as the next `past` (a view, no copy). The one copy left is the attention's contiguous
K/V: ONNX Attention has no in-place cache, and GroupQueryAttention, which has one, is causal.
Applied by the ORT lowering's buffer form (the manifest then says `draft_kv: rows`); exact.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from dflash_onnx.passes.base import PassContext
from dflash_onnx.passes.ir_graph import attr, made_by, readers


def _plan(past: ir.Value, present: ir.Value) -> tuple[ir.Node, list[ir.Node]] | None:
    """The Concat(past, rows) making `present`, and its readers (each a Concat(present, block) on axis 1)."""
    concat = made_by(present, "Concat", axis=1)
    if concat is None or len(concat.inputs) != 2 or concat.inputs[0] is not past:
        return None
    users = readers(present)
    if any(u.op_type != "Concat" or u.inputs[0] is not present or attr(u, "axis") != 1 for u in users):
        return None
    return concat, users


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    """Rewrite every K/V output of the draft graph to its new rows (none unless every output is made the
    expected way)."""
    if context.graph != "draft":
        return model, {"skipped": "the draft's K/V only"}
    graph, spec = model.graph, context.manifest.draft
    inputs, outputs = {v.name: v for v in graph.inputs}, {v.name: v for v in graph.outputs}
    plans = [_plan(inputs[past], outputs[present]) for past, present in zip(spec.kv_inputs, spec.kv_outputs)]
    if None in plans:
        return model, {"outputs": 0, "declined": "a K/V output is not Concat(past, new rows) read by Concats"}
    for concat, users in plans:
        past, rows = concat.inputs
        for user in users:  # Concat(past ++ rows, block) -> Concat(past, rows, block)
            joined = ir.node("Concat", [past, rows, *user.inputs[1:]], {"axis": 1}, name=f"{user.name}_rows")
            ir.convenience.replace_nodes_and_values(graph, user, [user], [joined], [user.outputs[0]],
                                                    [joined.outputs[0]])
        present = concat.outputs[0]
        identity = ir.node("Identity", [rows], name=f"{present.name}_rows")
        ir.convenience.replace_nodes_and_values(graph, concat, [concat], [identity], [present], [identity.outputs[0]])
        identity.outputs[0].shape = ir.Shape(["batch", "ctx_new", spec.num_kv_heads, spec.head_dim])
    RemoveUnusedNodesPass()(model)
    return model, {"outputs": len(plans)}
