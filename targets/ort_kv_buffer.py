"""The ORT lowering's buffer form: the target's attention as GroupQueryAttention over preallocated K/V.

In the exported (concat) form every step transposes the past K/V, concatenates the new rows, transposes
`present` back and repeats K/V per query head: five copies of the whole cache per layer, a cost that grows
with the context. Here each layer's attention becomes one com.microsoft GroupQueryAttention whose
`past_key`/`past_value` are [batch, kv_heads, ctx_len, head_dim] buffers the session binds as both input
and output (ORT then writes the new rows in place), and whose `seqlens_k` / `total_sequence_length`
inputs carry the committed length: rollback is a smaller length on the next call.

Input: a target graph after `rope-fusion` and `ort-fusions` (attention as MultiHeadAttention over
`Concat(Transpose(past), new)`); the causal mask comes from the lengths, so targets with sliding-window
layers are refused by the lowering's check.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import GraphSpec, TensorSpec

from .onnx_graph import GraphView, attributes, tidied
from .ort_rope_cache import rope_tables

SHAPE_ONLY = {"Unsqueeze", "Expand", "Reshape", "Transpose", "Squeeze", "Identity"}


def _only_consumer(view: GraphView, name: str, op_type: str) -> onnx.NodeProto:
    """The one `op_type` node reading `name`, besides Shape nodes (the mask's; checked dead afterwards)."""
    users = [u for u in view.consumers.get(name, []) if u.op_type != "Shape"]
    if len(users) != 1 or users[0].op_type != op_type:
        raise DFlashError(f"buffer form: expected {name} to feed one {op_type}, found "
                          f"{[u.op_type for u in users]} (lower with --kv-buffer off)")
    return users[0]


def _attention_reading(view: GraphView, name: str) -> tuple[onnx.NodeProto, int]:
    """The MultiHeadAttention that `name` reaches through shape-only ops, and the input slot it enters."""
    frontier = [name]
    while frontier:
        current = frontier.pop()
        for user in view.consumers.get(current, []):
            if user.op_type == "MultiHeadAttention":
                return user, list(user.input).index(current)
            if user.op_type in SHAPE_ONLY and user.input[0] == current:
                frontier.append(user.output[0])
    raise DFlashError(f"buffer form: no MultiHeadAttention reads {name}: run the ort-fusions pass first "
                      "(lower with --kv-buffer off to keep the concat form)")

SEQLENS, TOTAL = "seqlens_k", "total_sequence_length"


def _through(view: GraphView, name: str, op_type: str, **attrs) -> str | None:
    """The input of the `op_type` node (with these attributes) that produces `name`, else None."""
    node = view.producer.get(name)
    if node is None or node.op_type != op_type or any(attributes(node).get(k) != v for k, v in attrs.items()):
        return None
    return node.input[0]


def _rotary(view: GraphView, initializers: dict, attention: onnx.NodeProto, key_rows: str,
            base_dir: str | None) -> tuple[str, str, np.ndarray] | None:
    """When the layer's q and k rotations are whole-head, non-interleaved RotaryEmbeddings over
    cos/sin(position * inv_freq): the unrotated q and k ([b, s, heads, hd]) and inv_freq, so that
    GroupQueryAttention can rotate them itself (do_rotary). None when the graph looks any other way."""
    heads_first = [0, 2, 1, 3]
    rotations = [view.producer.get(key_rows)]
    query_rotated = _through(view, attention.input[0], "Reshape")
    query_rotated = query_rotated and _through(view, query_rotated, "Transpose", perm=heads_first)
    rotations.append(view.producer.get(query_rotated) if query_rotated else None)
    if any(r is None or r.op_type != "RotaryEmbedding" or attributes(r).get("interleaved", 0) != 0
           or attributes(r).get("rotary_embedding_dim", 0) != 0 for r in rotations):
        return None
    k_rot, q_rot = rotations
    if list(k_rot.input[2:4]) != list(q_rot.input[2:4]):
        return None
    unrotated = [_through(view, r.input[0], "Transpose", perm=heads_first) for r in (q_rot, k_rot)]
    cos, sin = view.producer.get(k_rot.input[2]), view.producer.get(k_rot.input[3])
    if None in unrotated or cos is None or sin is None or (cos.op_type, sin.op_type) != ("Cos", "Sin") \
            or cos.input[0] != sin.input[0]:
        return None
    angles = view.producer.get(cos.input[0])
    if angles is not None and angles.op_type == "Reshape":
        angles = view.producer.get(angles.input[0])
    if angles is None or angles.op_type != "Mul":
        return None
    frequencies = [initializers[i] for i in angles.input if i in initializers]
    if len(frequencies) != 1:
        return None
    inv_freq = numpy_helper.to_array(frequencies[0], base_dir or "").reshape(-1)
    return unrotated[0], unrotated[1], inv_freq


def to_kv_buffer(model: onnx.ModelProto, spec: GraphSpec, ctx_len: int,
                 base_dir: str | None = None) -> onnx.ModelProto:
    """Rewrite every layer's attention of the target graph `model` (described by `spec`) to the buffer form.
    Float32 graphs with head sizes that are multiples of 16 also hand RoPE to GroupQueryAttention
    (do_rotary with a ctx_len cos/sin cache computed
    as the graph computes it: float32 position * inv_freq), which removes the rotations and their
    transposes."""
    graph = model.graph
    for index, node in enumerate(graph.node):  # nodes are removed by name below
        node.name = node.name or f"unnamed_{index}"
    view = GraphView(graph)
    initializers = {t.name: t for t in graph.initializer}
    kv_elem = {i.name: i.type.tensor_type.elem_type for i in graph.input}[spec.kv_inputs[0]]
    new_nodes, dead, cache = [], set(), None
    widths: dict[str, int] = {}  # last dimension of each [batch, seq, width] value added
    for layer in range(spec.num_layers):
        k_in, v_in = spec.kv_inputs[2 * layer], spec.kv_inputs[2 * layer + 1]
        k_out, v_out = spec.kv_outputs[2 * layer], spec.kv_outputs[2 * layer + 1]
        rows, attention = {}, None
        for role, past, present in (("key", k_in, k_out), ("value", v_in, v_out)):
            to_heads_first = _only_consumer(view, past, "Transpose")
            concat = _only_consumer(view, to_heads_first.output[0], "Concat")
            if list(concat.input)[:1] != [to_heads_first.output[0]] or len(concat.input) != 2:
                raise DFlashError(f"buffer form: {past} is not concatenated with the new rows in layer {layer}")
            back = view.producer.get(present)
            if back is None or back.op_type != "Transpose" or back.input[0] != concat.output[0]:
                raise DFlashError(f"buffer form: {present} is not the transposed concatenation of layer {layer}")
            found, slot = _attention_reading(view, concat.output[0])
            if attention is not None and found is not attention:
                raise DFlashError(f"buffer form: keys and values of layer {layer} reach different attentions")
            if slot != (1 if role == "key" else 2):
                raise DFlashError(f"buffer form: the {role}s of layer {layer} enter attention input {slot}")
            attention, rows[role] = found, concat.input[1]
            dead.add(back.name)  # GQA produces `present` now; the concatenation dies with the attention
        attrs = attributes(attention)
        # ORT's GroupQueryAttention rotates only heads whose size is a multiple of 16
        rotary = _rotary(view, initializers, attention, rows["key"], base_dir) \
            if kv_elem == TensorProto.FLOAT and spec.head_dim % 16 == 0 else None
        flat, query, extra = {}, attention.input[0], []
        for role, name in rows.items():  # new rows [b, kv, t, hd] -> [b, t, kv*hd], as GQA takes them
            seq_first = f"{name}_bsnh_l{layer}"
            flat[role] = f"{name}_bsd_l{layer}"
            if role == "key" and rotary is not None:
                seq_first = rotary[1]  # the unrotated keys, already [b, t, kv, hd]
            elif heads_last := _through(view, name, "Transpose", perm=[0, 2, 1, 3]):
                seq_first = heads_last  # the rows before they were made heads-first
            else:
                new_nodes.append(helper.make_node("Transpose", [name], [seq_first], perm=[0, 2, 1, 3]))
            new_nodes.append(helper.make_node("Reshape", [seq_first, "kv_buffer_bsd_shape"], [flat[role]]))
            widths[flat[role]] = spec.num_kv_heads * spec.head_dim
        gqa_attrs = {"num_heads": attrs["num_heads"], "kv_num_heads": spec.num_kv_heads}
        if "scale" in attrs:
            gqa_attrs["scale"] = attrs["scale"]
        if rotary is not None:
            query = f"gqa_query_l{layer}"
            new_nodes.append(helper.make_node("Reshape", [rotary[0], "kv_buffer_bsd_shape"], [query]))
            widths[query] = attrs["num_heads"] * spec.head_dim
            if cache is None:
                cache = rope_tables(ctx_len, rotary[2], "kv_buffer_cache")
            extra = [cache[0].name, cache[1].name]
            gqa_attrs.update(do_rotary=1, rotary_interleaved=0)
        new_nodes.append(helper.make_node(
            "GroupQueryAttention", [query, flat["key"], flat["value"], k_in, v_in, SEQLENS, TOTAL, *extra],
            [attention.output[0], k_out, v_out], name=f"gqa_buffer_{layer}", domain="com.microsoft", **gqa_attrs))
        widths[attention.output[0]] = attrs["num_heads"] * spec.head_dim
        dead.add(attention.name)
    kept = [node for node in graph.node if node.name not in dead]
    del graph.node[:]
    graph.node.extend(kept + new_nodes)
    _declare_rows(graph, widths, kv_elem)
    graph.initializer.append(helper.make_tensor("kv_buffer_bsd_shape", TensorProto.INT64, [3], [0, 0, -1]))
    if cache is not None:
        graph.initializer.extend(cache)
    buffer_shape = ["batch", spec.num_kv_heads, ctx_len, spec.head_dim]
    for collection in (graph.input, graph.output):
        for value in collection:
            if value.name in spec.kv_inputs or value.name in spec.kv_outputs:
                value.CopyFrom(helper.make_tensor_value_info(value.name, kv_elem, buffer_shape))
    graph.input.extend([helper.make_tensor_value_info(SEQLENS, TensorProto.INT32, ["batch"]),
                        helper.make_tensor_value_info(TOTAL, TensorProto.INT32, [])])
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    model = tidied(model)
    readers = {(n.op_type, n.name) for n in model.graph.node for name in n.input
               if name in spec.kv_inputs and not _reads_batch_only(n)}
    others = sorted(r for r in readers if r[0] != "GroupQueryAttention")
    if others:
        raise DFlashError(f"buffer form: K/V inputs still read by {others} (lower with --kv-buffer off)")
    return model


def _reads_batch_only(node: onnx.NodeProto) -> bool:
    """Shape(x)[0:1]: the batch size, the same in both layouts (the exporter reads it from a K/V input)."""
    attrs = attributes(node)
    return node.op_type == "Shape" and attrs.get("start", 0) == 0 and attrs.get("end") == 1


def _declare_rows(graph: onnx.GraphProto, widths: dict[str, int], elem: int) -> None:
    """Shapes [batch, seq, width] of the values the rewrite adds (batch, seq: input_ids' dims), so that
    `tidied` sees which reshape chains end in the shape they began with."""
    batch, seq = {i.name: i for i in graph.input}["input_ids"].type.tensor_type.shape.dim
    dims = [d.dim_param or d.dim_value for d in (batch, seq)]
    kept = [v for v in graph.value_info if v.name not in widths]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    graph.value_info.extend(helper.make_tensor_value_info(name, elem, [*dims, width]) for name, width in widths.items())


def buffer_spec(spec: GraphSpec, ctx_len: int) -> GraphSpec:
    """The target's GraphSpec in the buffer form: K/V buffers of ctx_len rows and the two length inputs."""
    kv = set(spec.kv_inputs) | set(spec.kv_outputs)

    def resized(t: TensorSpec) -> TensorSpec:
        return TensorSpec(t.name, t.dtype, ["batch", spec.num_kv_heads, ctx_len, spec.head_dim]) if t.name in kv else t

    inputs = [resized(t) for t in spec.inputs] + [TensorSpec(SEQLENS, "int32", ["batch"]),
                                                  TensorSpec(TOTAL, "int32", [])]
    return GraphSpec(spec.file, inputs, [resized(t) for t in spec.outputs], spec.num_layers, spec.num_kv_heads,
                     spec.head_dim, list(spec.kv_inputs), list(spec.kv_outputs))
