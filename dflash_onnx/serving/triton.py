"""Triton Inference Server's Python backend: a decoupled model over one Engine, with the inputs and outputs of
Triton's own vLLM backend (text_input, stream, sampling_parameters -> text_output, finish_reason), so Triton's
generate endpoint and clients written for that backend work unchanged.

    python -m dflash_onnx.serving.triton DIR REPOSITORY [--name dflash] [--max-batch 4] [--max-queue 16]

writes REPOSITORY/NAME/config.pbtxt and REPOSITORY/NAME/1/model.py (which imports `TritonPythonModel` from here:
dflash-onnx must be installed in the Python that Triton's backend runs). Then `tritonserver
--model-repository REPOSITORY`. A request's text is the raw prompt (as in the vLLM backend: no chat template);
streamed, each response carries the new text; otherwise one response carries all of it. A request cancelled by
its client stops at its next decoding step.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.serving.engine import Engine, Event, GenerationRequest, QueueFull, Submission
from dflash_onnx.serving.host import EngineSettings

CANCEL_POLL_S = 0.25  # how often a request's relay looks for its cancellation while no event comes
DEFAULT_MAX_TOKENS = 16  # as the vLLM backend's default SamplingParams
SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}


def _backend_utils():
    """Triton's `triton_python_backend_utils`, which exists only inside the server's Python backend."""
    try:
        import triton_python_backend_utils as pb_utils
    except ModuleNotFoundError:
        raise DFlashError("dflash_onnx.serving.triton.TritonPythonModel runs inside Triton Inference Server's Python "
                          "backend (triton_python_backend_utils is not importable here): write a model repository "
                          "with `python -m dflash_onnx.serving.triton DIR REPOSITORY` and start tritonserver on it"
                          ) from None
    return pb_utils


def sampling_request(prompt_ids: list[int], parameters: dict) -> GenerationRequest:
    """A GenerationRequest from the vLLM backend's sampling parameters (max_tokens, temperature, top_p, top_k,
    seed, stop); a parameter this engine cannot honour is refused in one line rather than ignored."""
    unknown = sorted(set(parameters) - SAMPLING_KEYS)
    if unknown:
        raise DFlashError(f"sampling parameter(s) {', '.join(unknown)} not supported: this model takes "
                          f"{', '.join(sorted(SAMPLING_KEYS))}")
    stop = parameters.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, (list, tuple)) else None
    if stop is None or not all(isinstance(s, str) for s in stop):
        raise DFlashError("stop must be a string or a list of strings")
    try:
        max_tokens = int(parameters.get("max_tokens", DEFAULT_MAX_TOKENS))
        sampling = SamplingParams(float(parameters.get("temperature", 0.0)), float(parameters.get("top_p", 1.0)),
                                  int(parameters.get("top_k", 0)),
                                  None if parameters.get("seed") is None else int(parameters["seed"]))
    except (TypeError, ValueError) as exc:
        raise DFlashError(f"a sampling parameter is not a number: {exc}") from None
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be at least 1, got {max_tokens}")
    return GenerationRequest(prompt_ids, max_tokens, sampling, stop)


def _json_object(text, name: str) -> dict:
    if text is None or text in ("", b""):
        return {}
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{name} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise DFlashError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


class TritonPythonModel:
    """The model Triton loads: `initialize` opens the engine from the config's parameters (EngineSettings'
    fields as strings, `directory` required); `execute` queues each request and returns at once, a thread per
    request sending its responses as the engine produces them (the decoupled transaction policy)."""

    def initialize(self, args: dict) -> None:
        self.pb = _backend_utils()
        config = json.loads(args["model_config"])
        if not self.pb.using_decoupled_model_transaction_policy(config):
            raise DFlashError("the dflash-onnx model needs `model_transaction_policy { decoupled: true }` in its "
                              "config.pbtxt (it streams several responses per request)")
        values = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.engine: Engine = EngineSettings.from_strings(values).open()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                submission, stream = self._submit(request)
            except (DFlashError, QueueFull) as exc:
                message = "the model's queue is full: retry later" if isinstance(exc, QueueFull) else str(exc)
                sender.send(self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(message)),
                            flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL_FLAG)
                continue
            threading.Thread(target=self._relay, args=(request, sender, submission, stream), daemon=True,
                             name="dflash-triton-relay").start()
        return None

    def finalize(self) -> None:
        self.engine.close()

    def _submit(self, request) -> tuple[Submission, bool]:
        text = self._scalar(request, "text_input")
        if text is None:
            raise DFlashError("the request has no text_input")
        try:
            text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        except UnicodeDecodeError:
            raise DFlashError("text_input is not valid UTF-8") from None
        stream = bool(self._scalar(request, "stream") or False)
        # the generate endpoint's "parameters", then the sampling_parameters input, as the vLLM backend reads them
        parameters = _json_object(request.parameters() if hasattr(request, "parameters") else None, "parameters")
        parameters.update(_json_object(self._scalar(request, "sampling_parameters"), "sampling_parameters"))
        prompt = self.engine.codec.encode(text)
        if not prompt:
            raise DFlashError("the prompt is empty")
        return self.engine.submit(sampling_request(prompt, parameters)), stream

    def _scalar(self, request, name: str):
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        values = tensor.as_numpy().reshape(-1)
        return values[0] if values.size else None

    def _response(self, text: str, finish: str | None):
        import numpy as np

        tensors = [self.pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if finish is not None:
            tensors.append(self.pb.Tensor("finish_reason", np.array([finish.encode()], dtype=np.object_)))
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _relay(self, request, sender, submission: Submission, stream: bool) -> None:
        """The request's events to its client: each as a response when streaming, else one response at the end;
        the last response carries the final flag. The client's cancellation is looked at every CANCEL_POLL_S,
        also while events keep coming."""
        final, texts, looked = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL_FLAG, [], None
        cancelled = getattr(request, "is_cancelled", lambda: False)  # Triton 23.10+
        while True:
            if looked is None or time.monotonic() - looked >= CANCEL_POLL_S:
                looked = time.monotonic()
                if cancelled():
                    submission.cancel()
            try:
                event: Event = submission.next_event(timeout=CANCEL_POLL_S)
            except queue.Empty:
                continue
            failure = (f"generation failed: {event.error}" if event.error is not None
                       else "the request was cancelled" if event.finish == "cancelled" else None)
            if failure is not None:
                code = getattr(self.pb.TritonError, "CANCELLED" if event.error is None else "INTERNAL", None)
                error = self.pb.TritonError(failure) if code is None else self.pb.TritonError(failure, code)
                sender.send(self.pb.InferenceResponse(output_tensors=[], error=error), flags=final)
                return
            if stream and (event.text or event.finish):
                sender.send(self._response(event.text, event.finish), flags=final if event.finish else 0)
            texts.append(event.text)
            if event.finish is not None:
                if not stream:
                    sender.send(self._response("".join(texts), event.finish), flags=final)
                return


CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true }}
]
output [
  {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }},
  {{ name: "finish_reason" data_type: TYPE_STRING dims: [ -1 ] }}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{parameters}
"""

MODEL = '''"""Triton Python backend model: dflash-onnx's engine (written by `python -m dflash_onnx.serving.triton`)."""

from dflash_onnx.serving.triton import TritonPythonModel  # noqa: F401
'''


def write_repository(settings: EngineSettings, repository: Path, name: str = "dflash") -> Path:
    """REPOSITORY/NAME/{config.pbtxt, 1/model.py} for `settings` (checked first); the directory is written by
    its absolute path. One engine per model instance: the engine batches and queues the requests itself, so
    Triton's own batching is off (max_batch_size 0). Returns the model's folder."""
    settings.check()
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise DFlashError(f"--name {name!r}: give letters, digits, - and _ only")
    values = {"directory": str(settings.directory.resolve()), "max_batch": str(settings.max_batch),
              "shared_draft": "on" if settings.shared_draft else "off",
              "max_queue": str(settings.max_queue), "verify": settings.verify,
              "batch_invariant": "on" if settings.batch_invariant else "off",
              "lookup_guess": "on" if settings.lookup_guess else "off"}
    if settings.backend:
        values["backend"] = settings.backend
    parameters = "\n".join(f'parameters: {{ key: "{key}" value: {{ string_value: {json.dumps(value)} }} }}'
                           for key, value in values.items())
    model = repository / name
    version = model / "1"
    version.mkdir(parents=True, exist_ok=True)
    for path, text in ((model / "config.pbtxt", CONFIG.format(name=name, parameters=parameters)),
                       (version / "model.py", MODEL)):
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text)
        os.replace(partial, path)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_onnx.serving.triton",
                                     description="write a Triton model repository serving a dflash-onnx directory")
    parser.add_argument("directory", type=Path, help="an exported or lowered directory with its tokenizer")
    parser.add_argument("repository", type=Path, help="the model repository to write into (made if missing)")
    parser.add_argument("--name", default="dflash", help="the model's name in the repository (default dflash)")
    parser.add_argument("--max-batch", type=int, default=1, help="requests decoded side by side (a lowering "
                        "with --kv-attention ragged); 1: one at a time")
    parser.add_argument("--max-queue", type=int, default=16, help="requests that may wait; beyond, an error")
    parser.add_argument("--verify", default="auto", metavar="auto|full|N")
    parser.add_argument("--backend", help="the backend to run on (default: the directory's own)")
    args = parser.parse_args(argv)
    try:
        model = write_repository(EngineSettings(args.directory, backend=args.backend, max_batch=args.max_batch,
                                                max_queue=args.max_queue, verify=args.verify),
                                 args.repository, args.name)
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {model}: tritonserver --model-repository {args.repository}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
