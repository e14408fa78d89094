"""int4 / int8: block-wise weight-only quantization into ONNX Runtime's MatMulNBits, tensor by tensor.

Each MatMul with a constant weight becomes the MatMulNBits node ONNX Runtime's MatMulNBitsQuantizer would make (the
same names, attributes and quantized bytes: its per-tensor kernel does the quantizing, tested against the whole-
model quantizer), but its quantized weight and scales are lazy: computed from the memory-mapped float weight when
the graph is written, one weight at a time, so the pass never holds the model in memory.

Options: block_size (64, see BLOCK_SIZE), symmetric (true), accuracy_level (4: int8 activations, ORT's fast CPU path,
docs/passes.md#int4-and-int8; 0 leaves it unset), graphs (target|draft|both, default both), lm_head (false: keep the
vocab projection in float). MatMuls whose weight is not a constant, or is too small to fill one block (the RoPE
frequencies), are never quantized. A weight read through Transpose (a tied lm_head, the draft's shared projections)
is quantized transposed, as `{name}.transposed`.

Mixture-of-experts layers become ONNX Runtime's QMoE with the experts in the same blocks (always symmetric, which
is what QMoE reads; passes/experts.py). Their router is a Gemm (a linear layer over the call's flattened tokens) and
stays in float: it chooses the experts. Gemma 4's experts, whose gelu-tanh gate no ONNX Runtime kernel has, become
two QMoE split at the gate, or are gathered by GatherBlockQuantized (passes/routed_experts.py).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from dflash_onnx.passes import experts, routed_experts
from dflash_onnx.passes.base import PassContext
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import on_off

COLUMNS = 8192  # output columns quantized at a time
# ONNX Runtime's CPU kernel holds int4 weights packed with a float32 scale and a float32 block sum per block: 64
# halves 32's overhead, decodes no slower and is MLX's default group (docs/large-models.md#memory-per-int4-block-size)
BLOCK_SIZE = 64


class _QuantizedWeight:
    """One float weight [K, N] quantized on demand by ORT's kernel; the arrays are kept only until every part
    (packed weight, scales, zero points) has been read once, so the writer holds one weight's at a time."""

    def __init__(self, source: ir.TensorProtocol, transposed: bool, quantizer, parts: int):
        self.source, self.transposed, self.quantizer, self.parts = source, transposed, quantizer, parts
        self._arrays: tuple[np.ndarray, ...] | None = None
        self._unread: set[int] = set()

    def _quantized(self) -> tuple[np.ndarray, ...]:
        """Quantized COLUMNS output columns at a time (each column's blocks are its own), so that a transposed
        weight is never copied whole."""
        narrow = getattr(self.source, "narrow", None)  # the fp32 pass's widened weight: widened a block at a time
        stored = narrow if narrow is not None else self.source
        weight = stored.numpy()
        weight = weight.T if self.transposed else weight
        dtype = np.float32 if narrow is not None else None
        chunks = [self.quantizer.qbits_block_quant(np.ascontiguousarray(weight[:, start:start + COLUMNS], dtype))
                  for start in range(0, weight.shape[1], COLUMNS)]
        arrays = tuple(np.concatenate(parts) for parts in zip(*chunks))
        del weight, chunks
        if isinstance(stored, ir.ExternalTensor):
            stored.release()  # unmap the float weight: its pages would stay in this process's memory
        return arrays

    def part(self, index: int, name: str):
        def read() -> ir.Tensor:
            if self._arrays is None:
                self._arrays, self._unread = self._quantized(), set(range(self.parts))
            array = self._arrays[index]
            self._unread.discard(index)
            if not self._unread:
                self._arrays = None
            return ir.Tensor(array, name=name)

        return read


def _weight(value: ir.Value | None, initializers) -> tuple[ir.TensorProtocol | None, bool, str]:
    """(the constant float weight, read transposed?, its name) of a MatMul's second input."""
    if value is None:
        return None, False, ""
    if value.name in initializers and value.const_value is not None:
        return value.const_value, False, value.name
    producer = value.producer()
    if producer is not None and producer.op_type == "Transpose" and producer.domain == "":
        source = producer.inputs[0]
        perm = producer.attributes.get_ints("perm")
        if source is not None and source.name in initializers and source.const_value is not None and \
                len(source.const_value.shape) == 2 and list(perm or [1, 0]) == [1, 0]:
            return source.const_value, True, f"{source.name}.transposed"
    return None, False, ""


def _quantize(bits: int, model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    options = context.options
    graphs = options.get("graphs", "both")
    if graphs not in ("target", "draft", "both"):
        raise DFlashError(f"int{bits}: graphs={graphs} must be target, draft or both")
    if graphs not in (context.graph, "both"):
        return model, {"skipped": f"graphs={graphs}"}
    if any(v.dtype == ir.DataType.BFLOAT16 for v in model.graph.initializers.values()):
        # its kernel takes float32 and float16 weights; given bfloat16 ones it returns zero scales
        # (docs/passes.md#int4-and-int8)
        raise DFlashError(f"int{bits}: ONNX Runtime's quantizer takes float32 and float16 weights, not this "
                          f"{context.graph} graph's bfloat16: widen it first, --passes fp32,int{bits}")
    block_size = context.int_option("block_size", BLOCK_SIZE)
    if block_size < 16 or block_size & (block_size - 1):
        raise DFlashError(f"int{bits}: block_size={block_size} must be a power of two >= 16")
    vocab = context.manifest.vocab_size
    keep_lm_head = not on_off(options.get("lm_head"), False)
    symmetric = on_off(options.get("symmetric"), True)
    accuracy_level = int(options.get("accuracy_level", 4)) or None
    quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level, bits=bits))
    initializers = model.graph.initializers
    made: dict[str, list[ir.Value]] = {}  # weight name -> its quantized initializers (a weight shared by MatMuls)
    why, folded = {}, set()
    for index, node in enumerate(list(model.graph)):
        if node.op_type != "MatMul" or node.domain != "":
            continue
        name = node.name or f"MatMul_{index}"
        weight, transposed, weight_name = _weight(node.inputs[1], initializers)
        dims = None if weight is None else list(weight.shape)[::-1 if transposed else 1]
        if weight is None:
            why[name] = "weight is not a constant"
        elif len(dims) != 2 or dims[0] < block_size:
            why[name] = f"weight {dims} too small for block {block_size}"
        elif keep_lm_head and vocab in dims:
            why[name] = "vocab projection (lm_head) kept in float; pass lm_head=true to quantize it"
        if name in why:
            continue
        if weight_name not in made:
            made[weight_name] = _quantized_initializers(model, weight, transposed, weight_name, bits, block_size,
                                                        symmetric, quantizer)
        folded.update([weight_name] if transposed else [])
        k, n = dims
        attributes = {"K": k, "N": n, "bits": bits, "block_size": block_size}
        if accuracy_level:
            attributes["accuracy_level"] = accuracy_level
        replacement = ir.node("MatMulNBits", [node.inputs[0], *made[weight_name]], attributes, domain="com.microsoft",
                              name=f"{node.name}_Q{bits}" if node.name else "", num_outputs=1)
        output, result = node.outputs[0], replacement.outputs[0]
        result.type, result.shape, result.name, output.name = output.type, output.shape, output.name, None
        model.graph.insert_before(node, replacement)
        output.replace_all_uses_with(result, replace_graph_outputs=True)
        model.graph.remove(node, safe=True)
    # QMoE reads symmetric blocks only (no zero points)
    expert_quantizer = quantizer if symmetric else DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=True, bits=bits))
    experts_quantized, experts_kept = experts.quantize(model, bits, block_size, expert_quantizer, accuracy_level)
    why.update(experts_kept)
    routed, routed_kept = routed_experts.quantize(model, bits, block_size, expert_quantizer, accuracy_level)
    why.update(routed_kept)
    _drop_unused(model)
    quantized = sum(n.op_type == "MatMulNBits" for n in model.graph)
    if quantized or experts_quantized:  # declared, so that ONNX's own shape inference knows the domain
        model.opset_imports.setdefault("com.microsoft", 1)
    details = {"quantized_matmuls": quantized, "not_quantized": why, "block_size": block_size,
               "folded_weight_transposes": len(folded)}
    if experts_quantized:
        details["quantized_moe"] = experts_quantized
    if routed:
        details["quantized_routed_experts"] = routed
    return model, details


def _quantized_initializers(model: ir.Model, weight: ir.TensorProtocol, transposed: bool, name: str, bits: int,
                            block_size: int, symmetric: bool, quantizer) -> list[ir.Value]:
    """The packed weight, scales and (asymmetric) zero points of `weight` [K, N] as lazy initializers, shaped
    and named as ORT's quantizer makes them."""
    k, n = list(weight.shape)[::-1 if transposed else 1]
    k_blocks = (k + block_size - 1) // block_size
    per_byte = 8 // bits
    parts = [(f"{name}_Q{bits}", ir.DataType.UINT8, [n, k_blocks, (block_size + per_byte - 1) // per_byte]),
             (f"{name}_scales", weight.dtype, [n, k_blocks])]
    if not symmetric:
        parts.append((f"{name}_zero_points", ir.DataType.UINT8, [n, (k_blocks + per_byte - 1) // per_byte]))
    source = _QuantizedWeight(weight, transposed, quantizer, len(parts))
    values = []
    for index, (part_name, dtype, shape) in enumerate(parts):
        tensor = ir.LazyTensor(source.part(index, part_name), dtype=dtype, shape=ir.Shape(shape), name=part_name)
        value = ir.Value(name=part_name, type=ir.TensorType(dtype), shape=ir.Shape(shape), const_value=tensor)
        model.graph.register_initializer(value)
        values.append(value)
    return values


def _drop_unused(model: ir.Model) -> None:
    """Remove nodes and initializers nothing reads any more (a Transpose of a quantized weight, the float
    weights themselves)."""
    graph_outputs = set(model.graph.outputs)
    changed = True
    while changed:
        changed = False
        for node in reversed(list(model.graph)):
            if not any(output.uses() or output in graph_outputs for output in node.outputs):
                model.graph.remove(node, safe=True)
                changed = True
    for name in [name for name, value in model.graph.initializers.items()
                 if not value.uses() and value not in graph_outputs]:
        del model.graph.initializers[name]


def int4(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    return _quantize(4, model, context)


def int8(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    return _quantize(8, model, context)
