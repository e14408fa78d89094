"""Float16 range helpers shared by the fp16 pass and the AI 100 / CoreML lowerings (numpy only)."""

from __future__ import annotations

import numpy as np

FP16_MAX = 65504.0
# Attention masks fill with float32's lowest value; such sentinels (and scores they were added to) are
# not activations: the float16 converter clamps them to float16's range on purpose.
MASK_SENTINEL = 0.5 * float(np.finfo(np.float32).max)


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
