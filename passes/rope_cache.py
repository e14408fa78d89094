"""rope-cache: the draft's RotaryEmbedding reads a constant cos/sin cache at the call's positions.

After rope-fusion, each position stream of the draft computes its angles on every call (Unsqueeze, Cast,
Mul by inv_freq, Slice to the stream, Sin, Cos) and hands RotaryEmbedding cos/sin rows indexed by a
Range 0..n-1 (Shape, Squeeze, Range, Reshape): about twenty small kernels per step. com.microsoft
RotaryEmbedding can instead index a [rows, rotary_dim / 2] cache by the real positions, so each stream
becomes one Slice of the graph's position_ids. The cache is computed as the graph computes the angles
(float32 position x float32 inv_freq); float32 graphs only (the op wants cos/sin in the input's dtype).
It needs a bound on positions (option `rows`): the ORT lowering's buffer form gives one (its capacity
plus a block). Bound: float reordering only.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from dflash_onnx.passes.base import PassContext
from dflash_onnx.passes.ir_graph import add_constant, const_ints, made_by


def rope_tables(rows: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of position x inv_freq for positions 0..rows-1, [rows, rotary_dim / 2], computed as the
    exported graph computes its angles (float32 position times float32 inv_freq)."""
    angles = np.arange(rows, dtype=np.float32)[:, None] * inv_freq.astype(np.float32).reshape(1, -1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _angles(rotation: ir.Node) -> tuple[ir.Value, list[ir.Value | None], np.ndarray] | None:
    """For a rotation fed Cos/Sin(Reshape(Slice(Mul(Cast(Unsqueeze(positions, -1)), inv_freq), starts, ends,
    seq axis, steps))): the [batch, seq] positions, the Slice's starts/ends/steps and inv_freq; else None."""
    cos, sin = made_by(rotation.inputs[2], "Cos"), made_by(rotation.inputs[3], "Sin")
    if cos is None or sin is None or cos.inputs[0] is not sin.inputs[0]:
        return None
    flat = made_by(cos.inputs[0], "Reshape")
    cut = flat and made_by(flat.inputs[0], "Slice")
    if not cut or len(cut.inputs) < 4 or const_ints(cut.inputs[3]) not in ([1], [-2]):
        return None
    multiply = made_by(cut.inputs[0], "Mul")
    if multiply is None:
        return None
    constants = [ir.convenience.get_const_tensor(value) for value in multiply.inputs]
    computed = [value for value, tensor in zip(multiply.inputs, constants) if tensor is None]
    inv_freq = [tensor.numpy() for tensor in constants if tensor is not None]
    cast = made_by(computed[0], "Cast") if len(inv_freq) == 1 and len(computed) == 1 else None
    unsqueeze = cast and made_by(cast.inputs[0], "Unsqueeze")
    if not unsqueeze or const_ints(unsqueeze.inputs[1]) not in ([2], [-1]):
        return None
    return unsqueeze.inputs[0], [cut.inputs[1], cut.inputs[2], *cut.inputs[4:]], \
        inv_freq[0].astype(np.float32).reshape(-1)


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    """Rewrite every float32 RotaryEmbedding fed per-call cos/sin to a `rows`-row cache. Positions must stay
    below `rows` (the lowering's capacity + a block)."""
    if context.graph != "draft":
        return model, {"skipped": "the draft's rotations only"}
    rows = context.int_option("rows")  # the bound on positions (the ORT lowering sets it)
    graph = model.graph
    streams: dict[tuple, ir.Value] = {}  # one Slice of the positions per stream, shared by its rotations
    cache, count, other_bases = None, 0, 0
    for node in list(graph):
        if node.op_type != "RotaryEmbedding" or node.domain != "com.microsoft" or len(node.inputs) != 4 \
                or node.inputs[0].dtype != ir.DataType.FLOAT:
            continue
        found = _angles(node)
        if found is None:
            continue
        positions, slice_inputs, inv_freq = found
        if cache is None:
            cos, sin = rope_tables(rows, inv_freq)
            cache = (add_constant(graph, "rope_cache_cos", cos), add_constant(graph, "rope_cache_sin", sin), inv_freq)
        elif not np.array_equal(cache[2], inv_freq):
            other_bases += 1
            continue  # another rotary base: left as it is
        key = (id(positions), *(id(v) for v in slice_inputs))
        if key not in streams:
            axes = add_constant(graph, "rope_cache_sequence_axis", np.array([1], np.int64))
            starts, ends, *steps = slice_inputs
            cut = ir.node("Slice", [positions, starts, ends, axes, *steps],
                          outputs=[ir.Value(name=f"rope_cache_positions_{len(streams)}")])
            graph.insert_before(node, cut)
            streams[key] = cut.outputs[0]
        node.replace_input_with(1, streams[key])
        node.replace_input_with(2, cache[0])
        node.replace_input_with(3, cache[1])
        count += 1
    if count:
        RemoveUnusedNodesPass()(model)
    return model, {"rotations": count, "streams": len(streams), "rows": rows, "other_rotary_bases": other_bases}
