"""MLX backend: the exported ONNX graphs, executed in MLX (Apple silicon; `mlx[cpu]` on Linux).

`lower_mlx` keeps each graph's structure (the ONNX file without its weights: the graph stays the source
of truth) and writes its weights as MLX safetensors, optionally with MatMul weights quantized by
`mx.quantize` (4 or 8 bits, per-group scales and biases) for `mx.quantized_matmul`. The draft's
embedding and lm_head are not written twice: the manifest maps them to the target's tensors and the
two sessions share one loaded copy.

`MlxSession` runs a graph node by node with targets/mlx_ops.py; MLX is lazy, so a call builds the
computation of the requested outputs and evaluates it once. K/V outputs are returned as mx.arrays and
fed back as such: the cache never leaves MLX, and rollback is the loop's slice of the committed prefix.
Argmax runs inside the graph, so greedy decoding copies only ids and features to the host.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import Manifest, load_export

BITS = (4, 8)
SHARED = "shared_with_target"


def _import_mlx():
    try:
        import mlx.core as mx
    except ImportError as exc:
        raise DFlashError("the mlx backend needs MLX: pip install mlx (macOS, Apple silicon) or "
                          f"pip install 'mlx[cpu]' (Linux) ({exc})") from None
    return mx


def weight_uses(graph: onnx.GraphProto) -> dict[str, set[str]]:
    """How each initializer is read: "direct" (x @ W), "transposed" (x @ Transpose(W)), "float" (anything else)."""
    initializers = {t.name for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def transposes_into_matmuls(node: onnx.NodeProto) -> bool:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        return node.op_type == "Transpose" and perm == [1, 0] and all(
            c.op_type == "MatMul" and c.input[1] == node.output[0] for c in consumers.get(node.output[0], []))

    uses: dict[str, set[str]] = {}
    for name in initializers:
        for node in consumers.get(name, []):
            if node.op_type == "MatMul" and node.input[1] == name:
                kind = "direct"
            elif transposes_into_matmuls(node):
                kind = "transposed"
            else:
                kind = "float"
            uses.setdefault(name, set()).add(kind)
    return uses


def _quantizable(array: np.ndarray, group_size: int) -> bool:
    return array.ndim == 2 and array.dtype.kind == "f" and min(array.shape) >= group_size and \
        all(d % group_size == 0 for d in array.shape)


def _convert_weights(model: onnx.ModelProto, bits: int | None, group_size: int,
                     skip: set[str]) -> tuple[dict, dict]:
    """MLX arrays per initializer: the float tensor where something reads it as such, and for MatMul weights
    (with `bits`) `NAME.q.*` (quantized for x @ W) and/or `NAME.qt.*` (for x @ W^T)."""
    mx = _import_mlx()
    uses = weight_uses(model.graph)
    arrays, report = {}, {"quantized": 0, "kept_float": []}
    for tensor in model.graph.initializer:
        if tensor.name in skip or tensor.name not in uses:
            continue
        value = numpy_helper.to_array(tensor)
        kinds = uses[tensor.name]
        if bits and kinds & {"direct", "transposed"}:
            if _quantizable(value, group_size):
                for kind, suffix, rows in (("direct", "q", value.T), ("transposed", "qt", value)):
                    if kind in kinds:  # mx.quantize takes the [N, K] layout quantized_matmul(transpose=True) reads
                        w, scales, biases = mx.quantize(mx.array(np.ascontiguousarray(rows)), group_size=group_size,
                                                        bits=bits)
                        arrays.update({f"{tensor.name}.{suffix}.w": w, f"{tensor.name}.{suffix}.scales": scales,
                                       f"{tensor.name}.{suffix}.biases": biases})
                report["quantized"] += 1
                if "float" not in kinds:
                    continue
            else:
                report["kept_float"].append(tensor.name)
        arrays[tensor.name] = mx.array(value)
    return arrays, report


def _shared_with_target(draft: onnx.ModelProto, target: onnx.ModelProto) -> dict[str, str]:
    """Draft initializers stored in the target's data file at the bytes of a target initializer that the
    target reads the same ways (so every stored variant the draft needs exists once, in the target's file)."""
    def location(tensor):
        info = {e.key: e.value for e in tensor.external_data}
        return info.get("location"), info.get("offset", "0"), info.get("length")

    target_at = {location(t): t.name for t in target.graph.initializer if t.external_data}
    target_uses, draft_uses = weight_uses(target.graph), weight_uses(draft.graph)
    return {t.name: target_at[location(t)] for t in draft.graph.initializer
            if t.external_data and location(t) in target_at
            and draft_uses.get(t.name, set()) <= target_uses.get(target_at[location(t)], set())}


def _strip_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    structure = onnx.ModelProto()
    structure.CopyFrom(model)
    del structure.graph.initializer[:]
    return structure


def lower_mlx(source: Path, out: Path, bits: int | None = None, group_size: int = 64, overwrite: bool = False,
              progress: bool = True) -> Manifest:
    """Write MLX_DIR: graph structures, MLX safetensors weights (optionally quantized), manifest."""
    from dflash_onnx.export import check_out_dir, copy_tokenizer_files, staged_directory

    mx = _import_mlx()
    manifest = load_export(source, "lower")
    if bits is not None and bits not in BITS:
        raise DFlashError(f"--bits {bits}: MLX quantizes to {' or '.join(map(str, BITS))} bits")
    if group_size not in (32, 64, 128):
        raise DFlashError(f"--group-size {group_size}: MLX supports 32, 64 or 128")
    out = Path(out)
    check_out_dir(out, (Path(source),), overwrite)
    with staged_directory(out) as tmp:
        structures = {g: onnx.load(str(Path(source) / getattr(manifest, g).file), load_external_data=False)
                      for g in ("target", "draft")}
        unsupported = _unsupported_ops(structures)
        if unsupported:
            raise DFlashError(f"{source} uses ops the MLX backend does not run: {', '.join(unsupported)} "
                              "(lower an fp32/fp16 export, optionally after cleanup or rope-fusion; "
                              "quantize with --bits)")
        shared = _shared_with_target(structures["draft"], structures["target"])
        report = {}
        for graph in ("target", "draft"):
            if progress:
                print(f"lowering {graph} to MLX{f' ({bits}-bit)' if bits else ''}", file=sys.stderr)
            model = onnx.load(str(Path(source) / getattr(manifest, graph).file))
            skip = set(shared) if graph == "draft" else set()
            arrays, report[graph] = _convert_weights(model, bits, group_size, skip)
            mx.save_safetensors(str(tmp / f"{graph}.safetensors"), arrays)
            onnx.save_model(_strip_weights(model), str(tmp / getattr(manifest, graph).file))
            del arrays, model
        copy_tokenizer_files(source, tmp)
        lowered = replace(manifest, lowering={"target": "mlx", "bits": bits, "group_size": group_size,
                                              SHARED: shared, "weights": report})
        lowered.save(tmp)
    return lowered


def _unsupported_ops(structures: dict[str, onnx.ModelProto]) -> list[str]:
    from .mlx_ops import OPS

    return sorted({f"{n.domain + '.' if n.domain else ''}{n.op_type}" for m in structures.values()
                   for n in m.graph.node if (n.domain if n.domain != "ai.onnx" else "", n.op_type) not in OPS})


_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class _Weights(dict):
    """Loaded safetensors; a dict subclass so one load can be shared through a weak cache."""


def _load(path: Path) -> _Weights:
    mx = _import_mlx()
    key = str(path.resolve())
    weights = _LOADED.get(key)
    if weights is None:
        weights = _Weights(mx.load(key))
        _LOADED[key] = weights
    return weights


def _attributes(node: onnx.NodeProto) -> dict:
    attrs = {}
    for attribute in node.attribute:
        value = onnx.helper.get_attribute_value(attribute)
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif attribute.name in ("value_int", "value_ints", "value_float", "value_floats"):
            value = np.array(value, dtype=np.int64 if "int" in attribute.name else np.float32)
        attrs["value" if attribute.name.startswith("value") else attribute.name] = value
    return attrs


class MlxSession:
    """One lowered graph run in MLX; the Session protocol with K/V kept as mx.arrays."""

    def __init__(self, directory: Path, manifest: Manifest, graph: str):
        mx = _import_mlx()
        from .mlx_ops import OPS, QuantizedWeight

        directory = Path(directory)
        spec = getattr(manifest, graph)
        model = onnx.load(str(directory / spec.file), load_external_data=False)
        own = _load(directory / f"{graph}.safetensors")
        target = _load(directory / "target.safetensors") if graph == "draft" else own
        shared = manifest.lowering.get(SHARED, {}) if graph == "draft" else {}
        bits, group_size = manifest.lowering.get("bits"), manifest.lowering.get("group_size", 64)

        def stored(name: str, suffix: str = ""):
            source, key = (target, shared[name]) if name in shared else (own, name)
            return source.get(key + suffix)

        def quantized(name: str, suffix: str):
            if stored(name, f".{suffix}.w") is None:
                return None
            return QuantizedWeight(stored(name, f".{suffix}.w"), stored(name, f".{suffix}.scales"),
                                   stored(name, f".{suffix}.biases"), group_size, bits)

        self.values: dict[str, object] = {}
        nodes = []
        for node in model.graph.node:
            inputs = list(node.input)
            if node.op_type == "MatMul" and quantized(inputs[1], "q") is not None:
                inputs[1] = f"{inputs[1]}@q"  # x @ W with W quantized
                self.values[inputs[1]] = quantized(node.input[1], "q")
            if node.op_type == "Transpose" and quantized(inputs[0], "qt") is not None:
                self.values[node.output[0]] = quantized(inputs[0], "qt")  # read as x @ W^T: already that form
                continue
            nodes.append((node, inputs))
        for node, inputs in nodes:
            for name in inputs:
                if name and name not in self.values and stored(name) is not None:
                    array = stored(name)
                    self.values[name] = np.array(array) if array.size <= 64 else array  # small constants: host
        self.nodes = [(OPS[(n.domain if n.domain != "ai.onnx" else "", n.op_type)], inputs, list(n.output),
                       _attributes(n), f"{n.op_type} {n.name}") for n, inputs in nodes]
        self.input_names = [i.name for i in model.graph.input if i.name not in self.values]
        self.output_names = [o.name for o in model.graph.output]
        self.kv_outputs = set(spec.kv_outputs)
        self._mx = mx
        self._plans: dict[tuple[str, ...], list] = {}
        self._weights = (own, target)  # keep the shared loads alive while this session lives

    def _plan(self, wanted: tuple[str, ...]) -> list:
        """The nodes the wanted outputs depend on, in graph order."""
        if wanted not in self._plans:
            needed, plan = set(wanted), []
            for node in reversed(self.nodes):
                if needed.intersection(node[2]):
                    plan.append(node)
                    needed.update(i for i in node[1] if i)
            self._plans[wanted] = plan[::-1]
        return self._plans[wanted]

    def run(self, feeds: dict, output_names: list[str] | None = None) -> dict:
        names = tuple(output_names or self.output_names)
        missing = sorted(set(self.input_names) - feeds.keys())
        if missing:
            raise DFlashError(f"mlx session: missing inputs {missing}")
        values = dict(self.values)
        values.update(feeds)
        for run, inputs, outputs, attrs, label in self._plan(names):
            try:
                results = run([values[i] if i else None for i in inputs], attrs)
            except Exception as exc:  # numpy and MLX raise many types; name the node
                raise DFlashError(f"mlx session: {label} failed: {exc}") from exc
            values.update(zip(outputs, results))
        device = [values[n] for n in names if isinstance(values[n], self._mx.array)]
        self._mx.eval(*device)
        return {n: values[n] if n in self.kv_outputs or not isinstance(values[n], self._mx.array)
                else np.array(values[n]) for n in names}
