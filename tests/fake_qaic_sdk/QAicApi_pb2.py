"""A stand-in for the Cloud AI 100 SDK's IO-descriptor protobufs (tests only): JSON instead of protobuf."""

import json
from types import SimpleNamespace

FLOAT_TYPE, FLOAT_16_TYPE, INT64_I_TYPE, INT32_I_TYPE, BFLOAT16_TYPE, INT8_TYPE = 1, 2, 3, 4, 11, 12
BUFFER_IO_TYPE_INPUT, BUFFER_IO_TYPE_OUTPUT = 0, 1


class IoDesc:
    def __init__(self):
        self.selected_set = SimpleNamespace(bindings=[])
        self.allowed_shapes = []

    def ParseFromString(self, raw: bytes) -> None:  # noqa: N802 (protobuf's name)
        described = json.loads(raw.decode())
        self.selected_set.bindings = [SimpleNamespace(**b) for b in described["bindings"]]
        self.allowed_shapes = [SimpleNamespace(shapes=[SimpleNamespace(dims=d) for d in shapes])
                               for shapes in described["allowed_shapes"]]
