"""fp32: a bfloat16 (or float16) graph widened to float32, exactly.

Every bfloat16 and every float16 number is also a float32 number, so the widened graph holds the same weights and
computes the export's math in float32. It exists for ONNX Runtime's CPU provider, which has no
bfloat16 kernels (MatMul, Add, Mul, ReduceMean, Softmax ... are refused when a session opens): a bfloat16 export
runs there widened, or widened and then quantized (`--passes fp32,int4`). Weights are converted as the graph file
is written, ROWS rows at a time, straight from the memory-mapped source.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from dflash_onnx.passes.base import PassContext

NARROW = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)
ROWS = 8192  # rows widened at a time when the tensor is written


def _release(tensor: ir.TensorProtocol) -> None:
    if isinstance(tensor, ir.ExternalTensor):
        tensor.release()  # unmap the narrow source: its pages would stay in this process's memory


class WidenedTensor(ir.LazyTensor):
    """`narrow` as float32, computed when read. Written, it widens ROWS rows at a time (a Qwen3-4B embedding is
    1.56 GB in float32); a pass that reads it in parts (int4/int8) can widen `narrow`'s parts itself."""

    def __init__(self, narrow: ir.TensorProtocol):
        def read() -> ir.Tensor:
            value = ir.Tensor(narrow.numpy().astype(np.float32), name=narrow.name)
            _release(narrow)
            return value

        super().__init__(read, dtype=ir.DataType.FLOAT, shape=narrow.shape, name=narrow.name)
        self.narrow = narrow

    def tofile(self, file) -> None:
        values = self.narrow.numpy()
        flat = values.reshape(len(values), -1) if values.ndim else values.reshape(1, 1)
        for start in range(0, len(flat), ROWS):
            file.write(flat[start:start + ROWS].astype(np.float32).tobytes())
        del values, flat
        _release(self.narrow)


def _widen_value(value: ir.Value) -> bool:
    if value.type is None or value.dtype not in NARROW:
        return False
    value.dtype = ir.DataType.FLOAT
    if value.const_value is not None:
        value.const_value = WidenedTensor(value.const_value)
    return True


def _widen_attributes(node: ir.Node) -> int:
    """Casts to a narrow type cast to float32; tensor attributes (Constant, ConstantOfShape) become float32."""
    changed = 0
    for name, attribute in list(node.attributes.items()):
        if attribute.type == ir.AttributeType.INT and node.op_type == "Cast" and name == "to" \
                and attribute.value in {int(d) for d in NARROW}:
            node.attributes[name] = ir.AttrInt64(name, int(ir.DataType.FLOAT))
            changed += 1
        elif attribute.type == ir.AttributeType.TENSOR and attribute.value.dtype in NARROW:
            node.attributes[name] = ir.AttrTensor(name, ir.Tensor(attribute.value.numpy().astype(np.float32)))
            changed += 1
    return changed


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    graph = model.graph
    values = [*graph.inputs, *graph.initializers.values()]
    values += [output for node in ir.traversal.RecursiveGraphIterator(graph) for output in node.outputs]
    widened = {id(v) for v in values if _widen_value(v)}
    attributes = sum(_widen_attributes(node) for node in ir.traversal.RecursiveGraphIterator(graph))
    return model, {"values_widened": len(widened), "attributes_widened": attributes}
