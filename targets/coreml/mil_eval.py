"""A CoreML mlprogram package evaluated in numpy, op by op from its spec: what `lower --target coreml` wrote,
checked where no CoreML runtime exists (prediction needs macOS 15+).

Each MIL op of the main function runs as numpy (the ops our converted target and draft use); values are kept
in the dtype the spec declares for them (float16 here), each op computing in float32 from its float16 inputs,
so the result rounds as CoreML's float16 storage does (not bit for bit: CoreML's kernels accumulate in their
own order). States are numpy arrays the caller keeps between calls, as `MLModel.make_state()` is. Weights are
read from the package's weight.bin through coremltools' blob reader.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.targets.coreml.session import import_coremltools

_DTYPES = {"BOOL": np.bool_, "FLOAT16": np.float16, "FLOAT32": np.float32, "FLOAT64": np.float64,
           "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8,
           "UINT16": np.uint16, "UINT32": np.uint32, "INT4": np.int8, "UINT4": np.uint8}
_BLOB_READERS = {"FLOAT16": "read_fp16_data", "FLOAT32": "read_float_data", "INT8": "read_int8_data",
                 "UINT8": "read_uint8_data", "INT4": "read_int4_data", "UINT4": "read_uint4_data",
                 "INT32": "read_int32_data", "INT16": "read_int16_data", "UINT16": "read_uint16_data"}
VARIADIC = {"values"}  # parameters that take a list even of one tensor (concat of a single tap's features)
_CASTS = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32, "bool": np.bool_, "int8": np.int8,
          "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16}


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _slices(shape, begin, end, stride, begin_mask, end_mask) -> tuple:
    index = []
    for axis, size in enumerate(shape):
        b = 0 if begin_mask is not None and begin_mask[axis] else int(begin[axis])
        e = size if end_mask is not None and end_mask[axis] else int(end[axis])
        index.append(slice(b, e, int(stride[axis]) if stride is not None else 1))
    return tuple(index)


def _slice_by_index(a):
    x = a["x"]
    out = x[_slices(x.shape, a["begin"], a["end"], a.get("stride"), a.get("begin_mask"), a.get("end_mask"))]
    squeeze = a.get("squeeze_mask")
    if squeeze is not None and np.any(squeeze):
        out = out.reshape([d for d, s in zip(out.shape, squeeze) if not s])
    return out


def _slice_update(a):
    x = a["x"].copy()
    index = _slices(x.shape, a["begin"], a["end"], a.get("stride"), a.get("begin_mask"), a.get("end_mask"))
    target = x[index]
    x[index] = a["update"].reshape(target.shape)
    return x


def _sdpa(a):
    q, k, v = _f32(a["query"]), _f32(a["key"]), _f32(a["value"])
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    mask = a.get("attn_mask")
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == np.bool_ else scores + _f32(mask)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (scores / scores.sum(axis=-1, keepdims=True)) @ v


def _softmax(a):
    x = _f32(a["x"])
    e = np.exp(x - x.max(axis=int(a["axis"]), keepdims=True))
    return e / e.sum(axis=int(a["axis"]), keepdims=True)


def _reduce(numpy_op):
    def run(a):
        axes = None if a.get("axes") is None else tuple(int(i) for i in a["axes"])
        return numpy_op(_f32(a["x"]), axis=axes, keepdims=bool(a.get("keep_dims", False)))
    return run


def _blockwise(a):
    """constexpr_blockwise_shift_scale: (data - offset) * scale, each scale covering a block of the data."""
    data, scale = a["data"].astype(np.float32), _f32(a["scale"])
    offset = a.get("offset")
    if offset is not None:
        data = data - _expand_blocks(_f32(offset).astype(np.float32), data.shape)
    return data * _expand_blocks(scale, data.shape)


def _expand_blocks(values: np.ndarray, shape: tuple) -> np.ndarray:
    for axis, (size, blocks) in enumerate(zip(shape, values.shape)):
        values = np.repeat(values, size // blocks, axis=axis)
    return values


def _gather(a):
    axis, batch = int(a.get("axis", 0)), int(a.get("batch_dims", 0))
    if batch:
        raise NotImplementedError("gather with batch_dims")
    return np.take(a["x"], a["indices"].astype(np.int64), axis=axis)


def _pad(a):
    """`pad` holds (before, after) pairs for the last len(pad) / 2 axes, first axis first."""
    x, pairs = a["x"], [int(p) for p in a["pad"]]
    widths = [(0, 0)] * (x.ndim - len(pairs) // 2) + list(zip(pairs[::2], pairs[1::2]))
    mode = str(a.get("mode", "constant"))
    if mode != "constant":
        raise NotImplementedError(f"pad mode {mode}")
    return np.pad(x, widths, constant_values=float(a.get("constant_val", 0.0)))


def _topk(a):
    """(values, indices): the k largest (or smallest, `ascending`) along `axis`, sorted, first index first on ties."""
    x, k, axis = _f32(a["x"]), int(a["k"]), int(a.get("axis", -1))
    order = np.argsort(x if a.get("ascending") else -x, axis=axis, kind="stable")
    indices = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, indices, axis=axis), indices


def _cumsum(a):
    x, axis = _f32(a["x"]), int(a.get("axis", 0))
    if a.get("reverse"):
        x = np.flip(x, axis)
    out = np.cumsum(x, axis=axis)
    if a.get("exclusive"):
        out = out - x
    return np.flip(out, axis) if a.get("reverse") else out


def _split(a):
    x, axis = a["x"], int(a["axis"])
    sizes = a.get("split_sizes")
    if sizes is None:
        return tuple(np.split(x, int(a["num_splits"]), axis=axis))
    return tuple(np.split(x, np.cumsum([int(n) for n in sizes])[:-1], axis=axis))


OPS: dict[str, Callable[[dict], np.ndarray | tuple[np.ndarray, ...]]] = {
    "add": lambda a: _f32(a["x"]) + _f32(a["y"]),
    "sub": lambda a: _f32(a["x"]) - _f32(a["y"]),
    "mul": lambda a: _f32(a["x"]) * _f32(a["y"]),
    "real_div": lambda a: _f32(a["x"]) / _f32(a["y"]),
    "pow": lambda a: np.power(_f32(a["x"]), _f32(a["y"])),
    "maximum": lambda a: np.maximum(_f32(a["x"]), _f32(a["y"])),
    "minimum": lambda a: np.minimum(_f32(a["x"]), _f32(a["y"])),
    "greater_equal": lambda a: a["x"] >= a["y"],
    "greater": lambda a: a["x"] > a["y"],
    "less": lambda a: a["x"] < a["y"],
    "less_equal": lambda a: a["x"] <= a["y"],
    "equal": lambda a: a["x"] == a["y"],
    "not_equal": lambda a: a["x"] != a["y"],
    "logical_and": lambda a: np.logical_and(a["x"], a["y"]),
    "logical_or": lambda a: np.logical_or(a["x"], a["y"]),
    "logical_not": lambda a: np.logical_not(a["x"]),
    "select": lambda a: np.where(a["cond"], _f32(a["a"]), _f32(a["b"])),
    "cast": lambda a: a["x"].astype(_CASTS[str(a["dtype"])]),
    "cos": lambda a: np.cos(_f32(a["x"])),
    "sin": lambda a: np.sin(_f32(a["x"])),
    "exp": lambda a: np.exp(_f32(a["x"])),
    "sqrt": lambda a: np.sqrt(_f32(a["x"])),
    "rsqrt": lambda a: 1.0 / np.sqrt(_f32(a["x"]) + float(a.get("epsilon", 1e-12))),
    "silu": lambda a: _f32(a["x"]) / (1.0 + np.exp(-_f32(a["x"]))),
    "sigmoid": lambda a: 1.0 / (1.0 + np.exp(-_f32(a["x"]))),
    "softmax": _softmax,
    "reduce_mean": _reduce(np.mean),
    "reduce_max": _reduce(np.max),
    "reduce_sum": _reduce(np.sum),
    "reduce_argmax": lambda a: np.expand_dims(np.argmax(a["x"], axis=int(a["axis"])), int(a["axis"]))
    if a.get("keep_dims") else np.argmax(a["x"], axis=int(a["axis"])).astype(np.int32),
    "linear": lambda a: _f32(a["x"]) @ _f32(a["weight"]).T + (0 if a.get("bias") is None else _f32(a["bias"])),
    "matmul": lambda a: (np.swapaxes(_f32(a["x"]), -1, -2) if a.get("transpose_x") else _f32(a["x"]))
    @ (np.swapaxes(_f32(a["y"]), -1, -2) if a.get("transpose_y") else _f32(a["y"])),
    "reshape": lambda a: a["x"].reshape([int(d) for d in a["shape"]]),
    "transpose": lambda a: np.transpose(a["x"], [int(p) for p in a["perm"]]),
    "expand_dims": lambda a: np.expand_dims(a["x"], tuple(int(i) for i in a["axes"])),
    "squeeze": lambda a: np.squeeze(a["x"], None if a.get("axes") is None else tuple(int(i) for i in a["axes"])),
    "tile": lambda a: np.tile(a["x"], [int(r) for r in a["reps"]]),
    "concat": lambda a: np.concatenate(a["values"], axis=int(a["axis"])),
    "gather": _gather,
    "slice_by_index": _slice_by_index,
    "slice_update": _slice_update,
    "scaled_dot_product_attention": _sdpa,
    "constexpr_blockwise_shift_scale": _blockwise,
    "shape": lambda a: np.array(a["x"].shape, np.int32),
    "identity": lambda a: a["x"],
    "pad": _pad,
    "fill_like": lambda a: np.full(np.shape(a["ref_tensor"]), float(a.get("value", 0.0))),
    "stack": lambda a: np.stack(a["values"], axis=int(a["axis"])),
    "topk": _topk,
    "gather_along_axis": lambda a: np.take_along_axis(a["x"], a["indices"].astype(np.int64), axis=int(a["axis"])),
    "cumsum": _cumsum,
    "split": _split,
    "tanh": lambda a: np.tanh(_f32(a["x"])),
    "clip": lambda a: np.clip(_f32(a["x"]), _f32(a["alpha"]), _f32(a["beta"])),
}


def read_spec(package: Path):
    """A package's spec, read without a CoreML runtime."""
    ct = import_coremltools()
    return ct.models.MLModel(str(package), skip_model_load=True).get_spec()


def function_states(spec, function: str) -> dict[str, tuple[int, ...]]:
    """The states a function of the package declares (a single-function package: its description's)."""
    described = {f.name: f for f in spec.description.functions} or {"main": spec.description}
    return {s.name: tuple(s.type.stateType.arrayType.shape) for s in described[function].state}


def weight_reader(package: Path):
    """coremltools' reader of the package's weight file. It maps the whole file, and the pages a run reads count
    in the process's resident memory once per mapping: functions of one package share a reader (the 4B target in
    parts, three functions per package, held up to 30 GB resident with one each)."""
    from coremltools import libmilstoragepython

    return libmilstoragepython._BlobStorageReader(str(Path(package) / "Data" / "com.apple.CoreML" / "weights" /
                                                      "weight.bin"))


class MilProgram:
    """One function of an mlprogram package, run in numpy: `run(feeds, states)` updates `states` (name -> array,
    as the function's state descriptions) in place and returns the outputs."""

    def __init__(self, package: Path, function: str = "main", spec=None, weights=None):
        """`weights`: the package's `weight_reader`, shared by its functions (each reader maps the whole file)."""
        from coremltools.proto import MIL_pb2

        package = Path(package)
        spec = spec or read_spec(package)
        if function not in spec.mlProgram.functions:
            raise DFlashError(f"{package.name} has no function {function!r} (it has "
                              f"{', '.join(spec.mlProgram.functions)})")
        main = spec.mlProgram.functions[function]
        block = main.block_specializations[main.opset]
        self.operations, self.outputs = list(block.operations), list(block.outputs)
        self.states = function_states(spec, function)
        self.input_names = [i.name for i in main.inputs if i.name not in self.states]
        self._names = MIL_pb2.DataType.Name
        self._weights = weights or weight_reader(package)
        self._constants: dict[str, np.ndarray] = {}
        last_read: dict[str, int] = {}
        for index, op in enumerate(self.operations):
            for binding in op.inputs.values():
                last_read.update((a.name, index) for a in binding.arguments if a.name)
        self._last_reads: dict[int, list[str]] = {}  # op index -> the values no later op reads (freed after it)
        for name, index in last_read.items():
            if name not in self.outputs:
                self._last_reads.setdefault(index, []).append(name)
        unknown = sorted({op.type for op in self.operations} - set(OPS) - {"const", "read_state", "write_state"})
        if unknown:
            raise DFlashError(f"{package.name}: MIL ops the numpy evaluator does not know: {', '.join(unknown)}")

    def initial_states(self) -> dict[str, np.ndarray]:
        return {name: np.zeros(shape, np.float16) for name, shape in self.states.items()}

    def _value(self, value) -> np.ndarray:
        tensor = value.type.tensorType
        kind = self._names(tensor.dataType)
        shape = [d.constant.size for d in tensor.dimensions]
        if value.WhichOneof("value") == "blobFileValue":
            data = np.asarray(getattr(self._weights, _BLOB_READERS[kind])(value.blobFileValue.offset))
            if kind == "FLOAT16":  # the reader returns the raw bits
                data = data.view(np.float16)
            return data.astype(_DTYPES[kind]).reshape(shape)
        immediate = value.immediateValue.tensor
        field = immediate.WhichOneof("value")
        if field == "strings":
            return np.array(immediate.strings.values[0] if not shape else list(immediate.strings.values))
        raw = getattr(immediate, field).values
        if field == "bytes":
            array = np.frombuffer(raw, dtype=_DTYPES[kind])
        else:
            array = np.array(list(raw), dtype=_DTYPES[kind])
        return array.reshape(shape)

    def _argument(self, name: str, binding, values: dict):
        arrays = [values[a.name] if a.name else self._value(a.value) for a in binding.arguments]
        return arrays if len(arrays) > 1 or name in VARIADIC else arrays[0]

    def run(self, feeds: dict[str, np.ndarray], states: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values: dict[str, np.ndarray] = {name: np.asarray(feeds[name]) for name in self.input_names}
        values.update(states)
        for index, op in enumerate(self.operations):
            for name in self._last_reads.get(index - 1, ()):  # a 4B part's weights would otherwise all stay held
                values.pop(name, None)
            if op.type == "const":  # weights are read from the file at each use, small constants kept
                name, value = op.outputs[0].name, op.attributes["val"]
                if name in self._constants:
                    values[name] = self._constants[name]
                elif value.WhichOneof("value") == "blobFileValue":
                    values[name] = self._value(value)
                else:
                    values[name] = self._constants[name] = self._value(value)
                continue
            args = {k: self._argument(k, v, values) for k, v in op.inputs.items()}
            args.update({k: self._value(v) for k, v in op.attributes.items() if k != "name"})
            if op.type == "read_state":
                result = states[op.inputs["input"].arguments[0].name]
            elif op.type == "write_state":
                name = op.inputs["input"].arguments[0].name
                states[name] = args["data"].astype(states[name].dtype)
                continue
            else:
                try:
                    result = OPS[op.type](args)
                except Exception as exc:  # numpy raises many types; name the op
                    raise DFlashError(f"MIL op {op.type} ({op.outputs[0].name}) failed in numpy: {exc}") from exc
            for output, value in zip(op.outputs, result if isinstance(result, tuple) else (result,)):
                declared = self._names(output.type.tensorType.dataType)
                values[output.name] = np.asarray(value).astype(_DTYPES.get(declared, np.float32))
        return {name: values[name] for name in self.outputs}
