"""ONNX operator semantics in MLX, one function per op, for the graphs dflash-onnx exports.

Values are numpy arrays (host: graph inputs, shapes and the index arithmetic derived from them) or
mx.arrays (device: weights and everything computed from them). An op whose inputs are all on the host
runs in numpy, so shape bookkeeping never enters MLX's graph; any device input moves the op to MLX.
`QuantizedWeight` stands for a MatMul weight that lowering quantized with `mx.quantize`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import onnx

NP_DTYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
             onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32, onnx.TensorProto.BOOL: np.bool_,
             onnx.TensorProto.DOUBLE: np.float64}
MX_DTYPES = {onnx.TensorProto.FLOAT: mx.float32, onnx.TensorProto.FLOAT16: mx.float16,
             onnx.TensorProto.BFLOAT16: mx.bfloat16, onnx.TensorProto.INT64: mx.int64,
             onnx.TensorProto.INT32: mx.int32, onnx.TensorProto.BOOL: mx.bool_}


@dataclass(frozen=True)
class QuantizedWeight:
    """W [K, N] of x @ W, stored as mx.quantize(W.T): MatMul becomes mx.quantized_matmul(transpose=True)."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int


def on_device(*values) -> bool:
    return any(isinstance(v, mx.array) for v in values)


def host(value) -> np.ndarray:
    """A value whose contents decide shapes or indices, as numpy."""
    return value if isinstance(value, np.ndarray) else np.array(value)


def device(value) -> mx.array:
    return value if isinstance(value, mx.array) else mx.array(value)


def _xp(*values):
    return mx if on_device(*values) else np


def _both(*values):
    """The inputs in one world: all mx when any is, else numpy as they are."""
    if on_device(*values):
        return [device(v) for v in values]
    return list(values)


def _axes(value, default=None) -> list[int] | None:
    return default if value is None else [int(a) for a in host(value).reshape(-1)]


def _binary(numpy_op, mlx_op):
    def run(inputs, attrs):
        a, b = _both(*inputs)
        return [mlx_op(a, b) if isinstance(a, mx.array) else numpy_op(a, b)]
    return run


def _unary(numpy_op, mlx_op):
    def run(inputs, attrs):
        (x,) = inputs
        return [mlx_op(x) if isinstance(x, mx.array) else numpy_op(x)]
    return run


def _matmul(inputs, attrs):
    x, w = inputs
    if isinstance(w, QuantizedWeight):
        return [mx.quantized_matmul(device(x), w.weight, w.scales, w.biases, transpose=True,
                                    group_size=w.group_size, bits=w.bits)]
    a, b = _both(x, w)
    return [a @ b]


def _cast(inputs, attrs):
    (x,) = inputs
    to = attrs["to"]
    return [x.astype(MX_DTYPES[to]) if isinstance(x, mx.array) else x.astype(NP_DTYPES[to])]


def _concat(inputs, attrs):
    values = _both(*inputs)
    return [_xp(*values).concatenate(values, axis=attrs["axis"])]


def _constant(inputs, attrs):
    return [attrs["value"]]


def _expand(inputs, attrs):
    x, shape = inputs
    target = np.broadcast_shapes(tuple(x.shape), tuple(int(d) for d in host(shape)))
    return [_xp(x).broadcast_to(x, target)]


def _gather(inputs, attrs):
    data, indices = inputs
    axis = attrs.get("axis", 0)
    if isinstance(data, mx.array):
        return [mx.take(data, device(indices).astype(mx.int32), axis=axis)]
    return [np.take(data, host(indices), axis=axis)]


def _reduce(name: str):
    """ReduceMean / ReduceMax (axes as an input, opset 18): numpy on the host, MLX on the device."""
    def run(inputs, attrs):
        x, axes = (inputs + [None])[:2]
        axes = _axes(axes, list(range(x.ndim)))
        keep = bool(attrs.get("keepdims", 1))
        if isinstance(x, np.ndarray):
            return [getattr(x, name)(axis=tuple(axes), keepdims=keep)]
        return [getattr(mx, name)(x, axis=axes, keepdims=keep)]
    return run


def _reshape(inputs, attrs):
    x, shape = inputs
    dims = [int(d) for d in host(shape)]
    if not attrs.get("allowzero", 0):
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return [x.reshape(dims)]


def _shape(inputs, attrs):
    (x,) = inputs
    dims = list(x.shape)
    start, end = attrs.get("start", 0), attrs.get("end", len(dims))
    return [np.array(dims[start:end], dtype=np.int64)]


def _slice(inputs, attrs):
    x, starts, ends, axes, steps = (inputs + [None, None])[:5]
    starts, ends = _axes(starts), _axes(ends)
    axes = _axes(axes, list(range(len(starts))))
    steps = _axes(steps, [1] * len(starts))
    index = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        size = x.shape[axis]
        index[axis] = slice(*slice(start, end, step).indices(size))
    return [x[tuple(index)]]


def _softmax(inputs, attrs):
    (x,) = inputs
    axis = attrs.get("axis", -1)
    if isinstance(x, mx.array):
        return [mx.softmax(x, axis=axis, precise=True)]
    shifted = np.exp(x - x.max(axis=axis, keepdims=True))
    return [shifted / shifted.sum(axis=axis, keepdims=True)]


def _squeeze(inputs, attrs):
    x, axes = (inputs + [None])[:2]
    axes = _axes(axes, [i for i, d in enumerate(x.shape) if d == 1])
    return [_xp(x).squeeze(x, axis=tuple(a % x.ndim for a in axes))]


def _unsqueeze(inputs, attrs):
    x, axes = inputs
    rank = x.ndim + host(axes).size
    result = x
    for axis in sorted(a % rank for a in _axes(axes)):
        result = _xp(result).expand_dims(result, axis)
    return [result]


def _transpose(inputs, attrs):
    (x,) = inputs
    perm = attrs.get("perm", list(range(x.ndim))[::-1])
    return [_xp(x).transpose(x, perm)]


def _where(inputs, attrs):
    condition, x, y = _both(*inputs)
    return [_xp(condition).where(condition, x, y)]


def _range(inputs, attrs):
    start, limit, delta = (host(v).item() for v in inputs)
    return [np.arange(start, limit, delta, dtype=host(inputs[0]).dtype)]


def _argmax(inputs, attrs):
    (x,) = inputs
    axis, keep = attrs.get("axis", 0), bool(attrs.get("keepdims", 1))
    if isinstance(x, mx.array):
        return [mx.argmax(x, axis=axis, keepdims=keep).astype(mx.int64)]
    return [np.argmax(x, axis=axis, keepdims=keep).astype(np.int64)]


def _rotate(x, cos, sin, interleaved: bool):
    """Rotate the last axis of x (its first 2*cos.shape[-1] entries) by cos/sin broadcast to x."""
    half = cos.shape[-1]
    if interleaved:
        raise NotImplementedError("interleaved RotaryEmbedding")
    first, second, rest = x[..., :half], x[..., half: 2 * half], x[..., 2 * half:]
    xp = _xp(x, cos)
    rotated = xp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return xp.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated


def _rotary(inputs, attrs, contrib: bool):
    """RotaryEmbedding (opset 23, or com.microsoft's): x [b, n, s, h] or [b, s, n*h] (with num_heads)."""
    if contrib:
        x, positions, cos, sin = inputs
    else:
        x, cos, sin, positions = (inputs + [None])[:4]
    if positions is not None:
        index = host(positions)
        cos, sin = cos[index], sin[index]  # [b, s, h/2] rows at the positions
    x, cos, sin = _both(x, cos, sin)
    if x.ndim == 3:
        b, s, width = x.shape
        heads = attrs.get("num_heads") or width // (2 * cos.shape[-1])
        x4 = x.reshape(b, s, heads, width // heads)
        out = _rotate(x4, _xp(cos).expand_dims(cos, 2), _xp(sin).expand_dims(sin, 2), bool(attrs.get("interleaved")))
        return [out.reshape(b, s, width)]
    c, s_ = _xp(cos).expand_dims(cos, 1), _xp(sin).expand_dims(sin, 1)
    return [_rotate(x, c, s_, bool(attrs.get("interleaved")))]


OPS: dict[tuple[str, str], Callable] = {
    ("", "Add"): _binary(np.add, mx.add),
    ("", "Sub"): _binary(np.subtract, mx.subtract),
    ("", "Mul"): _binary(np.multiply, mx.multiply),
    ("", "Div"): _binary(np.divide, mx.divide),
    ("", "Pow"): _binary(np.power, mx.power),
    ("", "LessOrEqual"): _binary(np.less_equal, mx.less_equal),
    ("", "Less"): _binary(np.less, mx.less),
    ("", "GreaterOrEqual"): _binary(np.greater_equal, mx.greater_equal),
    ("", "Or"): _binary(np.logical_or, mx.logical_or),
    ("", "Max"): _binary(np.maximum, mx.maximum),
    ("", "Min"): _binary(np.minimum, mx.minimum),
    ("", "Greater"): _binary(np.greater, mx.greater),
    ("", "Equal"): _binary(np.equal, mx.equal),
    ("", "And"): _binary(np.logical_and, mx.logical_and),
    ("", "MatMul"): _matmul,
    ("", "Neg"): _unary(np.negative, mx.negative),
    ("", "Sqrt"): _unary(np.sqrt, mx.sqrt),
    ("", "Reciprocal"): _unary(np.reciprocal, mx.reciprocal),
    ("", "Cos"): _unary(np.cos, mx.cos),
    ("", "Sin"): _unary(np.sin, mx.sin),
    ("", "Sigmoid"): _unary(lambda x: 1 / (1 + np.exp(-x)), mx.sigmoid),
    ("", "IsNaN"): _unary(np.isnan, mx.isnan),
    ("", "Abs"): _unary(np.abs, mx.abs),
    ("", "Exp"): _unary(np.exp, mx.exp),
    ("", "Tanh"): _unary(np.tanh, mx.tanh),
    ("", "Not"): _unary(np.logical_not, mx.logical_not),
    ("", "Identity"): _unary(lambda x: x, lambda x: x),
    ("", "Cast"): _cast,
    ("", "Concat"): _concat,
    ("", "Constant"): _constant,
    ("", "Expand"): _expand,
    ("", "Gather"): _gather,
    ("", "ReduceMean"): _reduce("mean"),
    ("", "ReduceMax"): _reduce("max"),
    ("", "Reshape"): _reshape,
    ("", "Shape"): _shape,
    ("", "Slice"): _slice,
    ("", "Softmax"): _softmax,
    ("", "Squeeze"): _squeeze,
    ("", "Unsqueeze"): _unsqueeze,
    ("", "Transpose"): _transpose,
    ("", "Where"): _where,
    ("", "Range"): _range,
    ("", "ArgMax"): _argmax,
    ("", "RotaryEmbedding"): lambda inputs, attrs: _rotary(inputs, attrs, contrib=False),
    ("com.microsoft", "RotaryEmbedding"): lambda inputs, attrs: _rotary(inputs, attrs, contrib=True),
}
