"""A stand-in for Triton's `triton_python_backend_utils`, which only exists inside tritonserver's Python backend:
the calls dflash_onnx/serving/triton.py makes, with the semantics Triton's python_backend README documents (a decoupled
model's responses go through a request's response sender; the last carries the final flag). The requests are
built by the test as Triton would hand them to `execute`."""

from __future__ import annotations

import json
import threading

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL_FLAG = 1


class TritonError:
    def __init__(self, message: str, code: int | None = None):
        self._message = message

    def message(self) -> str:
        return self._message


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor], error: TritonError | None = None):
        self._outputs, self._error = output_tensors, error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ResponseSender:
    """Records what the model sends; `done` is set by the response carrying the final flag (a second one, or one
    after it, is the error Triton raises)."""

    def __init__(self):
        self.responses: list[InferenceResponse] = []
        self.done = threading.Event()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.done.is_set():
            raise RuntimeError("a response was sent after the final flag")
        if response is not None:
            self.responses.append(response)
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL_FLAG:
            self.done.set()


class InferenceRequest:
    def __init__(self, inputs: dict[str, np.ndarray], parameters: dict | None = None):
        self._inputs = {name: Tensor(name, array) for name, array in inputs.items()}
        self._parameters = json.dumps(parameters or {})
        self.sender = ResponseSender()
        self.cancelled = False

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def parameters(self) -> str:
        return self._parameters

    def is_cancelled(self) -> bool:
        return self.cancelled


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return request._inputs.get(name)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))
