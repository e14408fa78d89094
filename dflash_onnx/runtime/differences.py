"""How far one output is from another, where outputs may hold infinities: a reduced-vocabulary draft's logits are
-inf at the tokens it cannot propose (dflash_onnx/exporter/models/draft_vocab.py). Equal infinities agree; an infinity
or NaN
on one side only is an infinite difference (a plain |a - b| would give NaN there, and every comparison with NaN
is false, so a check would pass it)."""

from __future__ import annotations

import numpy as np


def max_difference(want, have) -> float:
    """max |have - want| over the entries finite on both sides; inf where the two are not both finite or the same
    infinity."""
    want, have = np.asarray(want, np.float64), np.asarray(have, np.float64)
    finite = np.isfinite(want) & np.isfinite(have)
    if not (finite | (np.isinf(want) & (want == have))).all():
        return float("inf")
    return float(np.abs(have[finite] - want[finite]).max()) if finite.any() else 0.0


def finite_scale(want) -> float:
    """max |want| over its finite entries (0 where none is)."""
    want = np.asarray(want, np.float64)
    finite = want[np.isfinite(want)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def scaled_difference(want, have) -> float:
    """max_difference relative to want's finite scale (at least 1e-6)."""
    return max_difference(want, have) / max(finite_scale(want), 1e-6)
