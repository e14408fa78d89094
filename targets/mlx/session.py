"""The MLX Session: an exported ONNX graph executed op by op in MLX (ops.py), K/V kept as mx.arrays.

MLX is lazy, so a call builds the computation of the requested outputs and evaluates it once. K/V outputs
are returned as mx.arrays and fed back as such: the cache never leaves MLX, and rollback is the loop's
slice of the committed prefix. Argmax runs inside the graph, so greedy decoding copies only ids and
features to the host. The draft's embedding and lm_head are the target's tensors, loaded once for both
sessions. numpy, onnx (the graph structure) and mlx only.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import Manifest

from ..backend import recorded_options
from .options import MlxOptions


def import_mlx():
    try:
        import mlx.core as mx
    except ImportError as exc:
        raise DFlashError("the mlx backend needs MLX: pip install mlx (macOS, Apple silicon) or "
                          f"pip install 'mlx[cpu]' (Linux) ({exc})") from None
    return mx


_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class _Weights(dict):
    """Loaded safetensors; a dict subclass so one load can be shared through a weak cache."""


def _load(path: Path) -> _Weights:
    mx = import_mlx()
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

    retains_state = False  # K/V come back as mx.arrays that the runners feed in again

    def __init__(self, directory: Path, manifest: Manifest, graph: str):
        mx = import_mlx()
        from .ops import OPS, QuantizedWeight

        directory = Path(directory)
        spec = getattr(manifest, graph)
        model = onnx.load(str(directory / spec.file), load_external_data=False)
        own = _load(directory / f"{graph}.safetensors")
        target = _load(directory / "target.safetensors") if graph == "draft" else own
        shared = manifest.lowering.shared_with_target if graph == "draft" else {}
        options = recorded_options(MlxOptions, manifest)
        bits, group_size = options.bits, options.group_size

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
        for _, inputs in nodes:
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


def open_session(directory: Path, manifest: Manifest, graph: str) -> MlxSession:
    return MlxSession(directory, manifest, graph)
