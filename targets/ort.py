"""ONNX Runtime backend: a Session over an InferenceSession, with errors a user can act on."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_onnx.errors import DFlashError


class OrtSession:
    """Runs one ONNX graph on ONNX Runtime (CPU unless other providers are named)."""

    def __init__(self, path: Path, providers: list[str] | None = None, intra_op_threads: int | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        try:
            self._session = ort.InferenceSession(
                str(path), sess_options=options, providers=providers or ["CPUExecutionProvider"]
            )
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
            raise DFlashError(f"ONNX Runtime cannot load {path}: {str(exc).splitlines()[0]}") from None
        self.path = Path(path)
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        names = output_names or self.output_names
        missing = sorted(set(self.input_names) - feeds.keys())
        if missing:
            raise DFlashError(f"{self.path.name}: missing inputs {missing}")
        try:
            values = self._session.run(names, feeds)
        except Exception as exc:
            raise DFlashError(f"{self.path.name} failed on ONNX Runtime: {str(exc).splitlines()[0]}") from None
        return dict(zip(names, values))
