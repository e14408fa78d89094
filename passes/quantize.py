"""int4 / int8: block-wise weight-only quantization with ONNX Runtime's MatMulNBits quantizer.

Options: block_size (32), symmetric (true), accuracy_level (0 = unset), graphs (target|draft|both, default
both), lm_head (false: keep the vocab projection in float). MatMuls whose weight is not a constant, or is too
small to fill one block (the RoPE frequencies), are never quantized.
"""

from __future__ import annotations

import onnx

from dflash_onnx.errors import DFlashError


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


def _quantize(bits: int, model: onnx.ModelProto, graph: str, options: dict) -> tuple[onnx.ModelProto, dict]:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    graphs = options.get("graphs", "both")
    if graphs not in ("target", "draft", "both"):
        raise DFlashError(f"int{bits}: graphs={graphs} must be target, draft or both")
    if graphs not in (graph, "both"):
        return model, {"skipped": f"graphs={graphs}"}
    block_size = int(options.get("block_size", 32))
    if block_size < 16 or block_size & (block_size - 1):
        raise DFlashError(f"int{bits}: block_size={block_size} must be a power of two >= 16")
    vocab = int(options.get("vocab_size", 0))
    excluded, why = _excluded(model, block_size, not _flag(options.get("lm_head"), False), vocab)
    for node in model.graph.node:  # the quantizer skips nodes without names
        node.name = node.name or f"{node.op_type}_{id(node)}"
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=block_size, is_symmetric=_flag(options.get("symmetric"), True),
        accuracy_level=int(options.get("accuracy_level", 0)) or None, nodes_to_exclude=excluded,
    )
    quantizer.process()
    out = quantizer.model.model
    quantized = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    return out, {"quantized_matmuls": quantized, "not_quantized": why, "block_size": block_size}


def int4(model: onnx.ModelProto, graph: str, options: dict):
    return _quantize(4, model, graph, options)


def int8(model: onnx.ModelProto, graph: str, options: dict):
    return _quantize(8, model, graph, options)


