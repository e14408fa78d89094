"""Building an ONNX model-local function's body node by node: what the experts ops' definitions share."""

from __future__ import annotations

import onnx_ir as ir


class FunctionBody:
    """The nodes of one function body, in order; each helper appends its node and returns its output(s)."""

    def __init__(self):
        self.nodes: list[ir.Node] = []

    def add(self, op: str, *inputs: ir.Value, outputs: int = 1, **attributes) -> ir.Value | tuple[ir.Value, ...]:
        node = ir.node(op, list(inputs), attributes=attributes, num_outputs=outputs)
        self.nodes.append(node)
        return node.outputs[0] if outputs == 1 else tuple(node.outputs)

    def ints(self, values: list[int]) -> ir.Value:
        return self.add("Constant", value=ir.tensor(values, dtype=ir.DataType.INT64))

    def referenced(self, name: str, kind: ir.AttributeType, attribute: str) -> ir.Value:
        """A Constant of the calling node's attribute `name` (read by reference, as com.microsoft::MoE reads it)."""
        node = ir.Node("", "Constant", [], attributes=[ir.RefAttr(attribute, name, kind)])
        self.nodes.append(node)
        return node.outputs[0]
