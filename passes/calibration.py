"""Calibration for passes that need real activations: the feeds decoding gives each graph, and peaks.

Feeds are recorded from DFlash decoding of random prompts on the untransformed export (so the draft sees
real target features and real KV), and ONNX Runtime's MinMax calibrator measures every float tensor. The
caller hands over how to open the export's graphs (a backend's sessions live above the passes).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.runtime.session import Session

OpenGraph = Callable[[str], Session]  # "target" or "draft" -> a session on that graph of the source export


class _RecordingSession:
    """A Session that keeps a copy of every call's inputs."""

    def __init__(self, session, store: list[dict[str, np.ndarray]]):
        self._session, self._store = session, store
        self.input_names, self.output_names = session.input_names, session.output_names
        self.retains_state = session.retains_state

    def run(self, feeds, output_names=None):
        self._store.append({name: np.array(value) for name, value in feeds.items()})
        return self._session.run(feeds, output_names)


def record_feeds(manifest: Manifest, open_graph: OpenGraph, prompts: int = 4, prompt_length: int = 32,
                 new_tokens: int = 16, seed: int = 0) -> dict[str, list[dict[str, np.ndarray]]]:
    """Inputs of every target and draft call while DFlash-decoding `prompts` random prompts of the export that
    `manifest` describes, on the sessions `open_graph` opens."""
    store: dict[str, list] = {"target": [], "draft": []}
    target, draft = (_RecordingSession(open_graph(g), store[g]) for g in ("target", "draft"))
    decoder = Decoder(manifest, target, draft)
    rng = np.random.default_rng(seed)
    for _ in range(prompts):
        prompt = rng.integers(0, decoder.manifest.vocab_size, size=prompt_length)
        decoder.generate(prompt, new_tokens, "dflash", stop_token_ids=[])
    return store


def activation_peaks(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Largest |value| of every float tensor of `model` over `feeds` (ORT's MinMax calibrator)."""
    from onnxruntime.quantization.calibrate import (
        CalibrationDataReader,
        CalibrationMethod,
        create_calibrator,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._feeds = iter(feeds)

        def get_next(self):
            return next(self._feeds, None)

    with tempfile.TemporaryDirectory(prefix="dflash-calibration-") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data")
        onnx.external_data_helper.load_external_data_for_model(model, tmp)  # saving moved the weights out
        calibrator = create_calibrator(path, augmented_model_path=Path(tmp) / "augmented.onnx",
                                       calibrate_method=CalibrationMethod.MinMax, use_external_data_format=True)
        calibrator.collect_data(Reader())
        ranges = calibrator.compute_data().data
        del calibrator  # its InferenceSession holds the temporary files open
    return {name: float(max(np.abs(r.range_value[0]).max(), np.abs(r.range_value[1]).max()))
            for name, r in ranges.items()}
