"""int4 / int8: block-wise weight-only quantization with ONNX Runtime's MatMulNBits quantizer.

Options: block_size (32), symmetric (true), accuracy_level (4: int8 activations, ORT's fast CPU path,
measured 1.7x faster decode than level 0 on a Qwen3-0.6B shape; 0 leaves it unset), graphs (target|draft|both, default
both), lm_head (false: keep the vocab projection in float). MatMuls whose weight is not a constant, or is too
small to fill one block (the RoPE frequencies), are never quantized.
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir
from onnx import numpy_helper

from dflash_onnx.errors import DFlashError

from .base import PassContext, loaded_proto


def _flag(value, default: bool) -> bool:
    if value is None:
        return default
    return str(value).lower() in ("1", "true", "yes", "on")


def _excluded(model: onnx.ModelProto, block_size: int, keep_lm_head: bool, vocab_hint: int) -> tuple[list[str], dict]:
    weights = {t.name: t for t in model.graph.initializer}
    excluded, why = [], {}
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        weight = weights.get(node.input[1])
        if weight is None:
            why[node.name] = "weight is not a constant"
        elif len(weight.dims) != 2 or weight.dims[0] < block_size:
            why[node.name] = f"weight {list(weight.dims)} too small for block {block_size}"
        elif keep_lm_head and vocab_hint in weight.dims:
            why[node.name] = "vocab projection (lm_head) kept in float; pass lm_head=true to quantize it"
        else:
            continue
        excluded.append(node.name)
    return excluded, why


def fold_weight_transposes(model: onnx.ModelProto, wanted=lambda dims: True) -> int:
    """MatMul(x, Transpose(W)) with a constant 2-D W -> MatMul(x, W^T) as a new initializer.

    The exporter leaves large weight transposes unfolded (tied lm_heads, projections shared by the draft's
    two streams); quantizers only see constant weights. Only weights `wanted(dims of W^T)` accepts are
    folded, so a weight that stays in float is not stored twice. Returns how many were folded.
    """
    initializers = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    folded: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in producers:
            continue
        transpose = producers[node.input[1]]
        source = initializers.get(transpose.input[0]) if transpose.op_type == "Transpose" else None
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), [1, 0])
        if source is None or len(source.dims) != 2 or perm != [1, 0] or not wanted(list(source.dims)[::-1]):
            continue
        if transpose.output[0] not in folded:
            name = f"{source.name}.transposed"
            model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(source).T.copy(), name))
            folded[transpose.output[0]] = name
        node.input[1] = folded[transpose.output[0]]
    return len(folded)


def _quantize(bits: int, ir_model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        MatMulNBitsQuantizer,
        logger,
    )

    logger.setLevel(logging.WARNING)  # it logs every node it visits at INFO; our report says what matters
    options = context.options
    graphs = options.get("graphs", "both")
    if graphs not in ("target", "draft", "both"):
        raise DFlashError(f"int{bits}: graphs={graphs} must be target, draft or both")
    if graphs not in (context.graph, "both"):
        return ir_model, {"skipped": f"graphs={graphs}"}
    block_size = context.int_option("block_size", 32)
    if block_size < 16 or block_size & (block_size - 1):
        raise DFlashError(f"int{bits}: block_size={block_size} must be a power of two >= 16")
    vocab = context.manifest.vocab_size
    keep_lm_head = not _flag(options.get("lm_head"), False)
    model = loaded_proto(ir_model)
    folded = fold_weight_transposes(
        model, lambda dims: dims[0] >= block_size and not (keep_lm_head and vocab in dims))
    excluded, why = _excluded(model, block_size, keep_lm_head, vocab)
    for node in model.graph.node:  # the quantizer skips nodes without names
        node.name = node.name or f"{node.op_type}_{id(node)}"
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=block_size, is_symmetric=_flag(options.get("symmetric"), True),
        accuracy_level=int(options.get("accuracy_level", 4)) or None, nodes_to_exclude=excluded,
    )
    quantizer.process()
    out = quantizer.model.model
    quantized = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    _drop_unused(out)
    return ir.from_proto(out), {"quantized_matmuls": quantized, "not_quantized": why, "block_size": block_size,
                 "folded_weight_transposes": folded}


def _drop_unused(model: onnx.ModelProto) -> None:
    """Remove nodes and initializers nothing reads any more (e.g. a folded Transpose and its source)."""
    graph_outputs = {o.name for o in model.graph.output}
    while True:
        used = {i for n in model.graph.node for i in n.input} | graph_outputs
        dead = [n for n in model.graph.node if not any(o in used for o in n.output)]
        for node in dead:
            model.graph.node.remove(node)
        if not dead:
            break
    used = {i for n in model.graph.node for i in n.input}
    keep = [t for t in model.graph.initializer if t.name in used]
    if len(keep) != len(model.graph.initializer):
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)


def int4(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    return _quantize(4, model, context)


def int8(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    return _quantize(8, model, context)


