"""How the ORT sessions' intra-op threads wait for work, chosen by measurement at lowering.

Spinning threads answer the next parallel section at once, which pays on short calls (a few-MB model's 0.2 ms
decode step) and collapses when another process wants the cores: a spinning worker holds its core while the
thread it waits for is descheduled. Three modes: `on` (spin between calls too), `calls` (spin within a call,
sleep once it ends: `session.force_spinning_stop`), `off` (never spin). `auto` times a decode call of the
lowered target in each mode, quiet and with one busy process beside it, and keeps the mode with the best
product of the two (the geometric mean of quiet and loaded speed): on the random Qwen3-0.6B int4 shape that is
`off`, on the demo pair `calls`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash_onnx.costs import TARGET_OUTPUTS, call_ms
from dflash_onnx.feeds import target_feeds
from dflash_onnx.load import busy_processes
from dflash_onnx.manifest import Manifest

MODES = ("on", "calls", "off")
CHOICES = ("auto", *MODES)


def session_settings(mode: str, graph: str) -> dict:
    """The OrtSession keywords of a spinning mode; the draft always sleeps after its call (the target's verify
    comes next and needs the cores)."""
    return {"allow_spinning": mode != "off", "stop_spinning_after_run": graph == "draft" or mode == "calls"}


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
