"""rope-fusion: one rotary op per q/k rotation, with cos/sin computed once per position stream.

The exporter rotates every q and k as `x * Unsqueeze(cos) + Concat(-x[..., h:], x[..., :h]) * Unsqueeze(sin)`
where cos/sin = Cos/Sin(Concat(angles, angles)); in the draft they are sliced along the sequence axis
to the context stream (keys at context positions) or the block stream (queries and keys at block
positions). Each rule below matches one rotation, slices the half-width `angles` to its stream instead
of the doubled cos/sin, and emits the rotation in the requested form; common subexpression elimination
then leaves one Cos and one Sin per stream per graph, shared by every layer.

Forms (pass option `form`):
- `com.microsoft` (default): ONNX Runtime's contrib RotaryEmbedding (position ids index a per-call cache);
- `onnx`: the standard RotaryEmbedding (opset 23); the graph is converted to opset 23 first;
- `hoist`: plain opset-17/18 ops with the shared per-stream cos/sin only, for backends without the op.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    RemoveUnusedNodesPass,
)
from onnxscript import version_converter
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from dflash_onnx.passes.base import PassContext
from dflash_onnx.runtime.errors import DFlashError

FORMS = ("com.microsoft", "onnx", "hoist")
# Unsqueeze axis that broadcasts [batch, seq, head_dim] cos/sin over the heads -> layout of x.
LAYOUTS = {1: "bnsh", -3: "bnsh", 2: "bsnh", -2: "bsnh"}
SEQUENCE_AXES = (1, -2)  # the sequence axis of [batch, seq, head_dim] cos/sin and [batch, seq, half] angles


def _ints(value: ir.Value | None) -> list[int] | None:
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None else [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]


def _slice_inputs(value: ir.Value) -> list[ir.Value | None]:
    """(data, starts, ends, axes, steps) of the Slice producing `value`, padded with None."""
    inputs = list(value.producer().inputs)
    return inputs + [None] * (5 - len(inputs))


def _last_axis_slice(value: ir.Value) -> tuple[int, int] | None:
    """(start, end) when `value` is x[..., start:end] with step 1, else None."""
    _, starts, ends, axes, steps = _slice_inputs(value)
    start, end, axis = _ints(starts), _ints(ends), _ints(axes)
    step = [1] if steps is None else _ints(steps)
    if None in (start, end, axis, step) or len(start) != 1 or step != [1] or axis[0] not in (-1, 3):
        return None
    return start[0], end[0]


def _same(a: ir.Value | None, b: ir.Value | None) -> bool:
    return a is b or (a is not None and b is not None and _ints(a) is not None and _ints(a) == _ints(b))


def _const(op, values: list[int]) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(values, dtype=np.int64)))


def _hoisted(op, x, angles, trig, layout_axis, low, high, **_) -> ir.Value:
    # Unsqueeze before Concat: the same values, in a form these rules do not match again.
    heads_axis = op.Unsqueeze(angles, layout_axis)
    doubled = op.Concat(heads_axis, heads_axis, axis=-1)
    return op.Add(op.Mul(x, trig("Cos", doubled)), op.Mul(op.Concat(op.Neg(high), low, axis=-1), trig("Sin", doubled)))


def _standard(op, x, angles, trig, layout, num_heads, **_) -> ir.Value:
    cos, sin = trig("Cos", angles), trig("Sin", angles)
    if layout == "bnsh":
        return op.RotaryEmbedding(x, cos, sin, interleaved=0)
    rows = op.Reshape(x, _const(op, [0, 0, -1]))  # [batch, seq, heads*head_dim]: a free view of BSNH
    return op.Reshape(op.RotaryEmbedding(rows, cos, sin, interleaved=0, num_heads=num_heads), op.Shape(x))


def _contrib(op, x, angles, trig, layout, num_heads, half, **_) -> ir.Value:
    # The contrib op reads cos/sin rows at position ids: one row per (batch, token) of this stream.
    flat = op.Reshape(angles, _const(op, [-1, half]))
    count = op.Squeeze(op.Shape(flat, start=0, end=1), _const(op, [0]))
    positions = op.Reshape(op.Range(op.Constant(value_int=0), count, op.Constant(value_int=1)),
                           op.Shape(angles, start=0, end=2))
    cos, sin = trig("Cos", flat), trig("Sin", flat)
    if layout == "bnsh":
        return op.RotaryEmbedding(x, positions, cos, sin, interleaved=0, _domain="com.microsoft")
    rows = op.Reshape(x, _const(op, [0, 0, -1]))
    rotated = op.RotaryEmbedding(rows, positions, cos, sin, interleaved=0, num_heads=num_heads,
                                 _domain="com.microsoft")
    return op.Reshape(rotated, op.Shape(x))


EMITTERS: dict[str, Callable[..., ir.Value]] = {"hoist": _hoisted, "onnx": _standard, "com.microsoft": _contrib}


class RopeRotation(RewriteRuleClassBase):
    """x*cos + rotate_half(x)*sin, cos/sin = Cos/Sin(Concat(angles, angles)).

    `stream`: cos/sin sliced along the sequence axis to one position stream (the draft's context keys or
    block rows); `cast`: cos/sin cast after the trigonometry (float16 exports keep the angles float32).
    """

    def __init__(self, form: str, stream: bool, cast: bool):
        name = f"RopeRotation[{form}{', stream' if stream else ''}{', cast' if cast else ''}]"
        super().__init__(name=name, remove_nodes=False)  # cos/sin are shared by other rotations
        self.form, self.stream, self.cast = form, stream, cast

    def _trig(self, op, trig: str, doubled):
        value = getattr(op, trig)(doubled)
        if self.cast:
            value = op.Cast(value, _outputs=[f"{trig.lower()}_cast"])
        if self.stream:
            value = op.Slice(value, _allow_other_inputs=True, _outputs=[f"{trig.lower()}_stream"])
        return value

    def pattern(self, op, x, angles, cos_axis, sin_axis):
        doubled = op.Concat(angles, angles, axis=-1)
        low = op.Slice(x, _allow_other_inputs=True, _outputs=["low"])
        high = op.Slice(x, _allow_other_inputs=True, _outputs=["high"])
        rotated = op.Concat(op.Neg(high), low, axis=-1)
        cos = op.Unsqueeze(self._trig(op, "Cos", doubled), cos_axis)
        sin = op.Unsqueeze(self._trig(op, "Sin", doubled), sin_axis)
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

    def check(self, context, x, cos_axis, sin_axis, low, high, cos_stream=None, sin_stream=None, cos_cast=None,
              sin_cast=None, **_) -> MatchResult:
        result = MatchResult()
        axis, other = _ints(cos_axis), _ints(sin_axis)
        if axis is None or axis != other or len(axis) != 1 or axis[0] not in LAYOUTS:
            return result.fail("cos and sin are not broadcast over the heads axis of a 4-D tensor", cos_axis)
        low_range, high_range = _last_axis_slice(low), _last_axis_slice(high)
        if low_range is None or high_range is None:
            return result.fail("rotate_half slices are not constant last-axis slices with step 1", x)
        half = low_range[1]
        if low_range[0] != 0 or high_range[0] != half or high_range[1] < 2 * half or half <= 0:
            return result.fail(f"rotate_half does not split at the middle ({low_range}, {high_range})", x)
        if x.shape is None or x.shape.rank() != 4 or isinstance(x.shape[3], int) and x.shape[3] != 2 * half:
            return result.fail("rotated tensor is not 4-D with head_dim = 2 * the split point", x)
        if self.cast and _cast_to(cos_cast) != _cast_to(sin_cast):
            return result.fail("cos and sin are cast to different types", cos_cast)
        if self.stream:
            cos_slice, sin_slice = _slice_inputs(cos_stream)[1:], _slice_inputs(sin_stream)[1:]
            if not all(_same(a, b) for a, b in zip(cos_slice, sin_slice)):
                return result.fail("cos and sin are sliced to different position streams", cos_stream)
            if _ints(cos_slice[2]) is None or _ints(cos_slice[2])[0] not in SEQUENCE_AXES or \
                    (cos_slice[3] is not None and _ints(cos_slice[3]) != [1]):
                return result.fail("cos/sin stream slice is not a step-1 slice of the sequence axis", cos_stream)
        layout = LAYOUTS[axis[0]]
        if self.form != "hoist" and layout == "bsnh" and not isinstance(x.shape[2], int):
            return result.fail("number of heads of a [batch, seq, heads, head_dim] input is not static", x)
        return result

    def rewrite(self, op, x, angles, cos_axis, low, high, cos_stream=None, cos_cast=None, **_):
        if self.stream:
            _, starts, ends, axes, steps = _slice_inputs(cos_stream)
            angles = op.Slice(angles, starts, ends, axes, *([steps] if steps is not None else []))
        to = _cast_to(cos_cast) if self.cast else None

        def trig(kind: str, value: ir.Value) -> ir.Value:
            value = getattr(op, kind)(value)
            return value if to is None else op.Cast(value, to=to)

        layout = LAYOUTS[_ints(cos_axis)[0]]
        return EMITTERS[self.form](op, x=x, angles=angles, trig=trig, layout_axis=cos_axis, layout=layout, low=low,
                                   high=high, half=_last_axis_slice(low)[1],
                                   num_heads=x.shape[2] if layout == "bsnh" else x.shape[1])


def _cast_to(value: ir.Value) -> int:
    return value.producer().attributes["to"].as_int()


def rules(form: str) -> RewriteRuleSet:
    variants = [(stream, cast) for stream in (True, False) for cast in (True, False)]
    return RewriteRuleSet([RopeRotation.rule(form, stream, cast) for stream, cast in variants], commute=True)


def _leftover_rotations(model: ir.Model) -> list[str]:
    """Names of Neg nodes still feeding a rotate_half Concat: rotations no rule matched."""
    return [node.name for node in model.graph if node.op_type == "Neg"
            and any(use.node.op_type == "Concat" for use in node.outputs[0].uses())]


def fuse(model: ir.Model, form: str = "com.microsoft") -> dict:
    """Rewrite every q/k rotation of `model` in place; returns what matched and what did not."""
    if form not in FORMS:
        raise DFlashError(f"rope-fusion form {form!r}: choose from {', '.join(FORMS)}")
    if form == "onnx" and model.opset_imports.get("", 0) < 23:
        version_converter.convert_version(model, target_version=23)
        model.ir_version = max(model.ir_version or 0, 11)
    rotations = len(_leftover_rotations(model))
    fused = rules(form).apply_to_model(model)
    if form == "com.microsoft" and fused:
        model.opset_imports.setdefault("com.microsoft", 1)
    for step in (RemoveUnusedNodesPass(), CommonSubexpressionEliminationPass(), RemoveUnusedNodesPass()):
        step(model)
    return {
        "form": form,
        "rotations": rotations,
        "fused": fused,
        "rotary_nodes": sum(n.op_type == "RotaryEmbedding" for n in model.graph),
        "cos_nodes": sum(n.op_type == "Cos" for n in model.graph),
        # hoisting keeps the rotate_half ops by design, so only a count can tell what was left
        "unmatched": rotations - fused if form == "hoist" else _leftover_rotations(model),
    }


def run(model: ir.Model, context: PassContext) -> tuple[ir.Model, dict]:
    return model, fuse(model, context.option("form", "com.microsoft"))
