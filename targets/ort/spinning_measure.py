"""The lowering's choice of a spinning mode: each mode's decode call timed quiet and beside one busy process.

Kept apart from spinning.py so that a session (which only reads the recorded choice) never loads the busy-process
machinery."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash_onnx.runtime.busy import busy_processes
from dflash_onnx.runtime.costs import TARGET_OUTPUTS, call_ms
from dflash_onnx.runtime.feeds import target_feeds
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.ort.spinning import MODES


def measure_spinning(directory: Path, manifest: Manifest, open_target: Callable[[str], object],
                     context: int = 256, repeats: int = 15) -> dict:
    """Per mode, the median decode call ms quiet and with one busy process; the chosen mode. One mode's session
    is open at a time: each holds the target's weights (three at once peaked at 11.9 GB for a 3 GB int4 target)."""
    if manifest.ctx_len:
        context = max(0, min(context, int(manifest.ctx_len) - 1))
    feeds = target_feeds(manifest, context, 1)
    measured = {}
    for mode in MODES:
        session = open_target(mode)
        measured[mode] = {"quiet_ms": call_ms(session, feeds, TARGET_OUTPUTS, repeats)}
        with busy_processes(1):
            measured[mode]["loaded_ms"] = call_ms(session, feeds, TARGET_OUTPUTS, repeats)
        del session
    chosen = min(MODES, key=lambda mode: measured[mode]["quiet_ms"] * measured[mode]["loaded_ms"])
    return {"chosen": chosen, "context": context, "modes": measured}
