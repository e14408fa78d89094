"""Calibration for passes that need real activations: the feeds decoding gives each graph, and peaks.

Feeds are recorded from DFlash decoding of random prompts on the untransformed export (so the draft sees
real target features and real KV), and ONNX Runtime's MinMax calibrator measures every float tensor.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx

FP16_MAX = 65504.0
# Attention masks fill with float32's lowest value; such sentinels (and scores they were added to) are
# not activations: the float16 converter clamps them to float16's range on purpose.
MASK_SENTINEL = 0.5 * float(np.finfo(np.float32).max)


class _RecordingSession:
    def __init__(self, session, store: list[dict[str, np.ndarray]]):
        self._session, self._store = session, store
        self.input_names, self.output_names = session.input_names, session.output_names

    def run(self, feeds, output_names=None):
        self._store.append({name: np.array(value) for name, value in feeds.items()})
        return self._session.run(feeds, output_names)


def record_feeds(directory: Path, prompts: int = 4, prompt_length: int = 32, new_tokens: int = 16,
                 seed: int = 0) -> dict[str, list[dict[str, np.ndarray]]]:
    """Inputs of every target and draft call while DFlash-decoding `prompts` random prompts."""
    from dflash_onnx.decode import Decoder

    decoder = Decoder.open(Path(directory))
    store: dict[str, list] = {"target": [], "draft": []}
    decoder.target = _RecordingSession(decoder.target, store["target"])
    decoder.draft = _RecordingSession(decoder.draft, store["draft"])
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


def fp16_range_report(peaks: dict[str, float]) -> dict:
    """The largest real activation and whether it overflows float16, mask sentinels set aside."""
    real = {name: peak for name, peak in peaks.items() if peak < MASK_SENTINEL}
    where = max(real, key=real.get) if real else None
    largest = real.get(where, 0.0)
    return {"largest_activation": largest, "largest_activation_at": where,
            "mask_sentinels": len(peaks) - len(real), "fp16_overflow": largest > FP16_MAX}


def power_of_two_scale(peak: float, limit: float = 128.0) -> float:
    """Smallest power of two s >= 1 with peak / s <= limit (its square then stays far inside float16)."""
    return float(2 ** max(0, int(np.ceil(np.log2(max(peak, 1e-9) / limit)))))
