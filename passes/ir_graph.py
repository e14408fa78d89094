"""Small onnx-ir helpers the structural rewrites share: constants, attributes, producers by op type, and
adding constant initializers. Rewrites read graph structure only; nothing here reads a weight."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The integers of a constant value (an initializer stored in the graph or a Constant node), else None."""
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None else [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]


def attr(node: ir.Node, name: str, default=None):
    """An attribute's Python value (ints, floats, lists), or `default` when the node lacks it."""
    found = node.attributes.get(name)
    return default if found is None else found.value


def made_by(value: ir.Value | None, op_type: str, **attrs) -> ir.Node | None:
    """The node producing `value` when it is an `op_type` with these attribute values, else None."""
    node = None if value is None else value.producer()
    if node is None or node.op_type != op_type:
        return None
    if any(_plain(attr(node, key)) != expected for key, expected in attrs.items()):
        return None
    return node


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def readers(value: ir.Value) -> list[ir.Node]:
    """The nodes reading `value`, each once."""
    return list(dict.fromkeys(use.node for use in value.uses()))


def add_constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """An initializer named `name` holding `array` (the existing one when the graph has it already, which must
    hold the same values: a rewrite never silently reads another one's constant)."""
    if name in graph.initializers:
        existing = graph.initializers[name]
        if not np.array_equal(existing.const_value.numpy(), array):
            raise ValueError(f"initializer {name} exists with other values")
        return existing
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def static_dims(value: ir.Value) -> list | None:
    """The declared dims of `value` (ints, or dim names as strings), None when it has no declared shape."""
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else d.value for d in value.shape]


def name_nodes(graph: ir.Graph) -> None:
    """Give unnamed nodes names (rewrites and tools refer to nodes by name)."""
    for index, node in enumerate(graph):
        node.name = node.name or f"{node.op_type}_{index}"
