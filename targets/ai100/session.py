"""The Cloud AI 100 Session: a compiled QPC run through qaicrt, retained state left on the device.
numpy and the SDK's runtime only."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import GraphSpec, Manifest

from .sdk import import_runtime


class Ai100Session:
    """A compiled QPC on Cloud AI 100 through qaicrt; retained-state buffers never leave the device.

    Output buffers are sized per call from the ONNX graph's output dims (the input shapes pick the
    specialization); outputs not asked for, such as logits during greedy decoding, are skipped so they
    are never copied to the host.
    """

    retains_state = True

    def __init__(self, qpc_dir: Path, graph: GraphSpec, device_id: int = 0):
        qaicrt, aicapi = import_runtime()
        qpc_path = Path(qpc_dir)
        if not qpc_path.is_dir():
            raise DFlashError(f"{qpc_path} does not exist: compile first (AI100_DIR/compile.sh)")
        self.input_dims = {t.name: t.shape for t in graph.inputs}
        self.output_dims = {t.name: t.shape for t in graph.outputs}
        self._qaicrt = qaicrt
        self.context = qaicrt.Context()
        self.queue = qaicrt.Queue(self.context, device_id)
        qpc = qaicrt.Qpc(str(qpc_path))
        status, raw = qpc.getIoDescriptor()
        if status != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError(f"cannot read the IO descriptor of {qpc_path}")
        descriptor = aicapi.IoDesc()
        descriptor.ParseFromString(bytes(raw))
        self.bindings = list(descriptor.selected_set.bindings)
        self.index = {b.name: b.index for b in self.bindings}
        types = {aicapi.FLOAT_TYPE: np.float32, aicapi.FLOAT_16_TYPE: np.float16,
                 aicapi.INT64_I_TYPE: np.int64, aicapi.INT32_I_TYPE: np.int32}
        self.dtypes = {b.name: np.dtype(types[b.type]) for b in self.bindings}
        self.input_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_INPUT]
        self.output_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_OUTPUT]
        self.program = qaicrt.Program(self.context, device_id, qpc, qaicrt.QAicProgramProperties())
        if self.program.load() != qaicrt.QStatus.QS_SUCCESS or self.program.activate() != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError(f"cannot load {qpc_path} on AI 100 device {device_id}")
        self.exec_obj = qaicrt.ExecObj(self.context, self.program)
        self.buffers = [qaicrt.QBuffer(bytes(b.size)) for b in self.bindings]
        self.dims = qaicrt.BufferDimensionsVecRef([(self.dtypes[b.name].itemsize, list(b.dims)) for b in self.bindings])
        self._skip([n for n in self.input_names + self.output_names if n.startswith("past_")])

    def _put(self, name: str, array: np.ndarray) -> None:
        index = self.index[name]
        self.buffers[index] = self._qaicrt.QBuffer(np.ascontiguousarray(array).tobytes())
        self.dims[index] = (array.itemsize, list(array.shape) if array.ndim else [1])

    def _skip(self, names: list[str]) -> None:
        for name in names:
            self._put(name, np.array([], dtype=self.dtypes[name]))

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        qaicrt = self._qaicrt
        visible = [n for n in self.output_names if not n.startswith("past_")]
        wanted = output_names or visible
        symbols = {}
        for name, array in feeds.items():
            if name.startswith("past_"):
                continue
            self._put(name, array.astype(self.dtypes[name], copy=False))
            symbols.update({d: n for d, n in zip(self.input_dims[name], array.shape) if isinstance(d, str)})
        for name in visible:
            if name in wanted:
                shape = [symbols[d] if isinstance(d, str) else d for d in self.output_dims[name]]
                self._put(name, np.zeros(shape, dtype=self.dtypes[name]))
            else:
                self._skip([name])
        if self.exec_obj.setData(self.buffers, self.dims) != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError("AI 100: setData failed")
        if self.queue.enqueue(self.exec_obj) != qaicrt.QStatus.QS_SUCCESS or \
                self.exec_obj.waitForCompletion() != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError("AI 100: the run failed (input shapes must match a compiled specialization)")
        status, outputs = self.exec_obj.getData()
        if status != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError("AI 100: getData failed")
        result = {}
        for name in wanted:
            index = self.index[name]
            result[name] = np.frombuffer(bytes(outputs[index]), self.dtypes[name]).reshape(self.dims[index][1])
        return result


def open_session(directory: Path, manifest: Manifest, graph: str, device_id: int = 0) -> Ai100Session:
    """The QPC compiled for `graph` ("target" or "draft") of an AI 100 lowering."""
    return Ai100Session(Path(directory) / "qpc" / graph, getattr(manifest, graph), device_id)
