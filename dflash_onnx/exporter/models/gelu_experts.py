"""Gemma 4's experts as one graph node: `dflash::GeluTanhExperts`, an ONNX model-local function.

Gemma 4's MoE layers (26B-A4B) run a dense MLP and, beside it, experts chosen by their own router: softmax over
the router's scores, top-k, renormalized, each weight then scaled by a learned per-expert factor. transformers'
router module computes that (traceable: TopK); the experts module receives the chosen indices and weights and
loops over the experts hit, which torch.onnx cannot trace. During export that module calls one custom op
instead, `dflash::GeluTanhExperts(input, top_k_index, top_k_weights, gate_up_proj, down_proj)`: per token, the
weighted sum over its chosen experts of down(gelu_tanh(gate(x)) * up(x)), the weights as the router gave them.
Its function body gathers the experts the call's tokens chose and computes each on every token of the call,
weighted by its routing weight (zero where a token is not routed): exact and portable, and a decode step reads
its k experts' weights, not all of them (plus the copy Gather makes of them). No ONNX Runtime kernel takes
routing given as indices and weights with this activation, so the ORT lowering keeps the function; the int4
pass quantizes the gathered weights (passes/routed_experts.py).

Weights keep transformers' fused layout: gate_up_proj [experts, 2 * intermediate, hidden] (gate rows, then up
rows), down_proj [experts, hidden, intermediate].
"""

from __future__ import annotations

import math

import onnx
import onnx_ir as ir
import onnxscript
import torch
from torch import nn
from torch.nn import functional as F

from dflash_onnx.artifacts.graph_files import GELU_EXPERTS_OP as OP
from dflash_onnx.artifacts.graph_files import MOE_DOMAIN as DOMAIN
from dflash_onnx.exporter.models.function_body import FunctionBody

INPUTS = ("input", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")


def _schema() -> onnx.defs.OpSchema:
    parameter = onnx.defs.OpSchema.FormalParameter
    return onnx.defs.OpSchema(
        OP, DOMAIN, 1,
        inputs=[parameter(name, "I" if name == "top_k_index" else "T") for name in INPUTS],
        outputs=[parameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types"),
                          ("I", ["tensor(int64)"], "expert indices")])


GELU_EXPERTS_OP = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, 1), OP, _schema())


@torch.library.custom_op("dflash::gelu_tanh_experts", mutates_args=())
def gelu_tanh_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """hidden [tokens, hidden] through each token's chosen experts, weighted as given (the gather form)."""
    gate, up = torch.einsum("th,tkih->tki", hidden, gate_up_proj[top_k_index]).chunk(2, dim=-1)
    out = torch.einsum("tki,tkhi->tkh", F.gelu(gate, approximate="tanh") * up, down_proj[top_k_index])
    return (out * top_k_weights.to(out.dtype)[..., None]).sum(dim=1)


@gelu_tanh_experts.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return torch.empty_like(hidden)


def gelu_tanh_experts_node(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """torch.onnx's translation of dflash::gelu_tanh_experts: one dflash::GeluTanhExperts node."""
    return GELU_EXPERTS_OP(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)


TRANSLATIONS = {torch.ops.dflash.gelu_tanh_experts.default: gelu_tanh_experts_node}


def gemma4_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """Gemma4TextExperts.forward as one dflash::gelu_tanh_experts call."""
    return torch.ops.dflash.gelu_tanh_experts(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj,
                                              experts.down_proj)


def gelu_tanh_experts_function(opset: int) -> ir.Function:
    """dflash::GeluTanhExperts' body in standard ops: the experts some token of the call chose (`Unique`), their
    weights gathered, each on every token of the call, weighted by the routing (zero where a token did not choose
    it) and summed in expert order. A decode step reads k experts' weights, not all of them; each expert's matmul
    has the call's tokens as its columns whichever experts are chosen, so a token's result does not depend on what
    the other tokens of its call chose (as it did not when every expert ran)."""
    x, index, given, gate_up, down = (ir.Value(name=name) for name in INPUTS)
    body = FunctionBody()
    add, ints = body.add, body.ints

    def scalar(value: float) -> ir.Value:
        return add("CastLike", add("Constant", value=ir.tensor(value, dtype=ir.DataType.FLOAT)), x)

    experts = add("Slice", add("Shape", gate_up), ints([0]), ints([1]))
    tokens = add("Slice", add("Shape", x), ints([0]), ints([1]))
    zeros = add("ConstantOfShape", add("Concat", tokens, experts, axis=0),
                value=ir.tensor([0.0], dtype=ir.DataType.FLOAT))
    routing = add("ScatterElements", zeros, index, add("Cast", given, to=ir.DataType.FLOAT), axis=1)  # [T, E]
    chosen = add("Unique", add("Reshape", index, ints([-1])), sorted=1, outputs=4)[0]  # [U], ascending
    columns = add("Transpose", x, perm=[1, 0])  # [hidden, tokens]
    gate, up = add("Split", add("MatMul", add("Gather", gate_up, chosen, axis=0), columns), axis=1, num_outputs=2,
                   outputs=2)  # [U, I, tokens]
    # gelu, tanh form: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch's approximate="tanh"
    cubed = add("Mul", add("Mul", gate, gate), gate)
    inner = add("Mul", scalar(math.sqrt(2.0 / math.pi)), add("Add", gate, add("Mul", scalar(0.044715), cubed)))
    gelu = add("Mul", add("Mul", scalar(0.5), gate), add("Add", scalar(1.0), add("Tanh", inner)))
    per_expert = add("MatMul", add("Gather", down, chosen, axis=0), add("Mul", gelu, up))  # [U, hidden, tokens]
    weights = add("CastLike", add("Gather", routing, chosen, axis=1), x)  # [T, U]
    weights = add("Unsqueeze", add("Transpose", weights, perm=[1, 0]), ints([1]))  # [U, 1, tokens]
    summed = add("ReduceSum", add("Mul", per_expert, weights), ints([0]), keepdims=0)  # [hidden, tokens]
    out = add("Transpose", summed, perm=[1, 0])
    out.name = "output"
    graph = ir.Graph([x, index, given, gate_up, down], [out], nodes=body.nodes, opset_imports={"": opset}, name=OP)
    return ir.Function(DOMAIN, OP, "", graph=graph, attributes=[])
