"""Mixture-of-experts layers as one graph node: `dflash::MoE`, an ONNX model-local function.

A transformers MoE block routes each token to its top-k experts with a data-dependent loop (or grouped_mm),
which torch.onnx cannot trace. During export each known block calls one custom torch op instead; it becomes a
node `dflash::MoE(input, router_logits, gate_up_proj, down_proj)` with ONNX Runtime's MoE attributes (`k`,
`normalize_routing_weights`), defined by a model-local function of standard ops, so any ONNX runtime runs the
export. That body computes every expert and weights each token's sum by its routing (exact: unrouted experts get
weight 0); the ORT lowering replaces the node by `com.microsoft::MoE`, which computes only the routed experts, so
a decode step's cost follows the active experts (passes/moe.py).

Weights keep transformers' fused layout: gate_up_proj [experts, 2 * intermediate, hidden] (gate rows, then up
rows), down_proj [experts, hidden, intermediate].
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import onnx
import onnx_ir as ir
import onnxscript
import torch
from torch import nn
from torch.nn import functional as F

from dflash_onnx.artifacts.graph_files import MOE_DOMAIN as DOMAIN
from dflash_onnx.artifacts.graph_files import MOE_OP as OP
from dflash_onnx.exporter.models import gelu_experts, sink_attention, swiglu_experts


def _schema() -> onnx.defs.OpSchema:
    """dflash::MoE's signature, for torch.onnx's tracer (the node is defined by a model-local function)."""
    parameter = onnx.defs.OpSchema.FormalParameter
    attribute = onnx.defs.OpSchema.Attribute
    return onnx.defs.OpSchema(
        OP, DOMAIN, 1,
        inputs=[parameter(name, "T") for name in ("input", "router_logits", "gate_up_proj", "down_proj")],
        outputs=[parameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types")],
        attributes=[attribute("k", onnx.defs.OpSchema.AttrType.INT, "experts per token"),
                    attribute("normalize_routing_weights", onnx.defs.OpSchema.AttrType.INT, "1: renormalize")])


MOE_OP = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, 1), OP, _schema())


@dataclass(frozen=True)
class ExpertsLayout:
    """Where one transformers family keeps its router and experts inside a sparse MoE block."""

    router: str  # submodule with `weight` [experts, hidden] and top_k (norm_topk_prob; absent: always renormalized)
    experts: str  # submodule with gate_up_proj and down_proj
    shared: str | None = None  # an MLP every token also runs, added as sigmoid(shared_gate(x)) * shared(x)
    shared_gate: str | None = None  # a Linear(hidden, 1)


# Block classes whose forward is exactly: logits = router(x); softmax; top-k (renormalized when norm_topk_prob);
# sum of weight * down(silu(gate(x)) * up(x)) over the chosen experts; plus, where `shared` is set, the gated
# shared expert.
SHARED = {"shared": "shared_expert", "shared_gate": "shared_expert_gate"}
LAYOUTS = {"Qwen3MoeSparseMoeBlock": ExpertsLayout(router="gate", experts="experts"),
           "Qwen2MoeSparseMoeBlock": ExpertsLayout(router="gate", experts="experts", **SHARED),
           "Qwen3_5MoeSparseMoeBlock": ExpertsLayout(router="gate", experts="experts", **SHARED),
           "Qwen3NextSparseMoeBlock": ExpertsLayout(router="gate", experts="experts", **SHARED)}


@torch.library.custom_op("dflash::moe", mutates_args=())
def moe(hidden: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
        top_k: int, normalize: bool) -> torch.Tensor:
    """hidden [tokens, hidden] routed to `top_k` of the experts by softmax(router_logits) (weights renormalized
    to sum to 1 when `normalize`): what the block computes, in the gather form (each token's experts only)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    gate, up = torch.einsum("th,tkih->tki", hidden, gate_up_proj[chosen]).chunk(2, dim=-1)
    out = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, down_proj[chosen])
    return (out * weights.to(out.dtype)[..., None]).sum(dim=1)


@moe.register_fake
def _(hidden, router_logits, gate_up_proj, down_proj, top_k, normalize):
    return torch.empty_like(hidden)


def moe_node(hidden, router_logits, gate_up_proj, down_proj, top_k: int, normalize: bool):
    """torch.onnx's translation of dflash::moe: the one dflash::MoE node (its body is added after export)."""
    return MOE_OP(hidden, router_logits, gate_up_proj, down_proj, k=top_k, normalize_routing_weights=int(normalize))


TRANSLATIONS = {torch.ops.dflash.moe.default: moe_node, **swiglu_experts.TRANSLATIONS, **gelu_experts.TRANSLATIONS,
                **sink_attention.TRANSLATIONS}


def _routed_forward(layout: ExpertsLayout):
    def forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        router, experts = block.get_submodule(layout.router), block.get_submodule(layout.experts)
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(flat, router.weight)
        out = torch.ops.dflash.moe(flat, logits, experts.gate_up_proj, experts.down_proj, router.top_k,
                                   bool(getattr(router, "norm_topk_prob", True)))
        if layout.shared:
            gate = torch.sigmoid(block.get_submodule(layout.shared_gate)(flat))
            out = out + gate * block.get_submodule(layout.shared)(flat)
        return out.reshape(hidden_states.shape)

    return forward


# blocks computed by dflash::swiglu_moe instead (dflash_onnx/exporter/models/swiglu_experts.py): gpt-oss's MLP
SWIGLU_BLOCKS = {"GptOssMLP": swiglu_experts.gpt_oss_forward}
# experts modules given their routing, computed by dflash::gelu_tanh_experts
# (dflash_onnx/exporter/models/gelu_experts.py):
# Gemma 4's, beside each MoE layer's dense MLP
ROUTED_EXPERTS = {"Gemma4TextExperts": gelu_experts.gemma4_experts_forward}


def moe_blocks(model: nn.Module) -> list[tuple[nn.Module, ExpertsLayout]]:
    """The sparse MoE blocks of `model` this exporter knows how to route, with their layouts."""
    return [(module, LAYOUTS[type(module).__name__]) for module in model.modules()
            if type(module).__name__ in LAYOUTS]


def swiglu_blocks(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if type(module).__name__ in SWIGLU_BLOCKS]


def routed_experts(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if type(module).__name__ in ROUTED_EXPERTS]


def experts_summary(model: nn.Module) -> dict | None:
    """What the manifest records of `model`'s routed experts (None for a dense model)."""
    blocks = moe_blocks(model)
    swiglu = swiglu_blocks(model)
    given = routed_experts(model)
    if given:
        text = model.config.get_text_config(decoder=True)
        return {"layers": len(given), "experts": int(given[0].gate_up_proj.shape[0]),
                "per_token": int(text.top_k_experts), "intermediate_size": int(given[0].down_proj.shape[2]),
                "activation": "gelu (tanh), beside a dense MLP; routing weights scaled per expert"}
    if swiglu:
        experts = swiglu[0].experts
        return {"layers": len(swiglu), "experts": int(experts.gate_up_proj.shape[0]),
                "per_token": int(swiglu[0].router.top_k), "intermediate_size": int(experts.down_proj.shape[1]),
                "activation": f"swiglu clamped at {experts.limit}, alpha {experts.alpha}, biased"}
    if not blocks:
        return None
    block, layout = blocks[0]
    router, experts = block.get_submodule(layout.router), block.get_submodule(layout.experts)
    summary = {"layers": len(blocks), "experts": int(experts.gate_up_proj.shape[0]), "per_token": int(router.top_k),
               "intermediate_size": int(experts.down_proj.shape[2])}
    if layout.shared:
        summary["shared_intermediate_size"] = int(block.get_submodule(layout.shared).down_proj.weight.shape[1])
    return summary


@contextmanager
def experts_as_one_op(model: nn.Module) -> Iterator[None]:
    """For the duration, every known MoE block of `model` calls dflash::moe (what torch.onnx traces), every block
    of SWIGLU_BLOCKS dflash::swiglu_moe, and every experts module of ROUTED_EXPERTS dflash::gelu_tanh_experts."""
    blocks = [(block, _routed_forward(layout)) for block, layout in moe_blocks(model)]
    blocks += [(block, SWIGLU_BLOCKS[type(block).__name__]) for block in swiglu_blocks(model)]
    blocks += [(block, ROUTED_EXPERTS[type(block).__name__]) for block in routed_experts(model)]
    for block, forward in blocks:
        block.forward = types.MethodType(forward, block)
    try:
        yield
    finally:
        for block, _ in blocks:
            del block.forward


def _node(op: str, inputs: list[ir.Value], outputs: int = 1, **attributes) -> ir.Node:
    return ir.node(op, inputs, attributes=attributes, num_outputs=outputs)


def moe_function(opset: int) -> ir.Function:
    """dflash::MoE's body in standard ops: every expert on every token, each weighted by its routing weight
    (zero for experts a token is not routed to), summed over experts. Attributes k and normalize_routing_weights
    are read by reference, as com.microsoft::MoE reads them."""
    names = ("input", "router_logits", "gate_up_proj", "down_proj")
    x, logits, gate_up, down = (ir.Value(name=name) for name in names)
    nodes: list[ir.Node] = []

    def add(op: str, *inputs: ir.Value, outputs: int = 1, **attributes) -> ir.Value | tuple[ir.Value, ...]:
        node = _node(op, list(inputs), outputs, **attributes)
        nodes.append(node)
        return node.outputs[0] if outputs == 1 else tuple(node.outputs)

    def constant(values: list[int]) -> ir.Value:
        return add("Constant", value=ir.tensor(values, dtype=ir.DataType.INT64))

    k_node = ir.Node("", "Constant", [], attributes=[ir.RefAttr("value_int", "k", ir.AttributeType.INT)])
    normalize_node = ir.Node("", "Constant", [], attributes=[
        ir.RefAttr("value_int", "normalize_routing_weights", ir.AttributeType.INT)])
    nodes += [k_node, normalize_node]
    k = add("Reshape", k_node.outputs[0], constant([1]))
    probs = add("Softmax", add("Cast", logits, to=ir.DataType.FLOAT), axis=-1)
    top, chosen = add("TopK", probs, k, outputs=2, axis=-1)
    # normalized: top / sum(top); else top / 1 (the flag is an attribute: 1 - flag + flag * sum)
    flag = add("Cast", normalize_node.outputs[0], to=ir.DataType.FLOAT)
    one = add("Constant", value=ir.tensor(1.0, dtype=ir.DataType.FLOAT))
    total = add("ReduceSum", top, constant([-1]), keepdims=1)
    top = add("Div", top, add("Add", add("Sub", one, flag), add("Mul", flag, total)))
    routing = add("ScatterElements", add("Mul", probs, add("Constant", value=ir.tensor(0.0))), chosen, top, axis=1)
    routing = add("CastLike", routing, x)  # [tokens, experts], in the graph's float type
    columns = add("Transpose", x, perm=[1, 0])  # [hidden, tokens]
    gate, up = add("Split", add("MatMul", gate_up, columns), axis=1, num_outputs=2, outputs=2)  # [E, I, tokens]
    act = add("Mul", add("Mul", gate, add("Sigmoid", gate)), up)
    per_expert = add("MatMul", down, act)  # [experts, hidden, tokens]
    weights = add("Unsqueeze", add("Transpose", routing, perm=[1, 0]), constant([1]))  # [experts, 1, tokens]
    summed = add("ReduceSum", add("Mul", per_expert, weights), constant([0]), keepdims=0)  # [hidden, tokens]
    out = add("Transpose", summed, perm=[1, 0])
    out.name = "output"
    graph = ir.Graph([x, logits, gate_up, down], [out], nodes=nodes, opset_imports={"": opset}, name=OP)
    return ir.Function(DOMAIN, OP, "", graph=graph, attributes=[
        ir.Attr("k", ir.AttributeType.INT, 1), ir.Attr("normalize_routing_weights", ir.AttributeType.INT, 1)])


def add_moe_function(model: ir.Model) -> bool:
    """Define dflash::MoE, dflash::SwigluMoE, dflash::GeluTanhExperts and dflash::SinkAttention in `model` where it
    calls them (after torch.onnx's optimizer, which would try to inline them); whether the graph calls any."""
    called = {node.op_type for node in model.graph if node.domain == DOMAIN}
    builders = {OP: moe_function, swiglu_experts.OP: swiglu_experts.swiglu_moe_function,
                gelu_experts.OP: gelu_experts.gelu_tanh_experts_function,
                sink_attention.OP: sink_attention.sink_attention_function}
    for op in called & set(builders):
        function = builders[op](model.opset_imports[""])
        model.functions[function.identifier()] = function
        model.opset_imports[DOMAIN] = 1
    return bool(called & set(builders))
