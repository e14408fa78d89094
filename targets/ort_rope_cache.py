"""The ORT lowering's draft RoPE: RotaryEmbedding reads a constant cos/sin cache at the call's positions.

After rope-fusion, each position stream of the draft computes its angles on every call (Unsqueeze, Cast,
Mul by inv_freq, Slice to the stream, Sin, Cos) and hands RotaryEmbedding cos/sin rows indexed by a
Range 0..n-1 (Shape, Squeeze, Range, Reshape): about twenty small kernels per step. com.microsoft
RotaryEmbedding can instead index a [rows, rotary_dim / 2] cache by the real positions, so each stream
becomes one Slice of the graph's position_ids. The cache is computed as the graph computes the angles
(float32 position x float32 inv_freq); float32 graphs only (the op wants cos/sin in the input's dtype).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .onnx_graph import GraphView, constant, constant_ints, tidied


def rope_tables(rows: int, inv_freq: np.ndarray, prefix: str) -> tuple[onnx.TensorProto, onnx.TensorProto]:
    """cos and sin of position x inv_freq for positions 0..rows-1, [rows, rotary_dim / 2], computed as the
    exported graph computes its angles (float32 position times float32 inv_freq)."""
    angles = np.arange(rows, dtype=np.float32)[:, None] * inv_freq.astype(np.float32).reshape(1, -1)
    return (numpy_helper.from_array(np.cos(angles).astype(np.float32), f"{prefix}_cos"),
            numpy_helper.from_array(np.sin(angles).astype(np.float32), f"{prefix}_sin"))


def _angles(view: GraphView, graph: onnx.GraphProto, rotation: onnx.NodeProto) -> tuple[str, list[str], np.ndarray] | None:
    """For a rotation fed Cos/Sin(Reshape(Slice(Mul(Cast(Unsqueeze(positions, -1)), inv_freq), starts, ends,
    seq axis, steps))): the [batch, seq] positions, the Slice's starts/ends/steps and inv_freq; else None."""
    cos, sin = view.producer.get(rotation.input[2]), view.producer.get(rotation.input[3])
    if cos is None or sin is None or (cos.op_type, sin.op_type) != ("Cos", "Sin") or cos.input[0] != sin.input[0]:
        return None
    flat = view.producer.get(cos.input[0])
    cut = flat and flat.op_type == "Reshape" and view.producer.get(flat.input[0])
    if not cut or cut.op_type != "Slice" or len(cut.input) < 4 or constant_ints(graph, cut.input[3]) not in ([1], [-2]):
        return None
    multiply = view.producer.get(cut.input[0])
    if multiply is None or multiply.op_type != "Mul":
        return None
    constants = [constant(graph, name) for name in multiply.input]
    computed = [view.producer.get(name) for name, value in zip(multiply.input, constants) if value is None]
    inv_freq = [value for value in constants if value is not None]
    if len(inv_freq) != 1 or len(computed) != 1 or computed[0] is None or computed[0].op_type != "Cast":
        return None
    unsqueeze = view.producer.get(computed[0].input[0])
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or constant_ints(graph, unsqueeze.input[1]) not in ([2], [-1]):
        return None
    return unsqueeze.input[0], [cut.input[1], cut.input[2], *cut.input[4:]], inv_freq[0].astype(np.float32).reshape(-1)


def to_rope_cache(model: onnx.ModelProto, rows: int) -> tuple[onnx.ModelProto, int]:
    """Rewrite every float32 RotaryEmbedding fed per-call cos/sin to a `rows`-row cache; returns the model
    and how many were rewritten. Positions must stay below `rows` (the lowering's capacity + a block)."""
    graph = model.graph
    view = GraphView(graph)
    elem = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input)}
    streams: dict[tuple, str] = {}  # one Slice of the positions per stream, shared by its rotations
    new_nodes, cache, count = [], None, 0
    for node in graph.node:
        if node.op_type != "RotaryEmbedding" or node.domain != "com.microsoft" or len(node.input) != 4 \
                or elem.get(node.input[0]) != TensorProto.FLOAT:
            continue
        found = _angles(view, graph, node)
        if found is None:
            continue
        positions, slice_inputs, inv_freq = found
        if cache is None:
            cache = (*rope_tables(rows, inv_freq, "rope_cache"), inv_freq)
        elif not np.array_equal(cache[2], inv_freq):
            continue  # another rotary base: left as it is
        key = (positions, *slice_inputs)
        if key not in streams:
            streams[key] = f"rope_cache_positions_{len(streams)}"
            axes = "rope_cache_sequence_axis"
            starts, ends, *steps = slice_inputs
            new_nodes.append(helper.make_node("Slice", [positions, starts, ends, axes, *steps], [streams[key]]))
        node.input[1], node.input[2], node.input[3] = streams[key], "rope_cache_cos", "rope_cache_sin"
        count += 1
    if not count:
        return model, 0
    graph.node.extend(new_nodes)
    graph.initializer.extend(cache[:2])
    graph.initializer.append(helper.make_tensor("rope_cache_sequence_axis", TensorProto.INT64, [1], [1]))
    return tidied(model), count
