"""A stand-in for Qualcomm's qaicrt (tests only): a "device" that runs the QPC's ONNX graph on ONNX Runtime,
keeps retained state in its own memory, and enforces the rules of the real runtime that we know of:

- cores: a program activates only if the programs active on each of its devices leave it its cores
  (16 per device); a QPC's core count is the one it was compiled with;
- memory: a fresh program's retained state is not cleared (here: NaN) until an input writes it;
- buffers: a zero-size buffer is refused for an output whose binding does not allow partial buffers; every
  buffer's bytes must match its dims and the binding's type; the input shapes must be a compiled
  specialization.

A fake QPC directory holds fake_qpc.json (written by the fake compiler in conftest.py): {"onnx": path relative
to the QPC dir, "specializations": path, "cores": n, "partial": [outputs allowing partial buffers]}.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import QAicApi_pb2 as aicapi

QStatus = SimpleNamespace(QS_SUCCESS=0, QS_ERROR=1)
CORES_PER_DEVICE = 16
NUMPY = {aicapi.FLOAT_TYPE: np.float32, aicapi.FLOAT_16_TYPE: np.float16, aicapi.INT64_I_TYPE: np.int64,
         aicapi.INT32_I_TYPE: np.int32}
ONNX_TO_AIC = {1: aicapi.FLOAT_TYPE, 10: aicapi.FLOAT_16_TYPE, 7: aicapi.INT64_I_TYPE, 6: aicapi.INT32_I_TYPE}
CALLS = []  # (graph file, {input name: shape}, [outputs copied to the host]) per execution, for tests
ACTIVE = {}  # device id -> cores held by active programs
ERRORS = []  # why the last failures failed, for tests


def reset():
    CALLS.clear()
    ACTIVE.clear()
    ERRORS.clear()


def _fail(reason: str) -> int:
    ERRORS.append(reason)
    return QStatus.QS_ERROR


class QIDList(list):
    pass


class QBuffer:
    def __init__(self, data: bytes):
        self.data = bytes(data)
        self.size = len(self.data)

    def __bytes__(self):
        return self.data


class BufferDimensionsVecRef(list):
    pass


class QAicProgramProperties:
    devMapping = ""  # noqa: N815 (qaicrt's name)


class Context:
    def __init__(self, devices=None):
        self.devices = list(devices or [0])


class Qpc:
    def __init__(self, path: str):
        self.dir = Path(path)
        self.info = json.loads((self.dir / "fake_qpc.json").read_text())
        self.onnx = (self.dir / self.info["onnx"]).resolve()
        self.specs = [s["symbols"] if "symbols" in s else s for s in
                      json.loads((self.dir / self.info["specializations"]).read_text())["specializations"]]
        self.symbols = {k: max(int(s[k]) for s in self.specs) for k in self.specs[0]}

    def _graph(self):
        import onnx

        return onnx.load(str(self.onnx), load_external_data=False).graph

    def getIoDescriptor(self):  # noqa: N802
        graph = self._graph()
        partial = set(self.info.get("partial", []))
        bindings, values = [], []
        for direction, group in ((aicapi.BUFFER_IO_TYPE_INPUT, graph.input), (aicapi.BUFFER_IO_TYPE_OUTPUT,
                                                                               graph.output)):
            for value in group:
                dims = [self.symbols[d.dim_param] if d.dim_param else d.dim_value
                        for d in value.type.tensor_type.shape.dim]
                kind = ONNX_TO_AIC[value.type.tensor_type.elem_type]
                size = int(np.prod(dims)) * np.dtype(NUMPY[kind]).itemsize
                bindings.append({"name": value.name, "index": len(bindings), "dir": direction, "type": kind,
                                 "dims": dims, "size": size,
                                 "is_partial_buf_allowed": value.name.startswith("past_") or value.name in partial})
                values.append(value)
        allowed = [[[int(spec[d.dim_param]) if d.dim_param else d.dim_value for d in v.type.tensor_type.shape.dim]
                    for v in values] for spec in self.specs]
        return QStatus.QS_SUCCESS, json.dumps({"bindings": bindings, "allowed_shapes": allowed}).encode()


class Program:
    def __init__(self, context, device_id, qpc, properties):
        self.qpc = qpc
        mapping = getattr(properties, "devMapping", "")
        self.devices = [int(d) for d in mapping.split(":")] if mapping else [device_id]
        assert None not in self.devices, "a single-device program needs its device id"
        self.active = False

    def load(self):
        return QStatus.QS_SUCCESS

    def activate(self):
        cores = int(self.qpc.info["cores"])
        for device in self.devices:
            if ACTIVE.get(device, 0) + cores > CORES_PER_DEVICE:
                return _fail(f"device {device}: {ACTIVE.get(device, 0)} cores in use, {cores} more requested")
        for device in self.devices:
            ACTIVE[device] = ACTIVE.get(device, 0) + cores
        self.active = True
        return QStatus.QS_SUCCESS


class ExecObj:
    def __init__(self, context, program):
        assert program.active, "ExecObj of a program that is not active"
        self.qpc = program.qpc
        self.session = ort.InferenceSession(str(self.qpc.onnx))
        _, raw = self.qpc.getIoDescriptor()
        described = json.loads(raw.decode())
        self.bindings = [SimpleNamespace(**b) for b in described["bindings"]]
        self.allowed = described["allowed_shapes"]
        self.state = {b.name: np.full(b.dims, np.nan, NUMPY[b.type]) for b in self.bindings  # memory not cleared
                      if b.dir == aicapi.BUFFER_IO_TYPE_INPUT and b.name.startswith("past_")}
        self.outputs = []

    def setData(self, buffers, dims):  # noqa: N802
        self.buffers, self.dims = list(buffers), list(dims)
        return QStatus.QS_SUCCESS

    def _check(self) -> str | None:
        for b in self.bindings:
            itemsize, shape = self.dims[b.index]
            size = self.buffers[b.index].size
            if size == 0:
                if not b.is_partial_buf_allowed:
                    return f"{b.name}: a zero-size buffer, and the binding does not allow partial buffers"
                continue
            if itemsize != np.dtype(NUMPY[b.type]).itemsize or size != int(np.prod(shape)) * itemsize:
                return f"{b.name}: {size} bytes of itemsize {itemsize} for dims {shape} and type {b.type}"
        passed = [list(self.dims[b.index][1]) for b in self.bindings]
        for shapes in self.allowed:
            if all(self.buffers[b.index].size == 0 or p == s for b, p, s in zip(self.bindings, passed, shapes)):
                return None
        return f"no compiled specialization matches {passed}"

    def execute(self):
        problem = self._check()
        if problem:
            return _fail(problem)
        feeds = dict(self.state)
        for b in self.bindings:
            if b.dir == aicapi.BUFFER_IO_TYPE_INPUT and self.buffers[b.index].size:
                data = np.frombuffer(bytes(self.buffers[b.index]), NUMPY[b.type])
                feeds[b.name] = data.reshape(self.dims[b.index][1])
        names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_OUTPUT]
        values = dict(zip(names, self.session.run(names, feeds)))
        for name in self.state:
            self.state[name] = values[f"{name}_RetainedState"]
        self.outputs = []
        for b in self.bindings:
            skipped = self.buffers[b.index].size == 0 or b.name.startswith("past_")
            self.outputs.append(QBuffer(b"" if skipped or b.dir == aicapi.BUFFER_IO_TYPE_INPUT
                                        else values[b.name].tobytes()))
        copied = [b.name for b, out in zip(self.bindings, self.outputs) if out.size]
        CALLS.append((self.qpc.onnx.name, {k: v.shape for k, v in feeds.items() if not k.startswith("past_")}, copied))
        return QStatus.QS_SUCCESS

    def waitForCompletion(self):  # noqa: N802
        return self.status

    def getData(self):  # noqa: N802
        return QStatus.QS_SUCCESS, self.outputs


class Queue:
    def __init__(self, context, device_id):
        pass

    def enqueue(self, exec_obj):
        exec_obj.status = exec_obj.execute()
        return QStatus.QS_SUCCESS
