"""kv-buffer, ragged attention: the buffer form in standard ONNX ops that take a batch of requests at once.

ONNX Runtime's GroupQueryAttention refuses a batch above 1 when a call has more than one row and a past
(measured on 1.32), so requests cannot share a verify call on it. Here each layer writes its new rows with
TensorScatter (opset 24; write index per batch row) into the [batch, kv_heads, rows, head_dim] buffer the session
binds as both input and output, and attends with Attention (opset 24) over the buffer with `nonpad_kv_seqlen`
per batch row and `is_causal`, which ORT's CPU kernel aligns to each row's own length (a query at call row j of
batch row b sees keys below length_b - rows + j + 1: measured against a numpy reference). Each batch row is then
a request with its own committed length, all of them padded to the call's row count.

The I/O contract is the GroupQueryAttention form's (`seqlens_k` = each row's length after the call - 1,
`total_sequence_length`, unused here), so every runner of the buffer form feeds it unchanged; RoPE stays in the
graph (rotated at the call's `position_ids`). Layers with sliding windows or attention sinks are refused in one
line (ONNX Attention has neither). Selected by the kv-buffer pass's option attention=ragged.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from dflash_onnx.passes.ir_graph import add_constant, attr
from dflash_onnx.runtime.errors import DFlashError

HEADS_FIRST = [0, 2, 1, 3]
HINT = "lower with --kv-attention gqa"
OPSET = 24  # TensorScatter, and Attention's nonpad_kv_seqlen
IR_VERSION = 11  # the first IR version that opset 24 may be declared in


class RaggedRewriter:
    """Rewrites one target graph's layers, given the buffer-form rewriter that finds each layer's parts."""

    def __init__(self, finder):
        self.finder, graph = finder, finder.graph
        self.graph = graph
        ids = finder.inputs["input_ids"]
        int64 = ir.TensorType(ir.DataType.INT64)
        batch = ir.Shape([ids.shape[0]])
        # per batch row: the row count after the call (nonpad_kv_seqlen) and where the call's rows start
        rows = ir.node("Shape", [ids], {"start": 1, "end": 2}, outputs=[ir.Value(name="ragged_call_rows")])
        wide = ir.node("Cast", [finder.seqlens], {"to": ir.DataType.INT64},
                       outputs=[ir.Value(name="ragged_seqlens_k", type=int64, shape=batch)])
        one = add_constant(graph, "ragged_one", np.array(1, np.int64))
        lengths = ir.node("Add", [wide.outputs[0], one],
                          outputs=[ir.Value(name="ragged_kv_lengths", type=int64, shape=batch)])
        starts = ir.node("Sub", [lengths.outputs[0], rows.outputs[0]],
                         outputs=[ir.Value(name="ragged_write_indices", type=int64, shape=batch)])
        graph.insert_before(next(iter(graph)), [rows, wide, lengths, starts])
        self.lengths, self.starts = lengths.outputs[0], starts.outputs[0]
        self.split_heads = {}

    def _heads_shape(self, heads: int, head_dim: int) -> ir.Value:
        if heads not in self.split_heads:
            self.split_heads[heads] = add_constant(self.graph, f"ragged_heads_{heads}",
                                                   np.array([0, 0, heads, head_dim], np.int64))
        return self.split_heads[heads]

    def layer(self, layer: int) -> None:
        finder, spec = self.finder, self.finder.spec
        k_in, v_in, k_out, v_out, rows, attention = finder.parts(layer)
        if attention.op_type != "MultiHeadAttention":
            raise DFlashError(f"ragged attention: layer {layer} has attention sinks, which ONNX Attention does not "
                              f"take ({HINT})")
        if spec.kv_windows and spec.kv_windows[layer]:
            raise DFlashError(f"ragged attention: layer {layer} attends over a sliding window, which ONNX Attention "
                              f"does not take ({HINT})")
        _, head_dim = spec.kv_shape(spec.kv_inputs[2 * layer])
        heads = attr(attention, "num_heads")
        nodes, present = [], {}
        for role, past in (("key", k_in), ("value", v_in)):  # the call's rows written at each row's start
            scatter = ir.node("TensorScatter", [past, rows[role], self.starts], {"axis": 2},
                              outputs=[ir.Value(name=f"ragged_{role}_l{layer}", type=past.type)],
                              name=f"ragged_write_{role}_{layer}")
            nodes.append(scatter)
            present[role] = scatter.outputs[0]
        split = ir.node("Reshape", [attention.inputs[0], self._heads_shape(heads, head_dim)],
                        outputs=[ir.Value(name=f"ragged_query_bsnh_l{layer}")])
        query = ir.node("Transpose", [split.outputs[0]], {"perm": HEADS_FIRST},
                        outputs=[ir.Value(name=f"ragged_query_l{layer}")])
        options = {"is_causal": 1}
        if "scale" in attention.attributes:
            options["scale"] = attr(attention, "scale")
        attend = ir.node("Attention", [query.outputs[0], present["key"], present["value"], None, None, None,
                                       self.lengths], options, outputs=[ir.Value(name=f"ragged_heads_l{layer}")],
                         name=f"ragged_attention_{layer}")
        back = ir.node("Transpose", [attend.outputs[0]], {"perm": HEADS_FIRST},
                       outputs=[ir.Value(name=f"ragged_bsnh_l{layer}")])
        flat = ir.node("Reshape", [back.outputs[0], finder.flat_shape], outputs=[ir.Value(name=None)])
        nodes += [split, query, attend, back, flat]
        flat.outputs[0].type = attention.outputs[0].type or finder.kv_type
        flat.outputs[0].shape = ir.Shape([*finder.row_dims, heads * head_dim])
        finder.replace_present(k_out, v_out, present["key"], present["value"])
        ir.convenience.replace_all_uses_with(attention.outputs[0], flat.outputs[0])
        flat.outputs[0].name, attention.outputs[0].name = attention.outputs[0].name, None
        self.graph.insert_before(attention, nodes)
        self.graph.remove(attention, safe=True)


def declare_opset(model: ir.Model) -> None:
    """TensorScatter and Attention's nonpad_kv_seqlen are opset 24: the graph's default domain moves up to it (the
    exporter's ops keep their meaning between 18 and 24)."""
    model.opset_imports[""] = max(model.opset_imports.get("", OPSET), OPSET)
    model.ir_version = max(model.ir_version or 0, IR_VERSION)
