"""sibling-matmuls: the MatMulNBits that read the same activation (a layer's q, k and v projections; its gate and
up projections) become one, N-wise concatenated, followed by a Split.

Each output column of MatMulNBits is its own dot product over K (int8 activations quantized per block of K, the
same for every column), so the fused call computes every column exactly as the separate calls did. It reads the
activation and quantizes it once instead of per projection, and dispatches one kernel instead of two or three:
measured on one Qwen3-0.6B-shaped layer (K 1024, int4 blocks of 32, 2 threads, one row), q+k+v 63 + 42 + 42 ->
102 us and gate+up 83 + 83 -> 147 us (`python benchmarks/matmul_kernels.py --threads 2`). Weights with zero
points (asymmetric) are left apart."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from dflash_onnx.passes.base import PassContext

FUSED_ATTRIBUTES = ("K", "bits", "block_size", "accuracy_level")


def _fusable(node: ir.Node) -> bool:
    """A weight-only MatMulNBits without zero points, group indices or bias, its weight and scales initializers."""
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.inputs) != 3:
        return False
    if node.outputs[0].is_graph_output():
        return False
    return all(value is not None and value.const_value is not None for value in node.inputs[1:])


def _key(node: ir.Node) -> tuple:
    attributes = {name: node.attributes[name].value for name in FUSED_ATTRIBUTES if name in node.attributes}
    return (id(node.inputs[0]), tuple(sorted(attributes.items())))


def _concatenated(model: ir.Model, values: list[ir.Value], name: str) -> ir.Value:
    arrays = [value.const_value.numpy() for value in values]
    tensor = ir.tensor(np.concatenate(arrays, axis=0), name=name)
    value = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor.shape), const_value=tensor)
    model.graph.register_initializer(value)
    return value


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    groups: dict[tuple, list[ir.Node]] = defaultdict(list)
    for node in model.graph:
        if _fusable(node):
            groups[_key(node)].append(node)
    fused = 0
    made: dict[tuple[int, ...], tuple[ir.Value, ir.Value]] = {}  # projections applied to two activations (a
    # draft's k/v over context and block): their weights are concatenated once and read by both fused calls
    for nodes in (group for group in groups.values() if len(group) > 1):
        first = nodes[0]
        widths = [int(node.attributes["N"].value) for node in nodes]
        base = f"{first.name or first.outputs[0].name}_siblings"
        sources = tuple(id(node.inputs[1]) for node in nodes)
        if sources not in made:
            made[sources] = (_concatenated(model, [node.inputs[1] for node in nodes], f"{base}_B"),
                             _concatenated(model, [node.inputs[2] for node in nodes], f"{base}_scales"))
        weight, scales = made[sources]
        attributes = {name: attr.value for name, attr in first.attributes.items()}
        attributes["N"] = sum(widths)
        matmul = ir.node("MatMulNBits", [first.inputs[0], weight, scales], attributes=attributes,
                         domain="com.microsoft", name=base)
        split = ir.node("Split", [matmul.outputs[0], ir.val(f"{base}_widths", const_value=ir.tensor(
            np.array(widths, np.int64)))], attributes={"axis": -1}, num_outputs=len(nodes), name=f"{base}_split")
        model.graph.register_initializer(split.inputs[1])
        model.graph.insert_before(first, [matmul, split])
        if first.outputs[0].dtype is not None:
            matmul.outputs[0].dtype = first.outputs[0].dtype
        for node, output in zip(nodes, split.outputs):
            original = node.outputs[0]
            if original.dtype is not None:
                output.dtype, output.shape = original.dtype, original.shape
            ir.convenience.replace_all_uses_with(original, output)
            model.graph.remove(node, safe=True)
        fused += len(nodes)
    for name in [n for n, v in model.graph.initializers.items() if not v.uses()]:
        del model.graph.initializers[name]
    return model, {"matmuls_fused": fused}
