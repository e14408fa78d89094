"""draft-attention: the draft's grouped-query attention as one ONNX Attention (opset 23) over its K/V.

The exported draft attends, non-causally, from its block to [context cache, new context rows, block]
keys. After ort-fusions that is a MultiHeadAttention whose keys and values are first transposed to
heads-first, repeated per query head (Unsqueeze, Expand, Reshape) and transposed back: two copies of the
whole cache per step, and a dozen kernels. ONNX's Attention takes the [batch, seq, kv_heads * head_dim]
keys and values as they are and groups the query heads itself (q_num_heads / kv_num_heads), so each
layer's chain becomes one Reshape and one Attention. GroupQueryAttention cannot do this: it is causal.
Drafts with as many kv heads as query heads reach MultiHeadAttention through one Reshape and are left
alone. Applied by the ORT lowering after ort-fusions; bound: float reordering only.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from .base import PassContext
from .ir_graph import add_constant, attr, const_ints, static_dims

ATTENTION_OPSET = 23
# heads-first, one copy per query head of its kv head, back to seq-first, flattened heads
REPEATED = ["Transpose", "Unsqueeze", "Expand", "Reshape", "Transpose", "Reshape"]
HEADS_FIRST = [0, 2, 1, 3]


def _repeated_rows(value: ir.Value, heads: int) -> tuple[ir.Value, int] | None:
    """The seq-first [batch, seq, kv_heads, head_dim] K or V that `value` repeats per query head, and its
    kv_heads; None when `value` is made any other way."""
    chain, current = [], value
    while (node := current.producer()) is not None and node.op_type in {"Reshape", "Transpose", "Unsqueeze",
                                                                          "Expand"}:
        chain.insert(0, node)
        current = node.inputs[0]
    chain = chain[-len(REPEATED):]
    if [n.op_type for n in chain] != REPEATED or const_ints(chain[1].inputs[1]) != [2]:
        return None  # [2]: the copies sit next to their kv head, the grouping Attention assumes
    origin = chain[0].inputs[0]
    shape = static_dims(origin)
    if any(list(attr(n, "perm", [])) != HEADS_FIRST for n in chain if n.op_type == "Transpose") or shape is None \
            or len(shape) != 4 or not isinstance(shape[2], int) or shape[2] < 1 or heads % shape[2]:
        return None
    return origin, shape[2]


def _rewrite(graph: ir.Graph, node: ir.Node) -> bool:
    """Replace one MultiHeadAttention over repeated K/V; False leaves it alone."""
    # inputs: query, key, value, bias, key_padding_mask, attention_bias (additive, as Attention's attn_mask)
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    heads = attr(node, "num_heads")
    if attr(node, "unidirectional", 0) != 0 or len(inputs) != 6 or any(inputs[3:5]) or heads is None \
            or any(output.uses() for output in node.outputs[1:]):
        return False
    found = [_repeated_rows(value, heads) for value in inputs[1:3]]
    if None in found or found[0][1] != found[1][1]:
        return False
    flat_shape = add_constant(graph, "draft_attention_flat_shape", np.array([0, 0, -1], np.int64))
    new_nodes = [ir.node("Reshape", [origin, flat_shape], outputs=[ir.Value(name=f"{origin.name}_flat_heads")])
                 for origin, _ in found]
    options = {"q_num_heads": heads, "kv_num_heads": found[0][1], "is_causal": 0}
    if "scale" in node.attributes:
        options["scale"] = attr(node, "scale")
    mask = [inputs[5]] if inputs[5] is not None else []  # a causal draft's mask
    attention = ir.node("Attention", [inputs[0], *(n.outputs[0] for n in new_nodes), *mask], options,
                        name=f"{node.name}_onnx_attention")
    attention.outputs[0].shape, attention.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
    ir.convenience.replace_nodes_and_values(graph, node, [node], [*new_nodes, attention], [node.outputs[0]],
                                            [attention.outputs[0]])
    return True


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    """Rewrite every MultiHeadAttention over per-head repeated K/V (its additive mask, if any, carried over)."""
    if context.graph != "draft":
        return model, {"skipped": "the draft's attention only"}
    graph = model.graph
    candidates = [n for n in graph if n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft"]
    count = sum(_rewrite(graph, node) for node in candidates)
    if count:
        model.opset_imports[""] = max(model.opset_imports.get("", 0), ATTENTION_OPSET)
        RemoveUnusedNodesPass()(model)
    return model, {"attentions": count}
