"""gpt-oss's experts as one graph node: `dflash::SwigluMoE`, an ONNX model-local function.

gpt-oss routes each token to the top-k of its router's logits (biased), softmaxed over those k; its experts have
biases, an interleaved gate/up matrix (column 2i gate i, column 2i + 1 up i), and a clamped SwiGLU:
gate = min(gate, limit), up = clip(up, -limit, limit), out = (up + beta) * gate * sigmoid(alpha * gate). That is
com.microsoft::MoE's swiglu with `activation_alpha`, `activation_beta`, `swiglu_limit`, `swiglu_fusion=1` and
its bias inputs, so the node carries those attributes and takes the kernel's layouts: fc1 [experts, 2 x
intermediate, hidden] (rows interleaved), fc2 [experts, hidden, intermediate] (the transposes of the checkpoint's
tensors, folded into the weights when the graph is written). Its function body computes every expert for every
token, each weighted by its routing weight (zero where a token is not routed): exact and portable; the ORT
lowering swaps it for com.microsoft::MoE, which computes only the routed experts (passes/experts.py).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnxscript
import torch
from torch import nn

from dflash_onnx.artifacts.graph_files import MOE_DOMAIN as DOMAIN
from dflash_onnx.artifacts.graph_files import SWIGLU_MOE_OP as OP
from dflash_onnx.exporter.models.function_body import FunctionBody

INPUTS = ("input", "router_logits", "fc1", "fc1_bias", "fc2", "fc2_bias")
FLOAT_ATTRIBUTES = ("activation_alpha", "activation_beta", "swiglu_limit")


def _schema() -> onnx.defs.OpSchema:
    parameter = onnx.defs.OpSchema.FormalParameter
    attribute = onnx.defs.OpSchema.Attribute
    floats = [attribute(name, onnx.defs.OpSchema.AttrType.FLOAT, name) for name in FLOAT_ATTRIBUTES]
    return onnx.defs.OpSchema(
        OP, DOMAIN, 1, inputs=[parameter(name, "T") for name in INPUTS], outputs=[parameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types")],
        attributes=[attribute("k", onnx.defs.OpSchema.AttrType.INT, "experts per token"), *floats])


SWIGLU_MOE_OP = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, 1), OP, _schema())


@torch.library.custom_op("dflash::swiglu_moe", mutates_args=())
def swiglu_moe(hidden: torch.Tensor, router_logits: torch.Tensor, fc1: torch.Tensor, fc1_bias: torch.Tensor,
               fc2: torch.Tensor, fc2_bias: torch.Tensor, top_k: int, alpha: float, beta: float,
               limit: float) -> torch.Tensor:
    """hidden [tokens, hidden] through the top-k experts of router_logits (softmax over the k), gpt-oss's way."""
    values, chosen = torch.topk(router_logits, top_k, dim=-1)
    weights = torch.softmax(values, dim=-1)
    gate_up = torch.einsum("th,tkfh->tkf", hidden, fc1[chosen]) + fc1_bias[chosen]
    gate, up = gate_up[..., 0::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    act = (up + beta) * gate * torch.sigmoid(gate * alpha)
    out = torch.einsum("tki,tkhi->tkh", act, fc2[chosen]) + fc2_bias[chosen]
    return (out * weights.to(out.dtype)[..., None]).sum(dim=1)


@swiglu_moe.register_fake
def _(hidden, router_logits, fc1, fc1_bias, fc2, fc2_bias, top_k, alpha, beta, limit):
    return torch.empty_like(hidden)


def swiglu_moe_node(hidden, router_logits, fc1, fc1_bias, fc2, fc2_bias, top_k: int, alpha: float, beta: float,
                    limit: float):
    """torch.onnx's translation of dflash::swiglu_moe: one dflash::SwigluMoE node."""
    return SWIGLU_MOE_OP(hidden, router_logits, fc1, fc1_bias, fc2, fc2_bias, k=top_k, activation_alpha=alpha,
                         activation_beta=beta, swiglu_limit=limit)


TRANSLATIONS = {torch.ops.dflash.swiglu_moe.default: swiglu_moe_node}


def gpt_oss_forward(block: nn.Module, hidden_states: torch.Tensor):
    """GptOssMLP.forward as one dflash::swiglu_moe call (its router scores, unused by the decoder, as None)."""
    router, experts = block.router, block.experts
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits = nn.functional.linear(flat, router.weight, router.bias)
    out = torch.ops.dflash.swiglu_moe(flat, logits, experts.gate_up_proj.transpose(1, 2), experts.gate_up_proj_bias,
                                      experts.down_proj.transpose(1, 2), experts.down_proj_bias, router.top_k,
                                      float(experts.alpha), 1.0, float(experts.limit))
    return out.reshape(hidden_states.shape), None


def swiglu_moe_function(opset: int) -> ir.Function:
    """dflash::SwigluMoE's body in standard ops: every expert on every token, weighted by the routing."""
    x, logits, fc1, fc1_bias, fc2, fc2_bias = (ir.Value(name=name) for name in INPUTS)
    body = FunctionBody()
    add, ints, referenced = body.add, body.ints, body.referenced

    k = add("Reshape", referenced("k", ir.AttributeType.INT, "value_int"), ints([1]))
    alpha, beta, limit = (add("CastLike", referenced(name, ir.AttributeType.FLOAT, "value_float"), x)
                          for name in FLOAT_ATTRIBUTES)
    values, chosen = add("TopK", logits, k, outputs=2, axis=-1)
    routing = add("ScatterElements", add("Mul", logits, add("CastLike", add("Constant", value=ir.tensor(0.0)), x)),
                  chosen, add("Softmax", values, axis=-1), axis=1)  # [tokens, experts]
    columns = add("Transpose", x, perm=[1, 0])  # [hidden, tokens]
    gate_up = add("Add", add("MatMul", fc1, columns), add("Unsqueeze", fc1_bias, ints([2])))  # [E, 2I, tokens]
    gate = add("Slice", gate_up, ints([0]), ints([2**62]), ints([1]), ints([2]))
    up = add("Slice", gate_up, ints([1]), ints([2**62]), ints([1]), ints([2]))
    gate = add("Min", gate, limit)
    up = add("Min", add("Max", up, add("Neg", limit)), limit)
    act = add("Mul", add("Add", up, beta), add("Mul", gate, add("Sigmoid", add("Mul", gate, alpha))))
    per_expert = add("Add", add("MatMul", fc2, act), add("Unsqueeze", fc2_bias, ints([2])))  # [E, hidden, tokens]
    weights = add("Unsqueeze", add("Transpose", routing, perm=[1, 0]), ints([1]))  # [E, 1, tokens]
    summed = add("ReduceSum", add("Mul", per_expert, weights), ints([0]), keepdims=0)
    out = add("Transpose", summed, perm=[1, 0])
    out.name = "output"
    graph = ir.Graph([x, logits, fc1, fc1_bias, fc2, fc2_bias], [out], nodes=body.nodes, opset_imports={"": opset},
                     name=OP)
    return ir.Function(DOMAIN, OP, "", graph=graph, attributes=[
        ir.Attr("k", ir.AttributeType.INT, 1), *(ir.Attr(name, ir.AttributeType.FLOAT, 1.0)
                                                 for name in FLOAT_ATTRIBUTES)])
