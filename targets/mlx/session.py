"""The MLX Session: a lowered ONNX graph executed node by node in MLX (ops.py).

MLX is lazy, so a call builds the computation of the requested outputs and evaluates it once. Argmax runs
inside the graph, so greedy decoding copies only ids and features to the host. The draft's embedding and
lm_head are the target's tensors, loaded once for both sessions. numpy, onnx (the graph structure) and mlx only.

K/V: in the fused buffer form (the default lowering) the session keeps them. The target's
[1, kv_heads, rows, head_dim] buffers are written in place by its GroupQueryAttention nodes at the call's
positions (rollback is the runner's shorter length on the next call); the draft's graph returns its new
context rows, which the session writes into [1, rows, kv_heads, head_dim] buffers at the call's first
position and feeds back as a view of the filled prefix. Both grow with the context (targets/kv_rows.py).
In the concat form (`--kv-buffer off`, and lowerings made before it) K/V come back as mx.arrays that the
runners feed in again.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.backend import recorded_options
from dflash_onnx.targets.kv_rows import rows_to_hold
from dflash_onnx.targets.mlx.options import MlxOptions


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


def _grown(mx, array, rows: int, axis: int):
    """`array` extended with zero rows along `axis` to `rows` rows (evaluated, so the old buffer is freed)."""
    extra = list(array.shape)
    extra[axis] = rows - array.shape[axis]
    grown = mx.concatenate([array, mx.zeros(extra, array.dtype)], axis=axis)
    mx.eval(grown)
    return grown


class _TargetBuffers:
    """The buffer-form target's K/V: one [1, kv_heads, rows, head_dim] buffer per K/V input, which the graph's
    GroupQueryAttention writes in place and returns as the paired output; the rows grow with the context
    (targets/kv_rows.py) up to ctx_len."""

    def __init__(self, mx, spec, ctx_len: int, dtype):
        self.mx, self.pairs, self.ctx_len = mx, list(zip(spec.kv_inputs, spec.kv_outputs)), ctx_len
        self.arrays = {i: mx.zeros((1, spec.num_kv_heads, 0, spec.head_dim), dtype) for i in spec.kv_inputs}

    def feeds(self, feeds: dict) -> dict:
        needed, held = int(np.asarray(feeds["total_sequence_length"])), next(iter(self.arrays.values())).shape[2]
        if needed > held:
            rows = rows_to_hold(needed, held, self.ctx_len, "mlx target")
            self.arrays = {name: _grown(self.mx, array, rows, 2) for name, array in self.arrays.items()}
        return self.arrays

    def keep(self, outputs: dict, feeds: dict) -> list:
        for name, output in self.pairs:
            self.arrays[name] = outputs[output]
        return []


class _DraftRows:
    """The buffer-form draft's context K/V: its graph reads `past` and returns the call's new rows, which are
    written here at the call's first position (the runner's committed length; context rows never roll back);
    the buffers grow as the target's do."""

    def __init__(self, mx, spec, ctx_len: int, dtype):
        self.mx, self.pairs, self.ctx_len = mx, list(zip(spec.kv_inputs, spec.kv_outputs)), ctx_len
        self.arrays = {i: mx.zeros((1, 0, spec.num_kv_heads, spec.head_dim), dtype) for i in spec.kv_inputs}

    def given(self, feeds: dict) -> bool:
        return all(name in feeds for name, _ in self.pairs)

    def _start(self, feeds: dict) -> int:
        return int(np.asarray(feeds["position_ids"]).reshape(-1)[0])

    def feeds(self, feeds: dict) -> dict:
        start = self._start(feeds)
        return {name: array[:, :start] for name, array in self.arrays.items()}

    def keep(self, outputs: dict, feeds: dict) -> list:
        start = self._start(feeds)
        for name, output in self.pairs:
            rows = outputs[output]
            end, held = start + rows.shape[1], self.arrays[name].shape[1]
            if end > held:
                self.arrays[name] = _grown(self.mx, self.arrays[name], rows_to_hold(end, held, self.ctx_len,
                                                                                     "the draft"), 1)
            self.arrays[name][:, start:end] = rows
        return list(self.arrays.values())


ROPE_TABLES = {"GroupQueryAttention": (7, 8), "RotaryEmbedding": (1, 2)}  # cos, sin inputs (contrib: 2, 3)


def _rope_tables(node: onnx.NodeProto) -> tuple[int, int] | None:
    if node.op_type == "RotaryEmbedding" and node.domain == "com.microsoft":
        return 2, 3
    if node.op_type == "GroupQueryAttention" and not any(a.name == "do_rotary" and a.i for a in node.attribute):
        return None
    return ROPE_TABLES.get(node.op_type)


def _split_attention(keys: list[tuple[str, str]], nodes: list, dtype) -> tuple[list, list]:
    """Each GroupQueryAttention whose rotation runs as mx.fast.rope split in three (ops.py): the rotation (with the
    head reshapes and casts) joins the compiled run before it, reading the call's length as a device scalar (made
    once, right where the length is known, so that it breaks no run); the buffer writes and the attention stay
    eager; the output's reshape joins the compiled run after it. The rest of the plan is unchanged."""
    from dflash_onnx.targets.mlx.ops import OPS, SPLIT_DOMAIN

    def splittable(key, attrs, inputs) -> bool:
        return key == ("com.microsoft", "GroupQueryAttention") and bool(attrs.get("do_rotary")) and \
            "rope" in attrs and bool(inputs[1]) and attrs.get("local_window_size", -1) == -1 and \
            not attrs.get("softcap") and not attrs.get("rotary_interleaved")

    lengths = {node[1][6] for key, node in zip(keys, nodes) if splittable(key, node[3], node[1])}
    to_device = (SPLIT_DOMAIN, "ToDevice")
    rotation, attend, seq_first = ((SPLIT_DOMAIN, op) for op in ("RotaryHeads", "AttendRotated", "SeqFirst"))
    split = [(to_device, (OPS[to_device], [name], [f"{name}@device"], {}, f"ToDevice {name}"))
             for name in sorted(lengths) if not any(name in node[2] for node in nodes)]  # fed: first
    for key, (op, inputs, outputs, attrs, label) in zip(keys, nodes):
        if splittable(key, attrs, inputs):
            heads = [f"{label}@{part}" for part in ("q", "k", "v", "out")]
            split += [(rotation, (OPS[rotation], [*inputs[:3], f"{inputs[6]}@device"], heads[:3],
                                  {**attrs, "buffer_dtype": dtype}, f"{label} (rotation)")),
                      (attend, (OPS[attend], [*heads[:3], *inputs[3:7]], [heads[3], *outputs[1:]], attrs, label)),
                      (seq_first, (OPS[seq_first], heads[3:], outputs[:1], {}, f"{label} (output)"))]
        else:
            split.append((key, (op, inputs, outputs, attrs, label)))
            split += [(to_device, (OPS[to_device], [name], [f"{name}@device"], {}, f"ToDevice {name}"))
                      for name in outputs if name in lengths]  # computed: right after
    return [key for key, _ in split], [node for _, node in split]


class MlxSession:
    """One lowered graph run in MLX (the Session protocol)."""

    def __init__(self, directory: Path, manifest: Manifest, graph: str):
        mx = import_mlx()
        from dflash_onnx.targets.mlx.ops import OPS, QuantizedWeight, as_numpy, rope_base, rope_frequencies
        from dflash_onnx.targets.mlx.segments import shape_only

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
            transposed = node.op_type == "FusedMatMul" and any(a.name == "transB" and a.i for a in node.attribute)
            suffix = "qt" if transposed else "q"
            if node.op_type in ("MatMul", "FusedMatMul") and quantized(inputs[1], suffix) is not None:
                inputs[1] = f"{inputs[1]}@{suffix}"  # x @ W or x @ W^T with W quantized
                self.values[inputs[1]] = quantized(node.input[1], suffix)
            if node.op_type == "Gather" and stored(inputs[0]) is None and quantized(inputs[0], "qt") is not None:
                inputs[0] = f"{inputs[0]}@qt"  # an embedding stored quantized only: rows dequantized on lookup
                self.values[inputs[0]] = quantized(node.input[0], "qt")
            if node.op_type == "Transpose" and quantized(inputs[0], "qt") is not None:
                self.values[node.output[0]] = quantized(inputs[0], "qt")  # read as x @ W^T: already that form
                continue
            nodes.append((node, inputs))
        for _, inputs in nodes:
            for name in inputs:
                if name and name not in self.values and stored(name) is not None:
                    array = stored(name)
                    self.values[name] = as_numpy(array) if array.size <= 64 else array  # small constants: host
        frequencies: dict[tuple[str, str], object] = {}

        def attributes(node: onnx.NodeProto, inputs: list[str]) -> dict:
            attrs, tables = _attributes(node), _rope_tables(node)
            if tables and max(tables) < len(inputs) and all(stored(inputs[i]) is not None for i in tables):
                key = (inputs[tables[0]], inputs[tables[1]])
                if key not in frequencies:
                    found = rope_frequencies(*(as_numpy(stored(name)) for name in key))
                    frequencies[key] = None if found is None else (rope_base(found), mx.array(found))
                if frequencies[key] is not None:
                    attrs["rope"] = frequencies[key]
            return attrs

        dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get(manifest.dtype, mx.float32)
        keys = [(n.domain if n.domain != "ai.onnx" else "", n.op_type) for n, _ in nodes]
        self._keys, self.nodes = _split_attention(
            keys, [(OPS[key], inputs, list(n.output), attributes(n, inputs), f"{n.op_type} {n.name}")
                   for key, (n, inputs) in zip(keys, nodes)], dtype)
        self.output_names = [o.name for o in model.graph.output]
        self.kv_outputs = set(spec.kv_outputs)
        self.state = None
        if manifest.form == "buffer" and graph == "target":
            self.state = _TargetBuffers(mx, spec, int(manifest.ctx_len), dtype)
        elif manifest.form == "buffer" and manifest.draft_returns_rows:
            self.state = _DraftRows(mx, spec, int(manifest.ctx_len), dtype)
        # a session that keeps K/V takes no K/V inputs and returns none unless asked
        self.retains_state = self.state is not None
        kept = set(spec.kv_inputs) if self.retains_state else set()
        self.input_names = [i.name for i in model.graph.input if i.name not in self.values and i.name not in kept]
        self._kept_outputs = tuple(spec.kv_outputs) if self.retains_state else ()
        self._mx, self._as_numpy = mx, as_numpy
        self._plans: dict[tuple[str, ...], list] = {}
        # the buffer form's runs between attentions are compiled (segments.py); its host values depend on shapes
        self._compiled = manifest.form == "buffer"
        self._static = shape_only(self.nodes, self._keys, {n for n, v in self.values.items()
                                                           if isinstance(v, np.ndarray)})
        self._weights = (own, target)  # keep the shared loads alive while this session lives
        # mx.load is lazy: a compiled trace capturing a weight not yet loaded would load its own copy of it, one per
        # call shape (docs/mlx.md#compiled-runs-between-attentions); load what this graph reads once
        mx.eval(*[a for v in self.values.values() for a in
                  ((v.weight, v.scales, v.biases) if isinstance(v, QuantizedWeight) else (v,))
                  if isinstance(a, mx.array)])

    def _plan(self, wanted: tuple[str, ...]) -> list:
        """The nodes the wanted outputs depend on, in graph order (runs of them compiled in the buffer form)."""
        if wanted not in self._plans:
            needed, chosen = set(wanted), []
            for index in reversed(range(len(self.nodes))):
                node = self.nodes[index]
                if needed.intersection(node[2]):
                    chosen.append(index)
                    needed.update(i for i in node[1] if i)
            chosen.reverse()
            plan = [self.nodes[i] for i in chosen]
            if self._compiled:
                from dflash_onnx.targets.mlx.segments import segmented

                plan = segmented(plan, [self._keys[i] for i in chosen], self.values, self._static, wanted)
            self._plans[wanted] = plan
        return self._plans[wanted]

    def run(self, feeds: dict, output_names: list[str] | None = None) -> dict:
        names = tuple(output_names or self.output_names)
        missing = sorted(set(self.input_names) - feeds.keys())
        if missing:
            raise DFlashError(f"mlx session: missing inputs {missing}")
        values = dict(self.values)
        values.update(feeds)
        values[""] = None  # an omitted optional input
        # a draft call that feeds its own past (a single timed or checked call) runs as a plain call
        state = None if isinstance(self.state, _DraftRows) and self.state.given(feeds) else self.state
        if state is not None:
            values.update(state.feeds(feeds))
        get = values.__getitem__
        for run, inputs, outputs, attrs, label in self._plan(names + self._kept_outputs):
            try:
                results = run([get(i) for i in inputs], attrs)
            except Exception as exc:  # numpy and MLX raise many types; name the node
                raise DFlashError(f"mlx session: {label} failed: {exc}") from exc
            values.update(zip(outputs, results))
        results = {n: values[n] for n in names}
        device = [v for v in results.values() if isinstance(v, self._mx.array)]
        kept = [values[n] for n in self._kept_outputs]
        del values
        self._mx.eval(*device, *kept)
        if state is not None:  # after the call: the draft's past views are gone, so its row writes update the
            self._mx.eval(*state.keep(dict(zip(self._kept_outputs, kept)), feeds))  # buffers in place
        return {n: v if n in self.kv_outputs or not isinstance(v, self._mx.array) else self._as_numpy(v)
                for n, v in results.items()}


def open_session(directory: Path, manifest: Manifest, graph: str) -> MlxSession:
    return MlxSession(directory, manifest, graph)
