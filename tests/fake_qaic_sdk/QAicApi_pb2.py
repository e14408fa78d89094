"""A stand-in for the Cloud AI 100 SDK's IO-descriptor protobufs (tests only): JSON instead of protobuf."""

import json
from types import SimpleNamespace

FLOAT_TYPE, FLOAT_16_TYPE, INT64_I_TYPE, INT32_I_TYPE = 1, 2, 3, 4
BUFFER_IO_TYPE_INPUT, BUFFER_IO_TYPE_OUTPUT = 0, 1


class IoDesc:
    def __init__(self):
        self.selected_set = SimpleNamespace(bindings=[])

    def ParseFromString(self, raw: bytes) -> None:  # noqa: N802 (protobuf's name)
        self.selected_set.bindings = [SimpleNamespace(**b) for b in json.loads(raw.decode())]
