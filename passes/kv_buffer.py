"""kv-buffer: the target's attention as GroupQueryAttention over preallocated K/V (the ORT buffer form).

In the exported (concat) form every step transposes the past K/V, concatenates the new rows, transposes
`present` back and repeats K/V per query head: five copies of the whole cache per layer, a cost that grows
with the context. Here each layer's attention becomes one com.microsoft GroupQueryAttention whose
`past_key`/`past_value` are [batch, kv_heads, rows, head_dim] buffers (rows up to ctx_len) the session binds as
both input and output (ORT then writes the new rows in place), and whose `seqlens_k` / `total_sequence_length`
inputs carry the committed length: rollback is a smaller length on the next call. Float32 graphs with
head sizes that are multiples of 16 (ORT's requirement) also hand RoPE to GroupQueryAttention (do_rotary,
with a ctx_len cos/sin cache computed as the graph computes its angles), which removes the rotations and
their transposes.

Input: a target graph after `rope-fusion` and `ort-fusions` (attention as MultiHeadAttention over
`Concat(Transpose(past), new)`); option `ctx_len`. The causal mask comes from the lengths; a sliding-window
layer (the manifest's `kv_windows`) gets GroupQueryAttention's `local_window_size`, which on ORT's CPU kernel
masks exactly as the export's windowed mask (a query sees keys fewer than `window` positions back: measured
against a numpy reference). An export that does not record its windows and has them fails the ORT lowering's
check. Layers may differ in K/V shape and in rotary frequencies (one cos/sin cache per inv_freq). Applied by the
ORT lowering only.

Option `kv_dtype=int8` (`lower --target ort --kv-dtype int8`) makes the buffers int8: every GroupQueryAttention gets
`k_quant_type` / `v_quant_type` PER_CHANNEL, `kv_cache_bit_width` 8 and its layer's `k_scale` / `v_scale` (inputs 12
and 13, [1, kv_heads, 1, head_dim] float32) from the npz file named by option `kv_scales` (the lowering calibrates
them). ONNX Runtime's CPU kernel writes round(x / scale) saturated to [-128, 127] and attends over the dequantized
cache, the call's own new rows included (measured against a numpy reference: 4e-7), so a token's K/V read the same
in the call that writes them and in every later one.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from dflash_onnx.artifacts.graph_files import MOE_DOMAIN, SINK_ATTENTION_OP
from dflash_onnx.passes import kv_ragged
from dflash_onnx.passes.base import PassContext
from dflash_onnx.passes.ir_graph import add_constant, attr, made_by, readers
from dflash_onnx.passes.rope_cache import rope_tables
from dflash_onnx.runtime.errors import DFlashError

SHAPE_ONLY = {"Unsqueeze", "Expand", "Reshape", "Transpose", "Squeeze", "Identity"}
SEQLENS, TOTAL = "seqlens_k", "total_sequence_length"
HEADS_FIRST = [0, 2, 1, 3]
HINT = "lower with --kv-buffer off to keep the concat form"
# the buffers' row count is left open: a session sizes them to the context in use (at most ctx_len, which the
# rotary cache and the lowering's capacity checks bound); GroupQueryAttention takes any buffer at least as long
# as the call's total_sequence_length
BUFFER_ROWS = "kv_buffer_rows"
# gqa: com.microsoft GroupQueryAttention (one request a call); ragged: TensorScatter + ONNX Attention, opset 24
# (a batch of requests a call: kv_ragged.py)
ATTENTIONS = ("gqa", "ragged")
# kv_dtype: float (the graph's own) or int8 (GroupQueryAttention's quantized cache, per-channel scales)
KV_DTYPES = ("float", "int8")
SCALE_SLOT = 12  # GroupQueryAttention's k_scale input (v_scale: 13), ONNX Runtime 1.32's contrib schema


def _only_reader(value: ir.Value, op_type: str) -> ir.Node:
    """The one `op_type` node reading `value`, besides Shape nodes (the mask's; checked dead afterwards)."""
    users = [u for u in readers(value) if u.op_type != "Shape"]
    if len(users) != 1 or users[0].op_type != op_type:
        raise DFlashError(f"buffer form: expected {value.name} to feed one {op_type}, found "
                          f"{[u.op_type for u in users]} ({HINT})")
    return users[0]


def _is_sink_attention(node: ir.Node) -> bool:
    return node.domain == MOE_DOMAIN and node.op_type == SINK_ATTENTION_OP


def _attention_reading(value: ir.Value) -> tuple[ir.Node, int]:
    """The MultiHeadAttention (or gpt-oss's dflash::SinkAttention, which takes query, key and value in the same
    slots) that `value` reaches through shape-only ops, and the input slot it enters."""
    frontier = [value]
    while frontier:
        current = frontier.pop()
        for use in current.uses():
            if use.node.op_type == "MultiHeadAttention" or _is_sink_attention(use.node):
                return use.node, use.idx
            if use.node.op_type in SHAPE_ONLY and use.idx == 0:
                frontier.append(use.node.outputs[0])
    raise DFlashError(f"buffer form: no MultiHeadAttention reads {value.name}: run the ort-fusions pass first "
                      f"({HINT})")


def _unrotated(value: ir.Value | None) -> ir.Value | None:
    """The input of a heads-first Transpose producing `value`."""
    node = made_by(value, "Transpose", perm=HEADS_FIRST)
    return node.inputs[0] if node is not None else None


def _rotary(attention: ir.Node, key_rows: ir.Value) -> tuple[ir.Value, ir.Value, np.ndarray] | None:
    """When the layer's q and k rotations are whole-head, non-interleaved RotaryEmbeddings over
    cos/sin(position * inv_freq): the unrotated q and k ([b, s, heads, hd]) and inv_freq, so that
    GroupQueryAttention can rotate them itself (do_rotary). None when the graph looks any other way."""
    query = made_by(attention.inputs[0], "Reshape")
    query = query and made_by(query.inputs[0], "Transpose", perm=HEADS_FIRST)
    rotations = [key_rows.producer(), query.inputs[0].producer() if query else None]
    if any(r is None or r.op_type != "RotaryEmbedding" or attr(r, "interleaved", 0) != 0
           or attr(r, "rotary_embedding_dim", 0) != 0 for r in rotations):
        return None
    k_rot, q_rot = rotations
    if list(k_rot.inputs[2:4]) != list(q_rot.inputs[2:4]):
        return None
    unrotated_q, unrotated_k = _unrotated(q_rot.inputs[0]), _unrotated(k_rot.inputs[0])
    cos, sin = made_by(k_rot.inputs[2], "Cos"), made_by(k_rot.inputs[3], "Sin")
    if None in (unrotated_q, unrotated_k, cos, sin) or cos.inputs[0] is not sin.inputs[0]:
        return None
    angles = cos.inputs[0].producer()
    if angles is not None and angles.op_type == "Reshape":
        angles = angles.inputs[0].producer()
    if angles is None or angles.op_type != "Mul":
        return None
    frequencies = [v.const_value for v in angles.inputs if v is not None and v.is_initializer()]
    if len(frequencies) != 1:
        return None
    return unrotated_q, unrotated_k, frequencies[0].numpy().reshape(-1)


class _Rewriter:
    """Rewrites one target graph; holds what its layers share (shapes, the rotary cache, new inputs)."""

    def __init__(self, model: ir.Model, ctx_len: int, spec, scales: dict[str, np.ndarray] | None = None):
        self.graph, self.ctx_len, self.spec = model.graph, ctx_len, spec
        self.scales = scales  # per K/V input name, its int8 scales [kv_heads, head_dim]; None: float buffers
        self.inputs = {v.name: v for v in self.graph.inputs}
        self.outputs = {v.name: v for v in self.graph.outputs}
        self.kv_type = self.inputs[spec.kv_inputs[0]].type
        batch, seq = self.inputs["input_ids"].shape
        self.row_dims = [batch, seq]  # of every [batch, seq, width] value added
        self.flat_shape = add_constant(self.graph, "kv_buffer_bsd_shape", np.array([0, 0, -1], np.int64))
        self.seqlens = ir.Value(name=SEQLENS, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([batch]))
        self.total = ir.Value(name=TOTAL, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([]))
        # the rotary cos/sin caches, one per distinct inv_freq (Gemma's sliding and full layers rotate differently)
        self.caches: dict[bytes, tuple[ir.Value, ir.Value]] = {}
        self.rotary_layers = 0
        self.windowed_layers = 0
        self.sink_layers = 0

    def _rows(self, source: ir.Value, width: int, name: str) -> tuple[ir.Node, ir.Value]:
        """Reshape [b, s, h, hd] -> [b, s, h * hd], with the shape declared (tidy reads it)."""
        out = ir.Value(name=name, type=self.kv_type, shape=ir.Shape([*self.row_dims, width]))
        return ir.node("Reshape", [source, self.flat_shape], outputs=[out]), out

    def parts(self, layer: int) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value, dict[str, ir.Value], ir.Node]:
        """Layer `layer`'s past and present K/V values, its new rows (heads-first, by role) and its attention."""
        spec = self.spec
        k_in, v_in = (self.inputs[n] for n in spec.kv_inputs[2 * layer: 2 * layer + 2])
        k_out, v_out = (self.outputs[n] for n in spec.kv_outputs[2 * layer: 2 * layer + 2])
        rows, attention = {}, None
        for role, past, present in (("key", k_in, k_out), ("value", v_in, v_out)):
            to_heads_first = _only_reader(past, "Transpose")
            concat = _only_reader(to_heads_first.outputs[0], "Concat")
            if len(concat.inputs) != 2 or concat.inputs[0] is not to_heads_first.outputs[0]:
                raise DFlashError(f"buffer form: {past.name} is not concatenated with the new rows in layer {layer}")
            if made_by(present, "Transpose") is None or present.producer().inputs[0] is not concat.outputs[0]:
                raise DFlashError(f"buffer form: {present.name} is not the transposed concatenation of layer {layer}")
            found, slot = _attention_reading(concat.outputs[0])
            if attention is not None and found is not attention:
                raise DFlashError(f"buffer form: keys and values of layer {layer} reach different attentions")
            if slot != (1 if role == "key" else 2):
                raise DFlashError(f"buffer form: the {role}s of layer {layer} enter attention input {slot}")
            attention, rows[role] = found, concat.inputs[1]
        return k_in, v_in, k_out, v_out, rows, attention

    def replace_present(self, k_out: ir.Value, v_out: ir.Value, key: ir.Value, value: ir.Value) -> None:
        """The new attention's K/V outputs become the graph's `present` outputs, under their names."""
        for old, new in ((k_out, key), (v_out, value)):
            name = old.name
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            old.name, new.name, new.type = f"{name}_concat_form", name, old.type

    def layer(self, layer: int) -> None:
        spec = self.spec
        k_in, v_in, k_out, v_out, rows, attention = self.parts(layer)
        kv_heads, head_dim = spec.kv_shape(spec.kv_inputs[2 * layer])
        heads, kv_width = attr(attention, "num_heads"), kv_heads * head_dim
        # ORT's GroupQueryAttention rotates only heads whose size is a multiple of 16
        float32 = self.kv_type.dtype == ir.DataType.FLOAT
        rotary = _rotary(attention, rows["key"]) if float32 and head_dim % 16 == 0 else None
        new_nodes, flat = [], {}
        for role, value in rows.items():  # new rows [b, kv, t, hd] -> [b, t, kv*hd], as GQA takes them
            seq_first = rotary[1] if role == "key" and rotary is not None else _unrotated(value)
            if seq_first is None:  # the rows were not made heads-first by a Transpose: transpose them back
                turn = ir.node("Transpose", [value], {"perm": HEADS_FIRST},
                               outputs=[ir.Value(name=f"{value.name}_bsnh_l{layer}")])
                new_nodes.append(turn)
                seq_first = turn.outputs[0]
            reshape, flat[role] = self._rows(seq_first, kv_width, f"{value.name}_bsd_l{layer}")
            new_nodes.append(reshape)
        options = {"num_heads": heads, "kv_num_heads": kv_heads}
        if "scale" in attention.attributes:
            options["scale"] = attr(attention, "scale")
        window = spec.kv_windows[layer] if spec.kv_windows else 0
        if window:  # a query sees the keys fewer than `window` positions back, as the export's mask (measured)
            options["local_window_size"] = window
            self.windowed_layers += 1
        query, extra = attention.inputs[0], []
        if rotary is not None:
            reshape, query = self._rows(rotary[0], heads * head_dim, f"gqa_query_l{layer}")
            new_nodes.append(reshape)
            key = np.ascontiguousarray(rotary[2], np.float32).tobytes()
            if key not in self.caches:
                cos, sin = rope_tables(self.ctx_len, rotary[2])
                suffix = f"_{len(self.caches)}" if self.caches else ""
                self.caches[key] = (add_constant(self.graph, f"kv_buffer_cache_cos{suffix}", cos),
                                    add_constant(self.graph, f"kv_buffer_cache_sin{suffix}", sin))
            extra = list(self.caches[key])
            options.update(do_rotary=1, rotary_interleaved=0)
            self.rotary_layers += 1
        if _is_sink_attention(attention):  # its sink logit per head: GroupQueryAttention's head_sink (measured)
            extra = [*(extra or [None, None]), None, None, attention.inputs[4]]
            self.sink_layers += 1
        inputs = [query, flat["key"], flat["value"], k_in, v_in, self.seqlens, self.total, *extra]
        if self.scales is not None:
            inputs += [None] * (SCALE_SLOT - len(inputs))
            inputs += [self._scale(k_in, layer, "k"), self._scale(v_in, layer, "v")]
            options.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
        gqa = ir.node("GroupQueryAttention", inputs, options, domain="com.microsoft", num_outputs=3,
                      name=f"gqa_buffer_{layer}")
        gqa.outputs[0].type = attention.outputs[0].type or self.kv_type
        gqa.outputs[0].shape = ir.Shape([*self.row_dims, heads * head_dim])
        self.replace_present(k_out, v_out, gqa.outputs[1], gqa.outputs[2])  # GQA writes `present` now
        ir.convenience.replace_all_uses_with(attention.outputs[0], gqa.outputs[0])
        gqa.outputs[0].name, attention.outputs[0].name = attention.outputs[0].name, None
        self.graph.insert_before(attention, [*new_nodes, gqa])
        self.graph.remove(attention, safe=True)

    def _scale(self, past: ir.Value, layer: int, role: str) -> ir.Value:
        """Layer `layer`'s `role` (k or v) scale initializer [1, kv_heads, 1, head_dim], as GroupQueryAttention takes
        a per-channel one."""
        if past.name not in self.scales:
            raise DFlashError(f"kv-buffer.kv_scales has no scales for {past.name}: lower with --kv-dtype int8 (the "
                              "ORT lowering calibrates them)")
        kv_heads, head_dim = self.spec.kv_shape(past.name)
        scale = np.asarray(self.scales[past.name], np.float32).reshape(1, kv_heads, 1, head_dim)
        if not np.all(scale > 0) or not np.all(np.isfinite(scale)):
            raise DFlashError(f"kv-buffer.kv_scales: the scales of {past.name} are not all positive and finite")
        return add_constant(self.graph, f"kv_buffer_{role}_scale_l{layer}", scale)

    def finish(self) -> None:
        """Declare the buffers and the length inputs; refuse a graph whose K/V inputs something else reads."""
        spec = self.spec
        for name in [*spec.kv_inputs, *spec.kv_outputs]:
            kv_heads, head_dim = spec.kv_shape(name)
            buffer = ir.Shape(["batch", kv_heads, BUFFER_ROWS, head_dim])
            value = self.inputs.get(name) or {v.name: v for v in self.graph.outputs}[name]
            value.shape = buffer
            if self.scales is not None:
                value.type = ir.TensorType(ir.DataType.INT8)
        self.graph.inputs.extend([self.seqlens, self.total])


def _reads_batch_only(node: ir.Node) -> bool:
    """Shape(x)[0:1]: the batch size, the same in both layouts (the exporter reads it from a K/V input)."""
    return node.op_type == "Shape" and attr(node, "start", 0) == 0 and attr(node, "end") == 1


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    """Rewrite every layer's attention of the target graph to the buffer form."""
    if context.graph != "target":
        return model, {"skipped": "the target's attention only"}
    ctx_len = context.int_option("ctx_len")  # positions the buffers may hold (the rotary cache's rows)
    attention = context.option("attention", "gqa")
    if attention not in ATTENTIONS:
        raise DFlashError(f"--pass-option kv-buffer.attention={attention}: choose one of {', '.join(ATTENTIONS)}")
    kv_dtype = context.option("kv_dtype", "float")
    if kv_dtype not in KV_DTYPES:
        raise DFlashError(f"--pass-option kv-buffer.kv_dtype={kv_dtype}: choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "int8" and attention != "gqa":
        raise DFlashError("kv-buffer.kv_dtype=int8 is GroupQueryAttention's quantized cache: use attention=gqa")
    scales = _scales(context.option("kv_scales", "")) if kv_dtype == "int8" else None
    spec = context.manifest.target
    rewriter = _Rewriter(model, ctx_len, spec, scales)
    layers = kv_ragged.RaggedRewriter(rewriter) if attention == "ragged" else rewriter
    for layer in range(spec.num_layers):
        layers.layer(layer)
    rewriter.finish()
    if attention == "ragged":
        kv_ragged.declare_opset(model)
    else:
        model.opset_imports.setdefault("com.microsoft", 1)
    RemoveUnusedNodesPass()(model)
    others = sorted({(u.op_type, u.name) for name in spec.kv_inputs for u in readers(rewriter.inputs[name])
                     if u.op_type not in ("GroupQueryAttention", "TensorScatter") and not _reads_batch_only(u)})
    if others:
        raise DFlashError(f"buffer form: K/V inputs still read by {others} ({HINT})")
    return model, {"attentions": spec.num_layers, "attention": attention, "ctx_len": ctx_len,
                   "rotary_in_attention": rewriter.rotary_layers, "sliding_windows": rewriter.windowed_layers,
                   "sinks": rewriter.sink_layers, "kv_dtype": "int8" if scales is not None else spec.kv_dtype,
                   **({"kv_quantization": "per_channel"} if scales is not None else {})}


def _scales(path: str) -> dict[str, np.ndarray]:
    """The int8 scales by K/V input name, from the npz file the ORT lowering wrote."""
    if not path:
        raise DFlashError("kv-buffer.kv_dtype=int8 needs kv_scales (an npz file of per-channel scales): lower with "
                          "--target ort --kv-dtype int8, which calibrates them")
    try:
        with np.load(path) as data:
            return {name: data[name] for name in data.files}
    except OSError as exc:
        raise DFlashError(f"kv-buffer.kv_scales={path}: cannot read it ({exc})") from None
