"""ONNX operator semantics in MLX, one function per op, for the graphs dflash-onnx exports and the fused
buffer form the MLX lowering rewrites them into (ONNX Runtime's contrib ops, on MLX's fast kernels).

Values are numpy arrays (host: graph inputs, shapes and the index arithmetic derived from them) or
mx.arrays (device: weights and everything computed from them). An op whose inputs are all on the host
runs in numpy, so shape bookkeeping never enters MLX's graph; any device input moves the op to MLX.
`QuantizedWeight` stands for a MatMul weight that lowering quantized with `mx.quantize`. A rotation whose
cos/sin tables the session recognised as cos/sin(position * inv_freq) carries `rope` (base, wavelengths) in its
attributes and runs as one `mx.fast.rope`; other tables are read row by row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import mlx.core as mx
import numpy as np
import onnx

SPLIT_DOMAIN = "dflash.mlx"  # ops the session makes from one ONNX node (session.py: _split_attention)
NP_DTYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
             onnx.TensorProto.BFLOAT16: ml_dtypes.bfloat16,
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
    return value if isinstance(value, np.ndarray) else as_numpy(value)


def as_numpy(value: mx.array) -> np.ndarray:
    """An MLX array as numpy; bfloat16, which numpy lacks, as ml_dtypes' bfloat16 (bit for bit)."""
    if value.dtype == mx.bfloat16:
        return np.array(value.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(value)


def device(value) -> mx.array:
    return value if type(value) is mx.array else mx.array(value)


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
        a, b = inputs
        if type(a) is mx.array and type(b) is mx.array:  # the common case, checked first: a call's hot path
            return [mlx_op(a, b)]
        a, b = _both(a, b)
        return [mlx_op(a, b) if isinstance(a, mx.array) else numpy_op(a, b)]
    return run


def _unary(numpy_op, mlx_op):
    def run(inputs, attrs):
        (x,) = inputs
        return [mlx_op(x) if isinstance(x, mx.array) else numpy_op(x)]
    return run


def _matmul(inputs, attrs):
    x, w = inputs
    if type(x) is mx.array and type(w) is mx.array:
        return [x @ w]
    if isinstance(w, QuantizedWeight):
        x = device(x)
        if x.dtype in (mx.bfloat16, mx.float16) and mx.default_device().type == mx.cpu:
            # MLX's CPU kernel takes half-precision inputs badly: bfloat16 accumulates in bfloat16, float16 runs
            # far slower than float32 inputs (docs/mlx.md#half-precision-on-mlxcpu)
            return [mx.quantized_matmul(x.astype(mx.float32), w.weight, w.scales, w.biases, transpose=True,
                                        group_size=w.group_size, bits=w.bits).astype(x.dtype)]
        return [mx.quantized_matmul(x, w.weight, w.scales, w.biases, transpose=True,
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
    if isinstance(data, QuantizedWeight):  # a quantized embedding: its rows, dequantized
        index = device(indices).astype(mx.int32)
        return [mx.dequantize(mx.take(data.weight, index, axis=0), mx.take(data.scales, index, axis=0),
                              mx.take(data.biases, index, axis=0), group_size=data.group_size, bits=data.bits)]
    if isinstance(data, mx.array):
        return [mx.take(data, device(indices).astype(mx.int32), axis=axis)]
    return [np.take(data, host(indices), axis=axis)]


def _reduce(name: str):
    """ReduceMean / ReduceMax / ReduceSum (axes as an input, opset 18): numpy on the host, MLX on the device."""
    def run(inputs, attrs):
        x, axes = (inputs + [None])[:2]
        axes = _axes(axes, list(range(x.ndim)))
        keep = bool(attrs.get("keepdims", 1))
        if isinstance(x, np.ndarray):
            return [getattr(x, name)(axis=tuple(axes), keepdims=keep)]
        return [getattr(mx, name)(x, axis=axes, keepdims=keep)]
    return run


def _cumsum(inputs, attrs):
    """CumSum along an axis given as an input (DSpark's sampled chain: a softmax's running sum)."""
    x, axis = inputs
    if attrs.get("exclusive", 0) or attrs.get("reverse", 0):
        raise NotImplementedError("CumSum with exclusive or reverse")
    axis = int(host(axis).reshape(-1)[0])
    return [np.cumsum(x, axis=axis) if isinstance(x, np.ndarray) else mx.cumsum(x, axis=axis)]


def _clip(inputs, attrs):
    """Clip with optional min / max inputs (opset 11+)."""
    x, low, high = (inputs + [None, None])[:3]
    if isinstance(x, np.ndarray):
        return [np.clip(x, None if low is None else host(low), None if high is None else host(high))]
    low, high = (None if bound is None else device(bound).astype(x.dtype) for bound in (low, high))
    return [mx.clip(x, low, high)]


def _reshape(inputs, attrs):
    x, shape = inputs
    dims = host(shape).tolist()
    if 0 in dims and not attrs.get("allowzero", 0):
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


def _top_k(inputs, attrs):
    """TopK along the last axis, largest first, sorted (DFlash2's candidates): values and int64 indices."""
    x, k = inputs
    k, axis = int(host(k).reshape(-1)[0]), attrs.get("axis", -1)
    if axis not in (-1, x.ndim - 1) or not attrs.get("largest", 1):
        raise NotImplementedError("TopK other than the largest along the last axis")
    if isinstance(x, mx.array):
        order = mx.argsort(-x, axis=-1)[..., :k]
        return [mx.take_along_axis(x, order, axis=-1), order.astype(mx.int64)]
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return [np.take_along_axis(x, order, axis=-1), order.astype(np.int64)]


def _gather_elements(inputs, attrs):
    data, indices = _both(*inputs)
    xp = _xp(data)
    return [xp.take_along_axis(data, indices.astype(mx.int32 if xp is mx else np.int64), axis=attrs.get("axis", 0))]


def _einsum(inputs, attrs):
    equation = attrs["equation"]
    equation = equation.decode() if isinstance(equation, bytes) else equation
    values = _both(*inputs)
    return [_xp(*values).einsum(equation, *values)]


def _pad(inputs, attrs):
    """Pad, constant mode, pads as an input (opset 18), optionally with axes."""
    x, pads, value, axes = (inputs + [None] * 3)[:4]
    if attrs.get("mode", b"constant") not in (b"constant", "constant"):
        raise NotImplementedError("Pad other than constant")
    pads = host(pads).astype(np.int64).tolist()
    axes = list(range(x.ndim)) if axes is None else [a % x.ndim for a in host(axes).tolist()]
    width = [(0, 0)] * x.ndim
    for index, axis in enumerate(axes):
        width[axis] = (pads[index], pads[index + len(axes)])
    fill = 0 if value is None else host(value).reshape(-1)[0].item()
    if isinstance(x, mx.array):
        return [mx.pad(x, width, constant_values=fill)]
    return [np.pad(x, width, constant_values=fill)]


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
    rope = attrs.get("rope")
    start = None if positions is None or rope is None or not on_device(x) else _consecutive_from(host(positions))
    if start is not None and x.ndim == 3 and attrs.get("num_heads") and not attrs.get("interleaved"):
        heads = attrs["num_heads"]
        if x.shape[-1] == heads * 2 * cos.shape[-1]:  # whole heads rotated
            return [_seq_first(_fast_rope(_heads_first(x, heads), start, rope))]
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


def rope_frequencies(cos: np.ndarray, sin: np.ndarray) -> np.ndarray | None:
    """The wavelengths 1 / inv_freq (mx.fast.rope's `freqs`) when the [rows, half] tables are exactly
    cos/sin(position * inv_freq) in float32 (HF's default RoPE; scaled tables are not), else None."""
    if cos.ndim != 2 or cos.shape != sin.shape or len(cos) < 2:
        return None
    inv_freq = np.arctan2(sin[1].astype(np.float64), cos[1].astype(np.float64)).astype(np.float32)
    if not np.all(inv_freq > 0):
        return None
    angles = np.arange(len(cos), dtype=np.float32)[:, None] * inv_freq[None]
    tolerance = 2e-5 * max(1.0, float(angles.max()))
    if np.abs(np.cos(angles) - cos).max() > tolerance or np.abs(np.sin(angles) - sin).max() > tolerance:
        return None
    return (1.0 / inv_freq).astype(np.float32)


def rope_base(wavelengths: np.ndarray) -> float | None:
    """The base theta when the wavelengths are theta^(2i/d) (HF's default RoPE): mx.fast.rope then computes the
    frequencies itself, which builds its call faster than passing them (docs/mlx.md#the-lowering-and-the-session)."""
    dim = 2 * len(wavelengths)
    base = float(wavelengths[1]) ** (dim / 2) if len(wavelengths) > 1 else None
    if base is None or not np.isfinite(base) or base <= 1:
        return None
    base = float(f"{base:.4g}")  # float32 wavelengths give 9999.97 for 10000: configs hold round thetas
    expected = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return base if np.allclose(expected, wavelengths, rtol=1e-5) else None


def _fast_rope(x: mx.array, offset: int | mx.array, rope: tuple[float | None, mx.array]) -> mx.array:
    """x [b, heads, s, head_dim] rotated at positions offset.. (HF's rotate_half convention); `rope` is the
    (base, wavelengths) the session recognised."""
    base, freqs = rope
    if base is not None:
        return mx.fast.rope(x, x.shape[-1], traditional=False, base=base, scale=1.0, offset=offset)
    return mx.fast.rope(x, x.shape[-1], traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs)


def _table_rope(x: mx.array, start: int, cos: mx.array, sin: mx.array) -> mx.array:
    end = start + x.shape[2]
    return _rotate(x, cos[start:end], sin[start:end], interleaved=False)


def _consecutive_from(positions: np.ndarray) -> int | None:
    """The first position when every row holds consecutive positions from the same start, else None."""
    first = int(positions.reshape(-1)[0])
    rows = positions.reshape(-1, positions.shape[-1])
    steps = np.arange(first, first + rows.shape[-1])
    return first if np.array_equal(rows, np.broadcast_to(steps, rows.shape)) else None


def _rms_norm(inputs, attrs):
    """SimplifiedLayerNormalization over the last axis."""
    x, scale = inputs[:2]
    if attrs.get("axis", -1) not in (-1, x.ndim - 1):
        raise NotImplementedError("SimplifiedLayerNormalization over an axis other than the last")
    return [mx.fast.rms_norm(device(x), device(scale), attrs.get("epsilon", 1e-5))]


def _skip_rms_norm(inputs, attrs):
    """com.microsoft SkipSimplifiedLayerNormalization: (norm(input + skip [+ bias]), -, -, input + skip [+ bias])."""
    total = device(inputs[0]) + device(inputs[1])
    if len(inputs) > 3 and inputs[3] is not None:
        total = total + device(inputs[3])
    return [mx.fast.rms_norm(total, device(inputs[2]), attrs.get("epsilon", 1e-5)), None, None, total]


def _fused_matmul(inputs, attrs):
    """com.microsoft FusedMatMul: alpha * A @ B, B optionally transposed (a tied lm_head)."""
    a, b = inputs
    if attrs.get("transA", 0) or attrs.get("transBatchA", 0) or attrs.get("transBatchB", 0):
        raise NotImplementedError("FusedMatMul with transA or batch transposes")
    if isinstance(b, QuantizedWeight):
        out = mx.quantized_matmul(device(a), b.weight, b.scales, b.biases, transpose=True, group_size=b.group_size,
                                  bits=b.bits)
    else:
        b = device(b)
        out = device(a) @ (mx.swapaxes(b, -1, -2) if attrs.get("transB", 0) else b)
    alpha = float(attrs.get("alpha", 1.0))
    return [out if alpha == 1.0 else out * alpha]


def _heads_first(x: mx.array, heads: int) -> mx.array:
    """[b, s, heads * d] -> [b, heads, s, d]."""
    b, s, width = x.shape
    return x.reshape(b, s, heads, width // heads).transpose(0, 2, 1, 3)


def _seq_first(x: mx.array) -> mx.array:
    """[b, heads, s, d] -> [b, s, heads * d]."""
    b, heads, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, heads * d)


def _group_query_attention(inputs, attrs):
    """com.microsoft GroupQueryAttention over [b, kv_heads, ctx_len, d] buffers shared by past and present: the
    call's rows are written in place at [total - s, total) and attended causally (grouped heads, no repeat)."""
    query, key, value, past_key, past_value, _, total = inputs[:7]
    cos, sin = (inputs + [None, None])[7:9]
    if key is None:
        raise NotImplementedError("GroupQueryAttention with packed QKV")
    if attrs.get("local_window_size", -1) != -1 or attrs.get("softcap", 0.0) or attrs.get("rotary_interleaved", 0):
        raise NotImplementedError("GroupQueryAttention with a local window, softcap or interleaved rotary")
    heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
    start = int(total) - query.shape[1]
    q, k, v = _heads_first(query, heads), _heads_first(key, kv_heads), _heads_first(value, kv_heads)
    if attrs.get("do_rotary", 0):
        rope = attrs.get("rope")
        if rope is not None:
            q, k = _fast_rope(q, start, rope), _fast_rope(k, start, rope)
        else:
            q, k = _table_rope(q, start, cos, sin), _table_rope(k, start, cos, sin)
    out, past_key, past_value = _attend_rotated(
        [q, k.astype(past_key.dtype), v.astype(past_value.dtype), past_key, past_value, None, total], attrs)
    return [_seq_first(out), past_key, past_value]


def _to_device(inputs, attrs):
    """A host scalar (a feed's length) as a device scalar, so that a compiled run can read it as an argument
    instead of fixing it in its trace."""
    return [mx.array(host(inputs[0]).reshape(()))]


def _rotary_heads(inputs, attrs):
    """The first half of a rotary GroupQueryAttention, compilable: q, k, v heads-first, q and k rotated at
    positions total - s.. (`total` a device scalar: the trace does not fix it), k and v in the buffers' dtype."""
    query, key, value, total = inputs
    heads, kv_heads, dtype = attrs["num_heads"], attrs["kv_num_heads"], attrs["buffer_dtype"]
    start = total - query.shape[1]
    q = _fast_rope(_heads_first(query, heads), start, attrs["rope"])
    k = _fast_rope(_heads_first(key, kv_heads), start, attrs["rope"])
    return [q, k.astype(dtype), _heads_first(value, kv_heads).astype(dtype)]


def _attend_rotated(inputs, attrs):
    """The second half: GroupQueryAttention over heads-first, rotated q, k, v (in the buffers' dtype) from
    `_rotary_heads`; the call's rows written in place into the session's buffers, the output heads-first, for
    `_seq_first_op`."""
    q, k, v, past_key, past_value, _, total = inputs[:7]
    end = int(total)
    start = end - q.shape[2]
    past_key[:, :, start:end] = k
    past_value[:, :, start:end] = v
    scale = attrs.get("scale") or q.shape[-1] ** -0.5
    out = mx.fast.scaled_dot_product_attention(q, past_key[:, :, :end], past_value[:, :, :end], scale=float(scale),
                                               mask="causal" if q.shape[2] > 1 else None)
    return [out, past_key, past_value]  # heads first: the compiled run after it makes it [b, s, heads * d]


def _seq_first_op(inputs, attrs):
    return [_seq_first(inputs[0])]


def _attention(inputs, attrs):
    """ONNX Attention (opset 23), the draft's form: 3D [b, s, heads * d] inputs, grouped, not causal, an optional
    boolean or additive mask (a causal draft's)."""
    query, key, value, mask = (inputs + [None])[:4]
    if any(v is not None for v in inputs[4:]) or attrs.get("is_causal", 0) or attrs.get("softcap", 0.0):
        raise NotImplementedError("Attention with past K/V, is_causal or softcap")
    q = _heads_first(device(query), attrs["q_num_heads"])
    k, v = _heads_first(device(key), attrs["kv_num_heads"]), _heads_first(device(value), attrs["kv_num_heads"])
    scale = attrs.get("scale") or q.shape[-1] ** -0.5
    if mask is not None:
        mask = device(mask)
        mask = mask if mask.dtype == mx.bool_ else mask.astype(q.dtype)
    return [_seq_first(mx.fast.scaled_dot_product_attention(q, k, v, scale=float(scale), mask=mask))]


def _multi_head_attention(inputs, attrs):
    """com.microsoft MultiHeadAttention as the draft has it (kv heads = query heads): [b, s, heads * d] query, 3D
    or heads-first K/V, an optional additive attention_bias (a sliding window's)."""
    query, key, value, bias, padding, attention_bias = (inputs + [None] * 6)[:6]
    if bias is not None or padding is not None or any(v is not None for v in inputs[6:]) or \
            attrs.get("unidirectional", 0):
        raise NotImplementedError("MultiHeadAttention with a bias, key padding mask, past K/V or unidirectional")
    heads = attrs["num_heads"]
    q = _heads_first(device(query), heads)
    k, v = (device(x) if x.ndim == 4 else _heads_first(device(x), heads) for x in (key, value))
    scale = attrs.get("scale") or q.shape[-1] ** -0.5
    mask = None if attention_bias is None else device(attention_bias).astype(q.dtype)
    return [_seq_first(mx.fast.scaled_dot_product_attention(q, k, v, scale=float(scale), mask=mask))]


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
    ("", "ReduceSum"): _reduce("sum"),
    ("", "CumSum"): _cumsum,
    ("", "Clip"): _clip,
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
    ("", "TopK"): _top_k,
    ("", "GatherElements"): _gather_elements,
    ("", "Einsum"): _einsum,
    ("", "Pad"): _pad,
    ("", "RotaryEmbedding"): lambda inputs, attrs: _rotary(inputs, attrs, contrib=False),
    ("com.microsoft", "RotaryEmbedding"): lambda inputs, attrs: _rotary(inputs, attrs, contrib=True),
    ("", "SimplifiedLayerNormalization"): _rms_norm,
    ("com.microsoft", "SimplifiedLayerNormalization"): _rms_norm,
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): _skip_rms_norm,
    ("com.microsoft", "FusedMatMul"): _fused_matmul,
    ("com.microsoft", "GroupQueryAttention"): _group_query_attention,
    (SPLIT_DOMAIN, "ToDevice"): _to_device,
    (SPLIT_DOMAIN, "RotaryHeads"): _rotary_heads,
    (SPLIT_DOMAIN, "AttendRotated"): _attend_rotated,
    (SPLIT_DOMAIN, "SeqFirst"): _seq_first_op,
    ("", "Attention"): _attention,
    ("com.microsoft", "MultiHeadAttention"): _multi_head_attention,
}
