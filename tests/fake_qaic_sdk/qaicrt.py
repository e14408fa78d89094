"""A stand-in for Qualcomm's qaicrt (tests only): a "device" that runs the QPC's ONNX graph on ONNX Runtime
and keeps retained state in its own memory, so AI 100 Session logic can be exercised without hardware.

A fake QPC directory holds fake_qpc.json: {"onnx": path relative to the QPC dir, "specializations": path}.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import QAicApi_pb2 as aicapi

QStatus = SimpleNamespace(QS_SUCCESS=0, QS_ERROR=1)
NUMPY = {aicapi.FLOAT_TYPE: np.float32, aicapi.FLOAT_16_TYPE: np.float16, aicapi.INT64_I_TYPE: np.int64,
         aicapi.INT32_I_TYPE: np.int32}
ONNX_TO_AIC = {1: aicapi.FLOAT_TYPE, 10: aicapi.FLOAT_16_TYPE, 7: aicapi.INT64_I_TYPE, 6: aicapi.INT32_I_TYPE}
CALLS = []  # (graph file, {input name: shape}, [outputs copied to the host]) per execution, for tests


class QBuffer:
    def __init__(self, data: bytes):
        self.data = bytes(data)
        self.size = len(self.data)

    def __bytes__(self):
        return self.data


class BufferDimensionsVecRef(list):
    pass


class QAicProgramProperties:
    pass


class Context:
    pass


class Qpc:
    def __init__(self, path: str):
        self.dir = Path(path)
        info = json.loads((self.dir / "fake_qpc.json").read_text())
        self.onnx = (self.dir / info["onnx"]).resolve()
        specs = json.loads((self.dir / info["specializations"]).read_text())["specializations"]
        self.symbols = {k: max(int(s["symbols"][k]) for s in specs) for k in specs[0]["symbols"]}

    def getIoDescriptor(self):  # noqa: N802
        import onnx

        graph = onnx.load(str(self.onnx), load_external_data=False).graph
        bindings = []
        for direction, values in ((aicapi.BUFFER_IO_TYPE_INPUT, graph.input), (aicapi.BUFFER_IO_TYPE_OUTPUT,
                                                                               graph.output)):
            for value in values:
                dims = [self.symbols[d.dim_param] if d.dim_param else d.dim_value
                        for d in value.type.tensor_type.shape.dim]
                kind = ONNX_TO_AIC[value.type.tensor_type.elem_type]
                size = int(np.prod(dims)) * np.dtype(NUMPY[kind]).itemsize
                bindings.append({"name": value.name, "index": len(bindings), "dir": direction, "type": kind,
                                 "dims": dims, "size": size})
        return QStatus.QS_SUCCESS, json.dumps(bindings).encode()


class Program:
    def __init__(self, context, device_id, qpc, properties):
        self.qpc = qpc

    def load(self):
        return QStatus.QS_SUCCESS

    def activate(self):
        return QStatus.QS_SUCCESS


class ExecObj:
    def __init__(self, context, program):
        self.qpc = program.qpc
        self.session = ort.InferenceSession(str(self.qpc.onnx))
        _, raw = self.qpc.getIoDescriptor()
        self.bindings = [SimpleNamespace(**b) for b in json.loads(raw.decode())]
        self.state = {b.name: np.zeros(b.dims, NUMPY[b.type]) for b in self.bindings
                      if b.dir == aicapi.BUFFER_IO_TYPE_INPUT and b.name.startswith("past_")}
        self.outputs = []

    def setData(self, buffers, dims):  # noqa: N802
        self.buffers, self.dims = list(buffers), list(dims)
        return QStatus.QS_SUCCESS

    def execute(self):
        feeds = dict(self.state)
        for b in self.bindings:
            if b.dir == aicapi.BUFFER_IO_TYPE_INPUT and not b.name.startswith("past_"):
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
        return QStatus.QS_SUCCESS

    def getData(self):  # noqa: N802
        return QStatus.QS_SUCCESS, self.outputs


class Queue:
    def __init__(self, context, device_id):
        pass

    def enqueue(self, exec_obj):
        return exec_obj.execute()
