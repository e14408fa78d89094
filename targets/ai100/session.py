"""The Cloud AI 100 Session: a compiled QPC run through qaicrt, retained state left on the device.
numpy and the SDK's runtime only."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import GraphSpec, Manifest
from dflash_onnx.targets.ai100.options import Ai100Options
from dflash_onnx.targets.ai100.sdk import import_runtime
from dflash_onnx.targets.backend import recorded_options

# QAicApi_pb2 binding types -> numpy, as QEfficient's session maps them (bfloat16 bindings carry float16
# data); MXINT8 K/V are retained-state buffers, which never reach the host.
BINDING_TYPES = {"FLOAT_TYPE": np.float32, "FLOAT_16_TYPE": np.float16, "BFLOAT16_TYPE": np.float16,
                 "INT8_Q_TYPE": np.int8, "UINT8_Q_TYPE": np.uint8, "INT16_Q_TYPE": np.int16,
                 "INT32_Q_TYPE": np.int32, "INT32_I_TYPE": np.int32, "INT64_I_TYPE": np.int64, "INT8_TYPE": np.int8}


def binding_dtypes(aicapi) -> dict[int, np.dtype]:
    return {getattr(aicapi, name): np.dtype(numpy) for name, numpy in BINDING_TYPES.items() if hasattr(aicapi, name)}


def _retained(name: str) -> bool:
    return name.startswith("past_")


class Ai100Session:
    """A compiled QPC on Cloud AI 100 through qaicrt; retained-state buffers never leave the device.

    The first call writes zeros into every retained-state buffer (a fresh program's memory is not cleared, and
    attention weighs masked slots by 0, which 0 x NaN defeats); later calls skip them. Output buffers are sized
    per call from the ONNX graph's output dims (the input shapes pick the specialization); an output not asked
    for is skipped only where the binding allows partial buffers, and fetched otherwise.
    """

    retains_state = True

    def __init__(self, qpc_dir: Path, graph: GraphSpec, device_ids: list[int]):
        qaicrt, aicapi = import_runtime()
        qpc_path = Path(qpc_dir)
        if not qpc_path.is_dir():
            raise DFlashError(f"{qpc_path} does not exist: compile first (AI100_DIR/compile.sh)")
        self.input_dims = {t.name: t.shape for t in graph.inputs}
        self.output_dims = {t.name: t.shape for t in graph.outputs}
        self._qaicrt = qaicrt
        self.context = qaicrt.Context(qaicrt.QIDList(device_ids))
        self.queue = qaicrt.Queue(self.context, device_ids[0])
        qpc = qaicrt.Qpc(str(qpc_path))
        status, raw = qpc.getIoDescriptor()
        if status != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError(f"cannot read the IO descriptor of {qpc_path}")
        descriptor = aicapi.IoDesc()
        descriptor.ParseFromString(bytes(raw))
        self.bindings = list(descriptor.selected_set.bindings)
        self.allowed_shapes = [[list(s.dims) for s in allowed.shapes] for allowed in descriptor.allowed_shapes]
        self.index = {b.name: b.index for b in self.bindings}
        types = binding_dtypes(aicapi)
        unknown = sorted({b.name for b in self.bindings if b.type not in types and not _retained(b.name)})
        if unknown:
            raise DFlashError(f"{qpc_path}: bindings {unknown} have types this runtime does not map to numpy")
        self.dtypes = {b.name: np.dtype(types.get(b.type, np.float16)) for b in self.bindings}
        self.input_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_INPUT]
        self.output_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_OUTPUT]
        self.partial_allowed = {b.name: bool(getattr(b, "is_partial_buf_allowed", False)) for b in self.bindings}
        properties = qaicrt.QAicProgramProperties()
        if len(device_ids) > 1:  # a tensor-sliced program: logical devices 0..n-1 of its partition config
            properties.devMapping = ":".join(map(str, device_ids))
        self.program = qaicrt.Program(self.context, device_ids[0] if len(device_ids) == 1 else None, qpc, properties)
        if self.program.load() != qaicrt.QStatus.QS_SUCCESS or self.program.activate() != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError(f"cannot load {qpc_path} on AI 100 device(s) {device_ids}: another program may hold "
                              "their cores (qaic-util -q shows them)")
        self.exec_obj = qaicrt.ExecObj(self.context, self.program)
        self.buffers = [qaicrt.QBuffer(bytes(b.size)) for b in self.bindings]
        self.dims = qaicrt.BufferDimensionsVecRef([(self.dtypes[b.name].itemsize, list(b.dims)) for b in self.bindings])
        self._fresh = True

    def _put(self, name: str, array: np.ndarray) -> None:
        index = self.index[name]
        self.buffers[index] = self._qaicrt.QBuffer(np.ascontiguousarray(array).tobytes())
        self.dims[index] = (array.itemsize, list(array.shape) if array.ndim else [1])

    def _skip(self, names: list[str]) -> None:
        for name in names:
            self._put(name, np.array([], dtype=self.dtypes[name]))

    def _state_buffers(self) -> None:
        """Zeros into the retained state on the first call (outputs skipped), nothing after."""
        state = [b for b in self.bindings if _retained(b.name)]
        for binding in state:
            if self._fresh and binding.name in self.input_names:
                self._put(binding.name, np.zeros(list(binding.dims), self.dtypes[binding.name]))
            else:
                self._skip([binding.name])

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        qaicrt = self._qaicrt
        visible = [n for n in self.output_names if not _retained(n)]
        wanted = output_names or visible
        symbols: dict[str, int] = {}
        for name, array in feeds.items():
            if _retained(name):
                continue
            self._put(name, array.astype(self.dtypes[name], copy=False))
            symbols.update({d: n for d, n in zip(self.input_dims[name], array.shape) if isinstance(d, str)})
        self._state_buffers()
        fetched = [n for n in visible if n in wanted or not self.partial_allowed[n]]
        for name in visible:
            if name in fetched:
                shape = [symbols[d] if isinstance(d, str) else d for d in self.output_dims[name]]
                self._put(name, np.zeros(shape, dtype=self.dtypes[name]))
            else:
                self._skip([name])
        if self.exec_obj.setData(self.buffers, self.dims) != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError("AI 100: setData failed")
        if self.queue.enqueue(self.exec_obj) != qaicrt.QStatus.QS_SUCCESS or \
                self.exec_obj.waitForCompletion() != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError(self._failure())
        self._fresh = False
        status, outputs = self.exec_obj.getData()
        if status != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError("AI 100: getData failed")
        result = {}
        for name in wanted:
            index = self.index[name]
            result[name] = np.frombuffer(bytes(outputs[index]), self.dtypes[name]).reshape(self.dims[index][1])
        return result

    def _failure(self) -> str:
        passed = {b.name: self.dims[b.index][1] for b in self.bindings if self.dims[b.index][1] not in ([0], [])}
        inputs = {n: passed[n] for n in self.input_names if n in passed and not _retained(n)}
        compiled = sorted({tuple(tuple(shape) for b, shape in zip(self.bindings, allowed) if b.name in inputs)
                           for allowed in self.allowed_shapes})
        return (f"AI 100: the run failed; inputs {inputs} must match a compiled specialization "
                f"({len(compiled)} compiled: {[dict(zip(inputs, c)) for c in compiled][:4]})")


def open_session(directory: Path, manifest: Manifest, graph: str, target_devices: list[int] | None = None,
                 draft_devices: list[int] | None = None) -> Ai100Session:
    """The QPC compiled for `graph` ("target" or "draft") of an AI 100 lowering, on the devices the lowering placed
    it on unless others are given."""
    options = recorded_options(Ai100Options, manifest)
    placed = options.target_device_ids if graph == "target" else options.draft_device_ids
    chosen = (target_devices if graph == "target" else draft_devices) or placed
    if len(chosen) != len(placed):
        raise DFlashError(f"the {graph} was compiled for {len(placed)} device(s) {placed}, not {len(chosen)}")
    return Ai100Session(Path(directory) / "qpc" / graph, getattr(manifest, graph), list(chosen))
