"""The lowering's choice of a spinning mode: each mode's decode call timed quiet and beside one busy process.

Kept apart from spinning.py so that a session (which only reads the recorded choice) never loads the busy-process
machinery."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash_onnx.costs import TARGET_OUTPUTS, call_ms
from dflash_onnx.feeds import target_feeds
from dflash_onnx.load import busy_processes
from dflash_onnx.manifest import Manifest

from .spinning import MODES


def measure_spinning(directory: Path, manifest: Manifest, open_target: Callable[[str], object],
                     context: int = 256, repeats: int = 15) -> dict:
    """Per mode, the median decode call ms quiet and with one busy process; the chosen mode."""
    if manifest.ctx_len:
        context = max(0, min(context, int(manifest.ctx_len) - 1))
    feeds = target_feeds(manifest, context, 1)
    sessions = {mode: open_target(mode) for mode in MODES}
    measured = {mode: {"quiet_ms": call_ms(session, feeds, TARGET_OUTPUTS, repeats)}
                for mode, session in sessions.items()}
    with busy_processes(1):
        for mode, session in sessions.items():
            measured[mode]["loaded_ms"] = call_ms(session, feeds, TARGET_OUTPUTS, repeats)
    chosen = min(MODES, key=lambda mode: measured[mode]["quiet_ms"] * measured[mode]["loaded_ms"])
    return {"chosen": chosen, "context": context, "modes": measured}
