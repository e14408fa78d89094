"""The ORT lowering's draft context cache: the graph returns only the new rows; the runner keeps the rest.

The exported draft returns `present = Concat(past, new rows)` and then concatenates the block's keys
and values to that again for its attention: two copies of the whole context cache per step. Here each
`present` output becomes the new rows alone and the attention reads `Concat(past, new rows, block)`,
one copy; the runner (runners.RowsDraft) appends the rows to a preallocated buffer whose filled prefix
it feeds back as the next `past` (a view, no copy). The one copy left is the attention's contiguous
K/V: ONNX Attention has no in-place cache, and GroupQueryAttention, which has one, is causal.
"""

from __future__ import annotations

import onnx
from onnx import helper

from dflash_onnx.manifest import GraphSpec, TensorSpec

from .onnx_graph import GraphView, attributes, tidied


def to_new_rows(model: onnx.ModelProto, spec: GraphSpec) -> tuple[onnx.ModelProto, int]:
    """Rewrite every K/V output of the draft graph `model` to its new rows; returns the model and the number
    of outputs rewritten (0, with the model unchanged, unless every output is made the expected way)."""
    graph = model.graph
    view = GraphView(graph)
    plans = []
    for past, present in zip(spec.kv_inputs, spec.kv_outputs):
        concat = view.producer.get(present)
        if concat is None or concat.op_type != "Concat" or attributes(concat).get("axis") != 1 \
                or len(concat.input) != 2 or concat.input[0] != past:
            return model, 0
        readers = view.consumers.get(present, [])
        if any(r.op_type != "Concat" or list(r.input[:1]) != [present] or attributes(r).get("axis") != 1
               for r in readers):
            return model, 0
        plans.append((concat, readers))
    for concat, readers in plans:
        past, rows = concat.input
        for reader in readers:
            reader.input[:] = [past, rows, *reader.input[1:]]
        replacement = helper.make_node("Identity", [rows], list(concat.output), name=f"{concat.output[0]}_rows")
        concat.CopyFrom(replacement)
    new_rows = ["batch", "ctx_new", spec.num_kv_heads, spec.head_dim]
    for value in graph.output:
        if value.name in spec.kv_outputs:
            value.CopyFrom(helper.make_tensor_value_info(value.name, value.type.tensor_type.elem_type, new_rows))
    return tidied(model), len(plans)


def rows_spec(spec: GraphSpec) -> GraphSpec:
    """The draft's GraphSpec once its K/V outputs are the new rows."""
    outputs = [TensorSpec(t.name, t.dtype, ["batch", "ctx_new", spec.num_kv_heads, spec.head_dim])
               if t.name in spec.kv_outputs else t for t in spec.outputs]
    return GraphSpec(spec.file, list(spec.inputs), outputs, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                     list(spec.kv_inputs), list(spec.kv_outputs))
