"""Mixture-of-experts nodes for ONNX Runtime: dflash::MoE -> com.microsoft::MoE (float) or QMoE (int4 / int8).

The export's dflash::MoE (dflash_onnx/exporter/models/experts.py) is a model-local function that computes every expert;
ONNX
Runtime's MoE and QMoE kernels route each token to its k experts and compute only those, so a decode step reads the
active experts' weights, not all of them. Both take SwiGLU's gate and up rows interleaved in one fc1 [experts,
2 * intermediate, hidden] (swiglu_fusion=1: row 2i is gate row i, row 2i + 1 up row i), fc2 = down_proj [experts,
hidden, intermediate], the router's logits (softmax and top-k inside), and normalize_routing_weights as dflash::MoE
has it. QMoE's weights are symmetric blocks along each row's input axis, packed two 4-bit values per byte (low
nibble first) with an implicit zero point of 8 (128 for 8 bits), scales [experts, rows, blocks]: the blocks of
ORT's MatMulNBits quantizer, whose kernel quantizes here, one expert at a time. Every weight is re-laid out or
quantized lazily, when the graph is written, one layer's experts at a time.

Padding rows (dflash_onnx/runtime/runners.py pads a call to the lowering's row multiple by repeating its last row, id
and
position) skip the experts: the kernel gets the call's real rows only (a row whose position repeats the one before
it is padding), and a padding row's result is the one of the row it repeats (its outputs are dropped, its K/V
overwritten). The kernel's time grows with its rows, a pair of rows
per token and expert already: measured on a 2048-wide layer of 32 experts, 8 per token, int4, one padded decode step
spent 16.0 ms in QMoE against 9.9 ms for the lone token, whatever experts the padding row chose.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from dflash_onnx.artifacts.graph_files import MOE_DOMAIN, MOE_OP, SWIGLU_MOE_OP
from dflash_onnx.passes.base import PassContext

SWIGLU = {"activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0, "activation_beta": 0.0}


def moe_nodes(model: ir.Model, domain: str = MOE_DOMAIN, op: str = MOE_OP) -> list[ir.Node]:
    return [node for node in model.graph if node.domain == domain and node.op_type == op]


def _interleaved(gate_up: np.ndarray) -> np.ndarray:
    """[E, 2I, H] gate rows then up rows -> [E, 2I, H] gate and up rows alternating (fc1 with swiglu_fusion=1)."""
    experts, rows, hidden = gate_up.shape
    return np.ascontiguousarray(gate_up.reshape(experts, 2, rows // 2, hidden).transpose(0, 2, 1, 3)
                                .reshape(experts, rows, hidden))


def lazy_initializer(model: ir.Model, name: str, dtype: ir.DataType, shape: list[int],
                     read: Callable[[], np.ndarray]) -> ir.Value:
    """An initializer computed when the graph is written (`read`), so a pass never holds every weight at once."""
    tensor = ir.LazyTensor(lambda: ir.Tensor(read(), name=name), dtype=dtype, shape=ir.Shape(shape), name=name)
    value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape), const_value=tensor)
    model.graph.register_initializer(value)
    return value


def _weights(node: ir.Node) -> tuple[ir.Value, ir.Value]:
    gate_up, down = node.inputs[2], node.inputs[3]
    if gate_up is None or down is None or gate_up.const_value is None or down.const_value is None:
        raise ValueError(f"{node.name}: the experts' weights are not constants")
    return gate_up, down


def int64s(values: list[int] | int) -> ir.Value:
    return ir.node("Constant", [], {"value": ir.tensor(values, dtype=ir.DataType.INT64)}).outputs[0]


def _new_constants(nodes: list[ir.Node]) -> list[ir.Node]:
    """`nodes`, each after the Constant nodes made for its inputs that no graph holds yet."""
    ordered = []
    for node in nodes:
        ordered += [value.producer() for value in node.inputs if value is not None and value.producer() is not None
                    and value.producer().op_type == "Constant" and value.producer().graph is None]
        ordered.append(node)
    return ordered


def insert_nodes(model: ir.Model, before: ir.Node, nodes: list[ir.Node]) -> ir.Value:
    """`nodes` (with their new constants) before `before`; the last node's output."""
    model.graph.insert_before(before, _new_constants(nodes))
    return nodes[-1].outputs[0]


def _routing_weights(logits: ir.Value, indices: ir.Value, values: ir.Value, normalize: bool) -> list[ir.Node]:
    """Each token's k routing weights in float32, as the kernel computes them: a softmax over the k chosen logits
    (normalize_routing_weights=1), or over all of them, read at the chosen experts."""
    if normalize:
        cast = ir.node("Cast", [values], {"to": ir.DataType.FLOAT})
        return [cast, ir.node("Softmax", [cast.outputs[0]], {"axis": -1})]
    cast = ir.node("Cast", [logits], {"to": ir.DataType.FLOAT})
    softmax = ir.node("Softmax", [cast.outputs[0]], {"axis": -1})
    return [cast, softmax, ir.node("GatherElements", [softmax.outputs[0], indices], {"axis": 1})]


REAL_ROWS, RESULT_ROWS = "moe_real_rows", "moe_result_rows"


def kept_rows(model: ir.Model) -> tuple[ir.Value, ir.Value] | None:
    """The flattened call's real rows [R] (those whose position differs from the row before it in its sequence:
    padding rows come last and repeat it) and, for every row [B * S], the index among those of the row its result
    is (itself, or the last real row before a padding row); computed once per graph from `position_ids` [B, S],
    in time linear in the rows. None when the graph takes no position ids."""
    made = {node.outputs[0].name: node.outputs[0] for node in model.graph if node.outputs
            and node.outputs[0].name in (REAL_ROWS, RESULT_ROWS)}
    if len(made) == 2:
        return made[REAL_ROWS], made[RESULT_ROWS]
    positions = next((value for value in model.graph.inputs if value.name == "position_ids"), None)
    if positions is None:
        return None
    first = ir.node("Slice", [positions, int64s([0]), int64s([1]), int64s([1])])
    before_first = ir.node("Sub", [first.outputs[0], int64s(1)])  # a sequence's first row is always real
    earlier = ir.node("Slice", [positions, int64s([0]), int64s([-1]), int64s([1])])
    previous = ir.node("Concat", [before_first.outputs[0], earlier.outputs[0]], {"axis": 1})
    repeated = ir.node("Equal", [positions, previous.outputs[0]])
    real = ir.node("Not", [repeated.outputs[0]])
    flat = ir.node("Reshape", [real.outputs[0], int64s([-1])])
    size = ir.node("Size", [positions])
    every = ir.node("Range", [int64s(0), size.outputs[0], int64s(1)])
    kept = ir.node("Compress", [every.outputs[0], flat.outputs[0]], {"axis": 0})
    counted = ir.node("Cast", [flat.outputs[0]], {"to": ir.DataType.INT64})
    rank = ir.node("CumSum", [counted.outputs[0], int64s(0)])
    result = ir.node("Sub", [rank.outputs[0], int64s(1)])  # a padding row: the rank of the real row before it
    kept.outputs[0].name, result.outputs[0].name = REAL_ROWS, RESULT_ROWS
    nodes = [first, before_first, earlier, previous, repeated, real, flat, size, every, kept, counted, rank, result]
    insert_nodes(model, next(iter(model.graph)), nodes)
    return kept.outputs[0], result.outputs[0]


def expanded_rows(model: ir.Model, node: ir.Node, x: ir.Value, indices: ir.Value, like: ir.Value, k: int,
                  hidden: int, experts: int) -> tuple[ir.Value, ir.Value]:
    """Rows [2kT, H] (each token once per chosen expert, twice) and their one-hot routes [2kT, E] in `like`'s
    dtype, for the chosen experts `indices` [T, k]."""
    on_off = ir.node("Constant", [], {"value": ir.tensor(np.array([0, 1], np.float32))}).outputs[0]
    onehot = ir.node("OneHot", [indices, int64s(experts), on_off], {"axis": -1})  # [T, k, E]
    routes = [onehot, ir.node("CastLike", [onehot.outputs[0], like])]
    routes.append(ir.node("Unsqueeze", [routes[-1].outputs[0], int64s([2])]))
    routes.append(ir.node("Expand", [routes[-1].outputs[0], int64s([1, 1, 2, 1])]))
    routes.append(ir.node("Reshape", [routes[-1].outputs[0], int64s([-1, experts])]))
    rows = [ir.node("Unsqueeze", [x, int64s([1, 2])])]  # [T, 1, 1, H] -> [T, k, 2, H] -> [2kT, H]
    rows.append(ir.node("Expand", [rows[-1].outputs[0], int64s([1, k, 2, 1])]))
    rows.append(ir.node("Reshape", [rows[-1].outputs[0], int64s([-1, hidden])]))
    return insert_nodes(model, node, rows), insert_nodes(model, node, routes)


def _expanded_inputs(model: ir.Model, node: ir.Node, x: ir.Value, logits: ir.Value, k: int, hidden: int,
                     experts: int, normalize: bool) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Rows [2kT, H] (each token once per chosen expert, twice), their one-hot routes [2kT, E], and the tokens'
    routing weights [T, k] (float32), ranked as TopK ranks the experts."""
    topk = ir.node("TopK", [logits, int64s([k])], {"axis": -1}, num_outputs=2)
    values, indices = topk.outputs
    weights = insert_nodes(model, node, [topk, *_routing_weights(logits, indices, values, normalize)])
    rows, routes = expanded_rows(model, node, x, indices, logits, k, hidden, experts)
    return rows, routes, weights


def weighted_sum(model: ir.Model, after: ir.Node, result: ir.Value, weights: ir.Value, k: int, hidden: int,
                  like: ir.Value, rows: ir.Value | None) -> ir.Value:
    """The kernel's [2kT, H] results -> [T, H]: one copy of each row, weighted, the k added in rank order (in
    float32, as the kernel accumulates), in `like`'s dtype; then, given `rows`, the results at those rows."""
    nodes = [ir.node("Reshape", [result, int64s([-1, k, 2, hidden])])]
    nodes.append(ir.node("Gather", [nodes[-1].outputs[0], int64s(0)], {"axis": 2}))  # [T, k, H]
    nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], {"to": ir.DataType.FLOAT}))
    scale = ir.node("Unsqueeze", [weights, int64s([2])])
    nodes += [scale, ir.node("Mul", [nodes[-1].outputs[0], scale.outputs[0]])]
    parts = ir.node("Split", [nodes[-1].outputs[0]], {"axis": 1, "num_outputs": k}, num_outputs=k)
    nodes.append(parts)
    total = parts.outputs[0]
    for part in parts.outputs[1:]:
        nodes.append(ir.node("Add", [total, part]))
        total = nodes[-1].outputs[0]
    nodes.append(ir.node("Squeeze", [total, int64s([1])]))
    if rows is not None:
        nodes.append(ir.node("Gather", [nodes[-1].outputs[0], rows], {"axis": 0}))
    nodes.append(ir.node("CastLike", [nodes[-1].outputs[0], like]))
    model.graph.insert_after(after, _new_constants(nodes))
    return nodes[-1].outputs[0]


def _replace(model: ir.Model, node: ir.Node, op: str, inputs: list[ir.Value | None], attributes: dict,
             expand: bool) -> None:
    """`node` -> com.microsoft's `op` on `inputs`. `expand`: the kernel sees one row per token and chosen expert,
    twice, routed to that expert alone (k=1), and the graph weights the k results and adds them in rank order.
    ONNX Runtime's CPU kernels round a lone row differently from a pair (as its matmuls do), and add a token's k
    expert results in an order that depends on which experts the call's other tokens chose: a token's result
    would move with the rest of its call by a last bit, which int8 activations amplify, layer after layer, to
    percents of the logits. Expanded, a token's result is the same whether its call has 1 token or 16 (measured
    bit for bit), and each expert still multiplies all its rows in one matmul."""
    k = node.attributes.get_int("k", 1)
    normalize = bool(node.attributes.get_int("normalize_routing_weights", 1))
    attributes = {"k": k, "normalize_routing_weights": int(normalize), **SWIGLU, **attributes}
    hidden, experts = inputs[2].shape[2] if op == "MoE" else inputs[5].shape[1], inputs[2].shape[0]
    output, x = node.outputs[0], inputs[0]
    kept = expand and kept_rows(model)
    if expand:
        tokens, logits = x, inputs[1]
        if kept:  # padding rows skip the experts (see the module's docstring)
            tokens, logits = (insert_nodes(model, node, [ir.node("Gather", [value, kept[0]], {"axis": 0})])
                              for value in (x, logits))
        rows, routes, weights = _expanded_inputs(model, node, tokens, logits, k, hidden, experts, normalize)
        inputs = [rows, routes, *inputs[2:]]
        attributes.update(k=1, normalize_routing_weights=1)  # one expert per row, its weight exactly 1
    replacement = ir.node(op, inputs, attributes, domain="com.microsoft", name=node.name, num_outputs=1)
    result = insert_nodes(model, node, [replacement])
    if expand:
        result = weighted_sum(model, replacement, result, weights, k, hidden, x, kept[1] if kept else None)
    result.type, result.shape, result.name, output.name = output.type, output.shape, output.name, None
    output.replace_all_uses_with(result, replace_graph_outputs=True)
    model.graph.remove(node, safe=True)


def _drop_function(model: ir.Model) -> None:
    """dflash::MoE's and dflash::SwigluMoE's definitions, once nothing calls them."""
    for op in (MOE_OP, SWIGLU_MOE_OP):
        if not moe_nodes(model, MOE_DOMAIN, op):
            model.functions.pop((MOE_DOMAIN, op, ""), None)
    if not any(node.domain == MOE_DOMAIN for node in model.graph):
        model.opset_imports.pop(MOE_DOMAIN, None)


def _drop_unused_weights(model: ir.Model) -> None:
    for name in [name for name, value in model.graph.initializers.items() if not value.uses()]:
        del model.graph.initializers[name]


def swiglu_attributes(node: ir.Node) -> dict:
    """A dflash::SwigluMoE node's activation, as com.microsoft::MoE / QMoE take it."""
    return {name: node.attributes.get_float(name, default) for name, default in
            (("activation_alpha", 1.0), ("activation_beta", 0.0), ("swiglu_limit", 0.0))}


def fuse(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    """moe-fusion: every dflash::MoE -> com.microsoft::MoE over the same (re-laid-out) float weights; every
    dflash::SwigluMoE (gpt-oss: its weights already in the kernel's layout, with biases) likewise."""
    nodes = moe_nodes(model)
    for node in nodes:
        gate_up, down = _weights(node)
        source = gate_up.const_value
        fc1 = lazy_initializer(model, f"{gate_up.name}.interleaved", source.dtype, list(source.shape),
                    lambda source=source: _interleaved(source.numpy()))
        _replace(model, node, "MoE", [node.inputs[0], node.inputs[1], fc1, None, down], {}, expand=True)
    swiglu = moe_nodes(model, MOE_DOMAIN, SWIGLU_MOE_OP)
    for node in swiglu:
        _replace(model, node, "MoE", list(node.inputs), {"normalize_routing_weights": 1, **swiglu_attributes(node)},
                 expand=True)
    _drop_function(model)
    _drop_unused_weights(model)
    if nodes or swiglu:
        model.opset_imports.setdefault("com.microsoft", 1)
    return model, {"moe_nodes": len(nodes) + len(swiglu)} if nodes or swiglu else {}


class QuantizedExperts:
    """One [E, rows, K] expert weight quantized by ORT's MatMulNBits kernel, one expert at a time, on demand: the
    packed weights and the scales, kept until both are read once."""

    def __init__(self, source: ir.TensorProtocol, interleave: bool, quantizer):
        self.source, self.interleave, self.quantizer = source, interleave, quantizer
        self._arrays: dict[int, np.ndarray] = {}

    def _quantize(self) -> dict[int, np.ndarray]:
        weight = self.source.numpy()
        weight = _interleaved(weight) if self.interleave else weight
        experts, rows, k = weight.shape
        packed, scales = [], []
        for expert in weight:
            blocks, expert_scales, _ = self.quantizer.qbits_block_quant(np.ascontiguousarray(expert.T, np.float32))
            packed.append(blocks.reshape(rows, -1))
            scales.append(expert_scales.reshape(rows, -1))
        return {0: np.stack(packed), 1: np.stack(scales).astype(weight.dtype)}

    def part(self, index: int) -> Callable[[], np.ndarray]:
        def read() -> np.ndarray:
            if not self._arrays:
                self._arrays = self._quantize()
            return self._arrays.pop(index)

        return read


def _layers(node: ir.Node) -> tuple[ir.Value, ir.Value | None, ir.Value, ir.Value | None, bool]:
    """fc1, its bias, fc2, its bias of a dflash::MoE, dflash::SwigluMoE or com.microsoft::MoE node, and whether fc1
    still needs its gate and up rows interleaved (dflash::MoE keeps transformers' gate-then-up layout)."""
    if node.domain == MOE_DOMAIN and node.op_type == MOE_OP:
        gate_up, down = _weights(node)
        return gate_up, None, down, None, True
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    fc1, fc1_bias, fc2, fc2_bias = inputs[2:6]
    if fc1 is None or fc2 is None or fc1.const_value is None or fc2.const_value is None:
        raise ValueError(f"{node.name}: the experts' weights are not constants")
    return fc1, fc1_bias, fc2, fc2_bias, False


def expert_blocks_refusal(node: ir.Node, block_size: int) -> str | None:
    """Why `node`'s experts cannot be quantized in blocks of `block_size` (None when they can)."""
    fc1, _, fc2, _, _ = _layers(node)
    hidden, intermediate = fc1.const_value.shape[2], fc2.const_value.shape[2]
    if hidden % block_size or intermediate % block_size:
        return (f"experts' hidden {hidden} and intermediate {intermediate} sizes are not multiples of block "
                f"{block_size}")
    return None


def quantize(model: ir.Model, bits: int, block_size: int, quantizer,
             accuracy_level: int | None = None) -> tuple[int, dict[str, str]]:
    """Every dflash::MoE or com.microsoft::MoE of `model` -> QMoE of `bits` in blocks of `block_size` (symmetric,
    the only form ORT's CPU kernel reads without zero points), with MatMulNBits' `accuracy_level` (4: int8
    activations, 1.4x faster decode than unset on the benchmark's MoE shape); returns how many, and why others
    were kept."""
    kept = {}
    nodes = moe_nodes(model) + moe_nodes(model, MOE_DOMAIN, SWIGLU_MOE_OP) + moe_nodes(model, "com.microsoft", "MoE")
    done = 0
    for node in nodes:
        why = expert_blocks_refusal(node, block_size)
        if why:
            kept[node.name] = why
            continue
        fc1, fc1_bias, fc2, fc2_bias, interleave = _layers(node)
        inputs = []
        for value, relayout in ((fc1, interleave), (fc2, False)):
            source = value.const_value
            experts, rows, k = source.shape
            parts = QuantizedExperts(source, relayout, quantizer)
            inputs.append(lazy_initializer(model, f"{value.name}_Q{bits}", ir.DataType.UINT8,
                                           [experts, rows, k * bits // 8], parts.part(0)))
            inputs.append(lazy_initializer(model, f"{value.name}_scales", source.dtype,
                                           [experts, rows, k // block_size], parts.part(1)))
        (w1, s1), (w2, s2) = inputs[:2], inputs[2:]
        swiglu = swiglu_attributes(node) if node.op_type == SWIGLU_MOE_OP else {}
        if node.domain == "com.microsoft":  # a fused MoE keeps its activation attributes
            swiglu = {name: node.attributes[name].value for name in ("activation_alpha", "activation_beta",
                                                                    "swiglu_limit") if name in node.attributes}
        _replace(model, node, "QMoE", [node.inputs[0], node.inputs[1], w1, s1, fc1_bias, w2, s2, fc2_bias],
                 {"expert_weight_bits": bits, "block_size": block_size, **swiglu,
                  **({"accuracy_level": accuracy_level} if accuracy_level else {})},
                 expand=node.domain == MOE_DOMAIN)
        done += 1
    _drop_function(model)  # the float weights left unread are the caller's to drop (quantize's _drop_unused)
    return done, kept
