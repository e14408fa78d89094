"""gpt-oss's attention as one graph node: `dflash::SinkAttention`, an ONNX model-local function.

gpt-oss adds a learned logit per head (its "sink") to each softmax's denominator: eager attention over repeated
K/V, the additive mask, a sink column joined to the scores, softmax, the column dropped. onnxscript's attention
fusions do not recognise that, so the ORT lowering's buffer form could not map it to GroupQueryAttention, whose
`head_sink` input computes exactly this (measured against a numpy reference). During export the model's attention
interface is this op instead (registered with transformers' AttentionInterface): one node
`dflash::SinkAttention(query [b, s, heads * d], key [b, kv_heads, keys, d], value, mask [b, 1, s, keys], sinks
[heads])` with `num_heads` and `scale`, defined by a function of standard ops that computes what transformers'
eager_attention_forward computes; the ORT buffer form (passes/kv_buffer.py) reads its key and value like a
MultiHeadAttention's and turns it into GroupQueryAttention with head_sink and the layer's window.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import onnx
import onnx_ir as ir
import onnxscript
import torch
from torch import nn
from transformers import AttentionInterface

from dflash_onnx.artifacts.graph_files import MOE_DOMAIN as DOMAIN
from dflash_onnx.artifacts.graph_files import SINK_ATTENTION_OP as OP
from dflash_onnx.exporter.models.function_body import FunctionBody

INPUTS = ("query", "key", "value", "mask", "sinks")
IMPLEMENTATION = "dflash_sink_attention"  # the name it is registered under in transformers' AttentionInterface


def _schema() -> onnx.defs.OpSchema:
    parameter = onnx.defs.OpSchema.FormalParameter
    attribute = onnx.defs.OpSchema.Attribute
    return onnx.defs.OpSchema(
        OP, DOMAIN, 1, inputs=[parameter(name, "T") for name in INPUTS], outputs=[parameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types")],
        attributes=[attribute("num_heads", onnx.defs.OpSchema.AttrType.INT, "query heads"),
                    attribute("scale", onnx.defs.OpSchema.AttrType.FLOAT, "score scale")])


SINK_ATTENTION_OP = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, 1), OP, _schema())


@torch.library.custom_op("dflash::sink_attention", mutates_args=())
def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """query [b, s, heads * d] over key/value [b, kv_heads, keys, d] with an additive mask and a sink logit per
    head: [b, s, heads * d], as transformers' gpt-oss eager attention computes it."""
    batch, rows, _ = query.shape
    groups = num_heads // key.shape[1]
    q = query.reshape(batch, rows, num_heads, -1).transpose(1, 2)
    keys, values = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale + mask
    combined = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(batch, -1, rows, 1).to(scores.dtype)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values).transpose(1, 2).reshape(batch, rows, -1)


@sink_attention.register_fake
def _(query, key, value, mask, sinks, num_heads, scale):
    return torch.empty_like(query)


def sink_attention_node(query, key, value, mask, sinks, num_heads: int, scale: float):
    """torch.onnx's translation of dflash::sink_attention: one dflash::SinkAttention node."""
    return SINK_ATTENTION_OP(query, key, value, mask, sinks, num_heads=num_heads, scale=scale)


TRANSLATIONS = {torch.ops.dflash.sink_attention.default: sink_attention_node}


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor, scaling: float, dropout: float = 0.0, s_aux: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [b, heads, s, d] and the cache's K/V -> [b, s, heads, d]."""
    batch, heads, rows, dim = query.shape
    flat = query.transpose(1, 2).reshape(batch, rows, heads * dim)
    out = torch.ops.dflash.sink_attention(flat, key, value, attention_mask, s_aux, heads, float(scaling))
    return out.reshape(batch, rows, heads, dim), None


AttentionInterface.register(IMPLEMENTATION, _attention)


def has_sinks(model: nn.Module) -> bool:
    return any(hasattr(layer.self_attn, "sinks") for layer in model.get_decoder().layers if hasattr(layer, "self_attn"))


@contextmanager
def sinks_as_one_op(model: nn.Module) -> Iterator[None]:
    """For the duration, a model whose attention has sinks (gpt-oss) computes it as dflash::sink_attention (what
    torch.onnx traces); other models are left as they are."""
    if not has_sinks(model):
        yield
        return
    text = model.config.get_text_config(decoder=True)
    saved = text._attn_implementation
    text._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        text._attn_implementation = saved


def sink_attention_function(opset: int) -> ir.Function:
    """dflash::SinkAttention's body in standard ops, as transformers' gpt-oss eager attention computes it."""
    query, key, value, mask, sinks = (ir.Value(name=name) for name in INPUTS)
    body = FunctionBody()
    add, ints = body.add, body.ints
    heads = add("Reshape", body.referenced("num_heads", ir.AttributeType.INT, "value_int"), ints([1]))
    scale = add("CastLike", body.referenced("scale", ir.AttributeType.FLOAT, "value_float"), query)
    shape = add("Shape", query)
    batch, rows = add("Slice", shape, ints([0]), ints([1])), add("Slice", shape, ints([1]), ints([2]))
    q = add("Transpose", add("Reshape", query, add("Concat", batch, rows, heads, ints([-1]), axis=0)),
            perm=[0, 2, 1, 3])  # [b, heads, s, d]
    kv_shape = add("Shape", key)
    kv_heads, keys, dim = (add("Slice", kv_shape, ints([i]), ints([i + 1])) for i in (1, 2, 3))
    groups = add("Div", heads, kv_heads)
    expanded = add("Concat", batch, kv_heads, groups, keys, dim, axis=0)
    repeated = add("Concat", batch, heads, keys, dim, axis=0)

    def repeat(kv: ir.Value) -> ir.Value:  # [b, kv_heads, keys, d] -> [b, heads, keys, d], head h reading h // groups
        return add("Reshape", add("Expand", add("Unsqueeze", kv, ints([2])), expanded), repeated)

    scores = add("Add", add("Mul", add("MatMul", q, add("Transpose", repeat(key), perm=[0, 1, 3, 2])), scale), mask)
    sink_column = add("Expand", add("CastLike", add("Reshape", sinks, ints([1, -1, 1, 1])), scores),
                      add("Concat", batch, heads, rows, ints([1]), axis=0))
    combined = add("Concat", scores, sink_column, axis=-1)
    combined = add("Sub", combined, add("ReduceMax", combined, ints([-1]), keepdims=1))
    probs = add("Slice", add("Softmax", combined, axis=-1), ints([0]), ints([-1]), ints([-1]))
    out = add("Reshape", add("Transpose", add("MatMul", probs, repeat(value)), perm=[0, 2, 1, 3]),
              add("Concat", batch, rows, ints([-1]), axis=0))
    out.name = "output"
    graph = ir.Graph([query, key, value, mask, sinks], [out], nodes=body.nodes, opset_imports={"": opset}, name=OP)
    return ir.Function(DOMAIN, OP, "", graph=graph, attributes=[
        ir.Attr("num_heads", ir.AttributeType.INT, 1), ir.Attr("scale", ir.AttributeType.FLOAT, 1.0)])
