"""ONNX Runtime sessions: the plain one every export and AI 100 graph runs on, and the buffer-form target
whose K/V buffers ORT updates in place (IOBinding). numpy and onnxruntime only."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from dflash_onnx.artifacts.graph_files import checked_graph
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.runtime.recurrent import output_names as recurrent_outputs
from dflash_onnx.targets.backend import recorded_options
from dflash_onnx.targets.kv_rows import STEP_ROWS, rows_in_steps, rows_to_hold
from dflash_onnx.targets.ort.options import LEVELS, PROVIDERS, OrtOptions
from dflash_onnx.targets.ort.spinning import session_settings

# providers whose sessions keep K/V buffers in device memory (OrtValues bound by IOBinding)
DEVICES = {"CUDAExecutionProvider": "cuda"}
INSTALL_HINTS = {"cuda": "pip install onnxruntime-gpu", "tensorrt": "pip install onnxruntime-gpu (and TensorRT)",
                 "dml": "pip install onnxruntime-directml", "openvino": "pip install onnxruntime-openvino",
                 "qnn": "pip install onnxruntime-qnn"}


def bfloat16_refusal(directory: Path) -> str:
    """Why ONNX Runtime does not run a bfloat16 export here, and what to do instead."""
    return (f"ONNX Runtime does not run the bfloat16 export {directory}: its CPU provider has no bfloat16 kernels "
            "(MatMul, Add, Mul ...) and its Python API returns no bfloat16 outputs (no numpy type); widen it with "
            f"'dflash-onnx optimize {directory} --passes fp32 --out DEST' (exact; --passes fp32,int4 to quantize "
            "too), lower it with --target mlx, or export --dtype float16 for CUDA")


def _has_bfloat16_io(graph: onnx.ModelProto) -> bool:
    return any(v.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
               for v in (*graph.graph.input, *graph.graph.output))


def ort_level(name: str) -> ort.GraphOptimizationLevel:
    levels = dict(zip(LEVELS, (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                               ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                               ort.GraphOptimizationLevel.ORT_ENABLE_ALL)))
    if name not in levels:
        raise DFlashError(f"optimization level {name!r}: choose one of {', '.join(LEVELS)}")
    return levels[name]


def provider_name(provider: str) -> str:
    """ORT's name for a provider, checked against this onnxruntime build."""
    if provider not in PROVIDERS:
        raise DFlashError(f"--provider {provider}: choose one of {', '.join(PROVIDERS)}")
    name = PROVIDERS[provider]
    if name not in ort.get_available_providers():
        hint = INSTALL_HINTS.get(provider, "use an onnxruntime build that has it")
        raise DFlashError(f"this onnxruntime ({ort.__version__}) has no {name} (available: "
                          f"{', '.join(ort.get_available_providers())}): {hint}")
    if provider == "cuda" and hasattr(ort, "preload_dlls"):
        with contextlib.suppress(OSError):  # a missing library is named by ORT when the provider loads
            ort.preload_dlls()  # CUDA and cuDNN from the nvidia-* wheels, where installed (onnxruntime-gpu[cuda,cudnn])
    return name


class OrtSession:
    """Runs one ONNX graph on ONNX Runtime (CPU unless other providers are named)."""

    retains_state = False

    def __init__(self, path: Path, providers: list[str] | None = None, intra_op_threads: int | None = None,
                 allow_spinning: bool = True, optimization_level: str = "all", stop_spinning_after_run: bool = False,
                 session_config: dict[str, str] | None = None, structure: onnx.ModelProto | None = None,
                 initializers: dict[str, np.ndarray] | None = None):
        """`structure`: run this graph instead of the file's (its weights still read from beside `path`), e.g. the
        file's graph with its quantized matmuls computing in float (targets/ort/check.py). `initializers`: values
        that replace the graph's initializers of those names (e.g. weights rounded as a quantized lowering's)."""
        options = ort.SessionOptions()
        options.log_severity_level = 4  # failures reach the user as one DFlashError line, not ORT's log
        options.graph_optimization_level = ort_level(optimization_level)
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        if not allow_spinning:  # idle pool threads stop spinning: the other session of the pair gets the cores
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if stop_spinning_after_run:  # spin within a call, not after it: the next call is the other session's
            options.add_session_config_entry("session.force_spinning_stop", "1")
        for key, value in (session_config or {}).items():  # e.g. session.dynamic_block_base
            options.add_session_config_entry(key, value)
        graph = checked_graph(Path(path))  # before ORT opens the weights it names
        if _has_bfloat16_io(structure or graph):
            raise DFlashError(bfloat16_refusal(Path(path).parent))
        self._replaced = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in (initializers or {}).items()}
        for name, value in self._replaced.items():  # ORT reads them from these buffers: kept with the session
            options.add_initializer(name, value)
        if structure is not None:  # the weights its external data names are read from the file's directory
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(Path(path).parent))
        try:
            self._session = ort.InferenceSession(
                str(path) if structure is None else structure.SerializeToString(), sess_options=options,
                providers=providers or ["CPUExecutionProvider"]
            )
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
            raise DFlashError(f"ONNX Runtime cannot load {path}: {str(exc).splitlines()[0]}") from None
        self.path = Path(path)
        self.device = DEVICES.get(self._session.get_providers()[0], "cpu")  # where its K/V buffers live
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        names = output_names or self.output_names
        missing = sorted(set(self.input_names) - feeds.keys())
        if missing:
            raise DFlashError(f"{self.path.name}: missing inputs {missing}")
        return run_plain(self._session, self.path.name, feeds, names)


def run_plain(session: ort.InferenceSession, label: str, feeds: dict[str, np.ndarray],
              names: list[str]) -> dict[str, np.ndarray]:
    """Run `session` on host feeds; ORT's failure said in one line naming the graph."""
    try:
        values = session.run(names, feeds)
    except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
        raise DFlashError(f"{label} failed on ONNX Runtime: {str(exc).splitlines()[0]}") from None
    return dict(zip(names, values))


def run_bound(session: ort.InferenceSession, binding: ort.IOBinding, label: str) -> None:
    """Run `session` on its bound inputs and outputs; ORT's failure said in one line naming the graph."""
    try:
        session.run_with_iobinding(binding)
    except Exception as exc:
        raise DFlashError(f"{label} failed on ONNX Runtime: {str(exc).splitlines()[0]}") from None


def bind_host_inputs(binding: ort.IOBinding, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Bind every feed from host memory; the arrays returned are what ORT reads, and must stay alive until the
    run ends."""
    kept = {name: np.ascontiguousarray(value) for name, value in feeds.items()}
    for name, value in kept.items():
        binding.bind_cpu_input(name, value)
    return kept


def refill(kept: dict[str, tuple[np.ndarray, ort.OrtValue]], name: str,
           value: np.ndarray) -> tuple[tuple[np.ndarray, ort.OrtValue], bool]:
    """Copy `value` into the host array kept for input `name`, a new one (and its OrtValue) when the shape or dtype
    changed: a run of same-shaped steps allocates nothing. Returns the pair and whether it is new (so not bound
    yet)."""
    pair = kept.get(name)
    fresh = pair is None or pair[0].shape != value.shape or pair[0].dtype != value.dtype
    if fresh:
        array = np.empty(value.shape, value.dtype)
        pair = kept[name] = (array, ort.OrtValue.ortvalue_from_numpy(array))
    np.copyto(pair[0], value)
    return pair, fresh


def _grown(value: ort.OrtValue | None, shape: tuple[int, ...], dtype, device: str) -> ort.OrtValue:
    """A zeroed buffer of `shape` on `device` that starts with `value`'s contents, as much as fits (None: empty)."""
    array = np.zeros(shape, dtype)
    if value is not None:
        kept = value.numpy()  # a view on CPU, a host copy from a device: growing is rare (doubling)
        common = tuple(slice(0, min(n, m)) for n, m in zip(kept.shape, shape))  # a smaller buffer keeps the first
        array[common] = kept[common]
    return ort.OrtValue.ortvalue_from_numpy(array, device, 0)


class OrtBufferSession(OrtSession):
    """The buffer-form target: K/V live in buffers on the provider's device, bound (IOBinding) as both the
    input and the output of every GroupQueryAttention, so ORT updates them in place and no call copies the
    cache or moves it to the host. The graph leaves the buffers' row count open: they grow with the context
    (targets/kv_rows.py). Lowerings whose graph fixes the rows get buffers of that size up front.
    The other outputs are bound to arrays kept per row count, so a run of same-sized calls (decode steps,
    verify steps) binds nothing but its small inputs."""

    retains_state = True

    def __init__(self, path: Path, manifest: Manifest, **settings):
        super().__init__(path, **settings)
        graph = manifest.target
        # the buffers' type: the graph's K/V inputs' (int8 in a --kv-dtype int8 lowering), the manifest's otherwise
        self.capacity = int(manifest.ctx_len)
        self._dtype = graph.kv_numpy_dtype if graph.kv_dtype == "int8" else manifest.numpy_dtype
        self._graph = graph
        self._values: dict[str, ort.OrtValue] = {}
        self._rows = 0  # rows each buffer holds now
        self._pairs = list(zip(graph.kv_inputs, graph.kv_outputs))
        self._specs = {t.name: t for t in graph.outputs if t.name not in set(graph.kv_outputs)}
        # a hybrid target's linear-attention state outputs: not sized by the call's rows alone (conv rows)
        self._state = {n for layer in graph.recurrent.layers for n in recurrent_outputs(layer)} \
            if graph.recurrent else set()
        self._binding = self._session.io_binding()
        self._outputs: dict[tuple[str, int], tuple[np.ndarray, object]] = {}
        self._bound: tuple | None = None
        self._inputs: dict[str, tuple[np.ndarray, object]] = {}  # per input: the array bound last, refilled
        # ORT copies a host input to the provider's device when it is bound, not when the graph runs: off the CPU,
        # a refilled array must be bound again (found on CUDA: later calls read the first call's ids and lengths)
        self._inputs_copied_when_bound = self.device != "cpu"
        declared = next(i.shape[2] for i in self._session.get_inputs() if i.name == graph.kv_inputs[0])
        # ONNX Attention (the ragged attention) pays for every row of its buffers on each call: they follow the
        # context in steps, down as well as up (kv_rows.rows_in_steps)
        self._ragged = buffer_attention(manifest) == "ragged" and not isinstance(declared, int)
        if isinstance(declared, int):  # a graph with fixed rows takes buffers of exactly that size
            self.capacity = declared
            self._grow_to(declared)

    def _fit(self, needed: int) -> None:
        """Buffers that hold `needed` rows (the call's total length)."""
        if self._ragged:
            rows = rows_in_steps(needed, self.capacity, self.path.name)
            if rows > self._rows or self._rows - needed >= 2 * STEP_ROWS:  # one request: nothing lies past needed
                self._grow_to(rows)
        elif needed > self._rows:
            self._grow_to(rows_to_hold(needed, self._rows, self.capacity, self.path.name))

    def _grow_to(self, rows: int) -> None:
        """Replace every buffer by one of `rows` rows holding its contents, and bind it."""
        for past, _ in self._pairs:
            heads, dim = self._graph.kv_shape(past)
            self._values[past] = _grown(self._values.get(past), (1, heads, rows, dim), self._dtype, self.device)
            self._binding.bind_ortvalue_input(past, self._values[past])
        self._rows, self._bound = rows, None  # the outputs are bound to the new buffers on the next run

    def kv_buffers(self) -> dict[str, np.ndarray]:
        """A host copy of each K/V buffer, by past input name (for inspection: decoding never copies them)."""
        return {name: value.numpy().copy() for name, value in self._values.items()}  # a view dies with the session

    def _output(self, name: str, rows: int) -> tuple[np.ndarray, object]:
        """The array (and its OrtValue) that output `name` of a `rows`-token call is written into."""
        if (name, rows) not in self._outputs:
            spec = self._specs[name]
            shape = [1 if dim == "batch" else rows if isinstance(dim, str) else dim for dim in spec.shape]
            array = np.empty(shape, np.dtype(spec.dtype))
            self._outputs[(name, rows)] = (array, ort.OrtValue.ortvalue_from_numpy(array))
        return self._outputs[(name, rows)]

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        names = tuple(n for n in (output_names or self.output_names) if n in self._specs)
        if self._state.intersection(names):
            return self._run_with_state(feeds, names)
        rows, needed = int(feeds["input_ids"].shape[1]), int(feeds["total_sequence_length"])
        self._fit(needed)
        binding = self._binding
        for name, value in feeds.items():  # same shape as last call (a decode or verify step): refilled in place
            kept, fresh = refill(self._inputs, name, value)
            if fresh or self._inputs_copied_when_bound:  # bound after it is filled
                binding.bind_ortvalue_input(name, kept[1])
        if self._bound != (names, rows):  # only outputs asked for are bound: ORT keeps the rest internal
            binding.clear_binding_outputs()
            for name in names:
                binding.bind_ortvalue_output(name, self._output(name, rows)[1])
            for past, present in self._pairs:
                binding.bind_ortvalue_output(present, self._values[past])
            self._bound = (names, rows)
        run_bound(self._session, binding, self.path.name)
        return {name: self._output(name, rows)[0].copy() for name in names}

    def _run_with_state(self, feeds: dict[str, np.ndarray], names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """A call that also returns a hybrid target's linear-attention state (conv rows past + new, states,
        pending rows): K/V in place as in `run`, every input and output bound anew on the host."""
        self._fit(int(feeds["total_sequence_length"]))
        binding = self._binding
        binding.clear_binding_outputs()
        kept = bind_host_inputs(binding, feeds)  # noqa: F841 - alive until the run ends
        self._inputs.clear()
        for name in names:
            binding.bind_output(name, "cpu")
        for past, present in self._pairs:
            binding.bind_ortvalue_output(present, self._values[past])
        self._bound = None
        run_bound(self._session, binding, self.path.name)
        return {name: value.numpy() for name, value in zip(names, binding.get_outputs())}


class OrtRowsSession(OrtSession):
    """The buffer-form draft, whose graph returns only its new context rows' K/V: they are written straight
    into [batch, rows, kv_heads, head_dim] buffers on the provider's device (outputs bound by pointer just past
    the filled prefix), and the filled prefix is bound as the next call's past, so no K/V is copied or crosses
    to the host. The buffers grow as the target's do. Context rows never roll back: a call's past length is
    its first position id. A call that feeds its own past (a single timed or checked call) runs as a plain
    call."""

    retains_state = True

    def __init__(self, path: Path, manifest: Manifest, **settings):
        super().__init__(path, **settings)
        graph = manifest.draft
        self.capacity, self.dtype = int(manifest.ctx_len), manifest.numpy_dtype
        self._graph = graph
        self._rows = 0  # rows each buffer holds now
        self._buffers: list[tuple[str, str, ort.OrtValue | None]] = [
            (past, rows, None) for past, rows in zip(graph.kv_inputs, graph.kv_outputs)]
        self._kv = set(graph.kv_inputs) | set(graph.kv_outputs)
        self._binding = self._session.io_binding()

    def fork(self) -> OrtRowsSession:
        """Another request's draft on the same ONNX Runtime session: its own context buffers and binding (ORT runs
        calls on one session from several threads)."""
        twin = copy.copy(self)
        twin._rows, twin._binding = 0, self._session.io_binding()
        twin._buffers = [(past, rows, None) for past, rows, _ in self._buffers]
        return twin

    def kv_buffers(self) -> dict[str, np.ndarray]:
        """A host copy of each context-rows buffer, by past input name (for inspection)."""
        return {past: buffer.numpy().copy() for past, _, buffer in self._buffers if buffer is not None}

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        if any(past in feeds for past, _, _ in self._buffers):
            return super().run(feeds, output_names)
        names = [n for n in (output_names or self.output_names) if n not in self._kv]
        past, rows = int(feeds["position_ids"][0, 0]), int(feeds["target_hidden"].shape[1])
        if past + rows > self._rows:
            self._rows = rows_to_hold(past + rows, self._rows, self.capacity, "the draft")
            self._buffers = [(name, new, _grown(buffer, (1, self._rows, *self._graph.kv_shape(name)), self.dtype,
                                                self.device)) for name, new, buffer in self._buffers]
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        kept = bind_host_inputs(binding, feeds)  # noqa: F841 - alive until the run ends
        for past_name, rows_name, buffer in self._buffers:
            start, heads = buffer.data_ptr(), list(self._graph.kv_shape(past_name))
            row_bytes = heads[0] * heads[1] * np.dtype(self.dtype).itemsize
            binding.bind_input(past_name, self.device, 0, self.dtype, [1, past, *heads], start)
            binding.bind_output(rows_name, self.device, 0, self.dtype, [1, rows, *heads], start + past * row_bytes)
        for name in names:
            binding.bind_output(name, "cpu")
        run_bound(self._session, binding, self.path.name)
        values = binding.get_outputs()[len(self._buffers):]  # in binding order: the rows first
        return {name: value.numpy() for name, value in zip(names, values)}


def buffer_attention(manifest: Manifest) -> str:
    """The buffer form's attention (passes/kv_buffer.py): gqa, or ragged."""
    rewrites = manifest.lowering.rewrites if manifest.lowering else {}
    return rewrites.get("kv-buffer", {}).get("target", {}).get("attention", "gqa")


def open_session(directory: Path, manifest: Manifest, graph: str, **overrides) -> OrtSession:
    """A session on one graph of an export, an ORT lowering (with its recorded options) or an AI 100
    lowering's retained-state graphs (the host feeds each retained output back)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    mode = overrides.pop("spinning", None)
    settings: dict = {}
    if manifest.backend == "ort":
        options = recorded_options(OrtOptions, manifest)
        threads = options.draft_threads if graph == "draft" and options.draft_threads else options.intra_op_threads
        mode = mode or options.spinning_mode()
        settings = {"intra_op_threads": threads, "optimization_level": options.optimization_level,
                    "providers": [provider_name(manifest.lowering.provider)]}
    # the draft's calls alternate with the target's: its threads spinning on after each call take the
    # cores the target's verify needs (docs/ort.md#threads-and-spinning)
    settings.update(session_settings(mode or "on", graph))
    settings.update(overrides)
    path = Path(directory) / getattr(manifest, graph).file
    if manifest.form == "buffer" and graph == "target":
        return OrtBufferSession(path, manifest, **settings)
    if manifest.draft_returns_rows:
        return OrtRowsSession(path, manifest, **settings)
    return OrtSession(path, **settings)
