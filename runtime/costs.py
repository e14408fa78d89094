"""Measuring what a DFlash round costs on the backend a directory runs on: the target's step for T new tokens
and the draft's step, each median of back-to-back calls on sample feeds (numpy only; the sessions are given).
`lower` records the curve in the manifest, `calibrate` refreshes it, and a JSON file can replay one measured
elsewhere."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .errors import DFlashError
from .feeds import draft_feeds, target_feeds
from .manifest import CostModel, Manifest
from .policy import isotonic
from .session import Session

TARGET_OUTPUTS, DRAFT_OUTPUTS = ["greedy_ids", "target_hidden"], ["draft_ids"]


def call_ms(session: Session, feeds: dict[str, np.ndarray], names: list[str], repeats: int) -> float:
    """Median milliseconds of `repeats` back-to-back calls, after one dropped warm-up call."""
    runs = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        session.run(feeds, names)
        runs.append(time.perf_counter() - started)
    return 1000 * float(np.median(runs[1:]))


def measurable(manifest: Manifest) -> str | None:
    """None when single calls of any length can be timed on these graphs, else why not."""
    if manifest.form in ("concat", "buffer"):
        return None
    return (f"{manifest.form}-form graphs run at their compiled sizes only: replay a curve measured on the device "
            "with 'dflash-onnx calibrate DIR --from FILE'")


def measure_costs(manifest: Manifest, open_graph: Callable[[str], Session], context: int = 256, repeats: int = 10,
                  source: str = "") -> CostModel:
    """t(T) for T = 1..block_size and the draft step, at `context` tokens of K/V. `open_graph("target")` and
    `open_graph("draft")` are called in turn and each session dropped before the next opens, so the peak
    memory is the larger graph's, not the pair's (each is timed alone either way)."""
    reason = measurable(manifest)
    if reason is not None:
        raise DFlashError(reason)
    target = open_graph("target")
    verify = [call_ms(target, target_feeds(manifest, context, t), TARGET_OUTPUTS, repeats)
              for t in range(1, manifest.verify_rows + 1)]
    del target
    drafting = call_ms(open_graph("draft"), draft_feeds(manifest, context), DRAFT_OUTPUTS, repeats)
    # verifying more tokens never costs less: timing noise that says so is averaged away
    return CostModel([round(float(v), 4) for v in isotonic(verify)], round(drafting, 4), context, source)


def read_costs(path: Path, block_size: int) -> CostModel:
    """A cost curve from a JSON file ({"verify_ms": [t(1), ..., t(B)], "draft_ms": d}), to replay here."""
    try:
        raw = json.loads(Path(path).read_text())
        costs = CostModel(verify_ms=[float(v) for v in raw["verify_ms"]], draft_ms=float(raw["draft_ms"]),
                          context=int(raw.get("context", 0)), source=str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise DFlashError(f"--cost-model {path}: give a JSON object with verify_ms (milliseconds for T = 1.."
                          f"{block_size}) and draft_ms ({exc})") from None
    if len(costs.verify_ms) < block_size:
        raise DFlashError(f"--cost-model {path}: verify_ms has {len(costs.verify_ms)} entries, the block needs "
                          f"{block_size}")
    return costs
