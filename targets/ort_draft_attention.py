"""The ORT lowering's draft attention: one ONNX Attention (opset 23) over the concatenated K/V.

The exported draft attends, non-causally, from its block to [context cache, new context rows, block]
keys. After ort-fusions that is a MultiHeadAttention whose keys and values are first transposed to
heads-first, repeated per query head (Unsqueeze, Expand, Reshape) and transposed back: two copies of the
whole cache per step, and a dozen kernels. ONNX's Attention takes the [batch, seq, kv_heads * head_dim]
keys and values as they are and groups the query heads itself (q_num_heads / kv_num_heads), so each
layer's chain becomes one Reshape and one Attention. GroupQueryAttention cannot do this: it is causal.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .onnx_graph import GraphView, attributes, constant_ints, tidied, value_shape

ATTENTION_OPSET = 23
# heads-first, one copy per query head of its kv head, back to seq-first, flattened heads (drafts whose
# query and kv heads are as many reach MultiHeadAttention through one Reshape already and are left alone)
REPEATED = ["Transpose", "Unsqueeze", "Expand", "Reshape", "Transpose", "Reshape"]


def _repeated_rows(view: GraphView, graph: onnx.GraphProto, name: str, heads: int) -> tuple[str, int] | None:
    """The seq-first [batch, seq, kv_heads, head_dim] K or V that `name` repeats per query head, and its
    kv_heads; None when `name` is made any other way."""
    chain, current = [], name
    while (node := view.producer.get(current)) is not None and node.op_type in {"Reshape", "Transpose", "Unsqueeze",
                                                                                 "Expand"}:
        chain.insert(0, node)
        current = node.input[0]
    chain = chain[-len(REPEATED):]
    if [n.op_type for n in chain] != REPEATED or constant_ints(graph, chain[1].input[1]) != [2]:
        return None  # [2]: the copies sit next to their kv head, the grouping Attention assumes
    transposes = [n for n in chain if n.op_type == "Transpose"]
    origin = chain[0].input[0]
    shape = value_shape(graph, origin)
    if any(attributes(t).get("perm") != [0, 2, 1, 3] for t in transposes) or shape is None or len(shape) != 4 \
            or not isinstance(shape[2], int) or shape[2] < 1 or heads % shape[2]:
        return None
    return origin, shape[2]


def to_onnx_attention(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Rewrite every MultiHeadAttention over per-head repeated K/V (its additive mask, if any, carried over);
    returns the model and how many attentions were rewritten (0 leaves the model as it was)."""
    graph = model.graph
    for index, node in enumerate(graph.node):
        node.name = node.name or f"unnamed_{index}"
    view = GraphView(graph)
    replaced: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        attrs = attributes(node)
        # inputs: query, key, value, bias, key_padding_mask, attention_bias (additive, as Attention's attn_mask)
        inputs = list(node.input) + [""] * (6 - len(node.input))
        if node.op_type != "MultiHeadAttention" or attrs.get("unidirectional", 0) != 0 or len(inputs) != 6 \
                or any(inputs[3:5]):
            continue
        found = [_repeated_rows(view, graph, name, attrs["num_heads"]) for name in node.input[1:3]]
        if None in found or found[0][1] != found[1][1]:
            continue
        flat = []
        new_nodes = []
        for origin, _ in found:
            flat.append(f"{origin}_flat_heads")
            new_nodes.append(helper.make_node("Reshape", [origin, "draft_attention_flat_shape"], [flat[-1]]))
        options = {"q_num_heads": attrs["num_heads"], "kv_num_heads": found[0][1], "is_causal": 0}
        if "scale" in attrs:
            options["scale"] = attrs["scale"]
        mask = [inputs[5]] if inputs[5] else []  # a causal draft's mask
        new_nodes.append(helper.make_node("Attention", [node.input[0], *flat, *mask], [node.output[0]],
                                          name=f"{node.name}_onnx_attention", **options))
        replaced[node.name] = new_nodes
    if not replaced:
        return model, 0
    nodes = []
    for node in graph.node:
        nodes.extend(replaced.get(node.name, [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.append(helper.make_tensor("draft_attention_flat_shape", TensorProto.INT64, [3], [0, 0, -1]))
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, ATTENTION_OPSET)
    return tidied(model), len(replaced)
