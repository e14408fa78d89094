"""draft-attention: the draft's grouped-query attention as one ONNX Attention (opset 23) over its K/V.

The exported draft attends, non-causally, from its block to [context cache, new context rows, block]
keys. After ort-fusions that is a MultiHeadAttention whose keys and values are first transposed to
heads-first, repeated per query head (Unsqueeze, Expand, Reshape) and transposed back: two copies of the
whole cache per step, and a dozen kernels. ONNX's Attention takes the [batch, seq, kv_heads * head_dim]
keys and values as they are and groups the query heads itself (q_num_heads / kv_num_heads), so each
layer's chain becomes one Reshape and one Attention. GroupQueryAttention cannot do this: it is causal.
Drafts with as many kv heads as query heads reach MultiHeadAttention through one Reshape and are left
alone. Applied by the ORT lowering after ort-fusions; bound: float reordering only.

Option key_mask=1 (the ragged lowering's, for one draft call over several requests: dflash_onnx/runtime/batching.py)
gives
every rewritten Attention a boolean mask over its keys [past, new context rows, block], made in the graph from two
inputs, `draft_past_rows` and `draft_context_rows` (per batch row: how many of the call's past and new context rows
are that request's own; the rest pad it to the call's longest). Both default to "all of them" (overridable
initializers, which ORT logs a warning about at its default log level), so a call that does not feed them attends
as before, bit for bit (tested). `key_mask` in the details says every attention took it; drafts whose attention
has a mask of its own (causal or windowed: made from key indices, which padding shifts) or stays
MultiHeadAttention take none.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from dflash_onnx.passes.base import PassContext
from dflash_onnx.passes.ir_graph import add_constant, attr, const_ints, static_dims
from dflash_onnx.runtime.feeds import KEY_MASK_INPUTS
from dflash_onnx.runtime.manifest import GraphSpec

ATTENTION_OPSET = 23
ALL_ROWS = 2**62  # the inputs' default: more rows than any call has
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


def _rewrite(graph: ir.Graph, node: ir.Node, key_mask: Callable[[], ir.Value] | None) -> bool:
    """Replace one MultiHeadAttention over repeated K/V; False leaves it alone. `key_mask()`: the keys' mask,
    given to an attention that has none of its own."""
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
    mask = [inputs[5]] if inputs[5] is not None else [key_mask()] if key_mask else []  # a causal draft's mask
    attention = ir.node("Attention", [inputs[0], *(n.outputs[0] for n in new_nodes), *mask], options,
                        name=f"{node.name}_onnx_attention")
    attention.outputs[0].shape, attention.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
    ir.convenience.replace_nodes_and_values(graph, node, [node], [*new_nodes, attention], [node.outputs[0]],
                                            [attention.outputs[0]])
    return True


def _key_mask_maker(graph: ir.Graph, spec: GraphSpec) -> Callable[[], ir.Value]:
    """A function giving the keys' mask [batch, 1, block rows, keys], made (once, at the graph's start) from the
    call's shapes and the two row-count inputs (see the module docstring)."""
    made: list[ir.Value] = []

    def mask() -> ir.Value:
        if made:
            return made[0]
        rows_type = ir.TensorType(ir.DataType.INT64)
        counts = []
        for name in KEY_MASK_INPUTS:
            value = ir.Value(name=name, type=rows_type, shape=ir.Shape(["batch"]),
                             const_value=ir.tensor(np.array([ALL_ROWS], np.int64), name=name))
            graph.inputs.append(value)
            graph.register_initializer(value)
            counts.append(value)
        inputs = {v.name: v for v in graph.inputs}
        zero, one = (add_constant(graph, f"draft_key_mask_{n}", np.array(v, np.int64)) for n, v in (("zero", 0),
                                                                                                   ("one", 1)))
        column = add_constant(graph, "draft_key_mask_column", np.array([1], np.int64))
        nodes: list[ir.Node] = []

        def add(op: str, *args: ir.Value, **attributes) -> ir.Value:
            nodes.append(ir.node(op, list(args), attributes))
            return nodes[-1].outputs[0]

        past = add("Shape", inputs[spec.kv_inputs[0]], start=1, end=2)  # [past rows]
        context = add("Shape", inputs["target_hidden"], start=1, end=2)  # [new context rows]
        block = add("Shape", inputs["input_ids"], start=1, end=2)  # [block rows]: the queries
        before_block = add("Add", past, context)
        keys = add("Range", zero, add("Squeeze", add("Add", before_block, block)), one)  # [keys]: each key's index
        own_past, own_context = (add("Unsqueeze", value, column) for value in counts)  # [batch, 1]
        in_past = add("Less", keys, add("Min", own_past, past))
        in_context = add("And", add("GreaterOrEqual", keys, past),
                         add("Less", keys, add("Add", add("Min", own_context, context), past)))
        in_block = add("GreaterOrEqual", keys, before_block)
        valid = add("Or", add("Or", in_past, in_context), in_block)  # [batch, keys]
        mask_shape = add("Concat", column, column, block, column, axis=0)  # [1, 1, queries, 1]: to every query
        made.append(add("Expand", add("Unsqueeze", valid, add_constant(graph, "draft_key_mask_axes",
                                                                       np.array([1, 2], np.int64))), mask_shape))
        made[0].name = "draft_key_mask"
        graph.insert_before(next(iter(graph)), nodes)
        return made[0]

    return mask


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    """Rewrite every MultiHeadAttention over per-head repeated K/V (its additive mask, if any, carried over; the
    keys' mask given to the others with key_mask=1)."""
    if context.graph != "draft":
        return model, {"skipped": "the draft's attention only"}
    graph = model.graph
    candidates = [n for n in graph if n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft"]
    wanted = context.option("key_mask", "0") == "1"
    # an attention's own mask (a causal or windowed draft's) is made from the keys' indices, which a call padded
    # for several requests shifts: such drafts take no key mask, and keep one draft call per request
    own_masks = any(len(node.inputs) > 5 and node.inputs[5] is not None for node in candidates)
    key_mask = _key_mask_maker(graph, context.manifest.draft) if wanted and not own_masks else None
    count = sum(_rewrite(graph, node, key_mask) for node in candidates)
    if count:
        model.opset_imports[""] = max(model.opset_imports.get("", 0), ATTENTION_OPSET)
        RemoveUnusedNodesPass()(model)
    # every attention must take it (one left as MultiHeadAttention takes none), or a call cannot hold several requests
    masked = count == len(candidates) and any(value.name == KEY_MASK_INPUTS[0] for value in graph.inputs)
    return model, {"attentions": count, **({"key_mask": masked} if wanted else {})}
