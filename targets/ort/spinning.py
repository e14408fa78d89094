"""How the ORT sessions' intra-op threads wait for work, chosen by measurement at lowering.

Spinning threads answer the next parallel section at once, which pays on short calls (a few-MB model's 0.2 ms
decode step) and collapses when another process wants the cores: a spinning worker holds its core while the
thread it waits for is descheduled. Three modes: `on` (spin between calls too), `calls` (spin within a call,
sleep once it ends: `session.force_spinning_stop`), `off` (never spin). `auto` times a decode call of the
lowered target in each mode, quiet and with one busy process beside it (spinning_measure.py), and keeps the mode
with the best product of the two (the geometric mean of quiet and loaded speed): on the random Qwen3-0.6B int4
shape that is `off`, on the demo pair `calls`.
"""

from __future__ import annotations

MODES = ("on", "calls", "off")
CHOICES = ("auto", *MODES)


def session_settings(mode: str, graph: str) -> dict:
    """The OrtSession keywords of a spinning mode; the draft always sleeps after its call (the target's verify
    comes next and needs the cores)."""
    return {"allow_spinning": mode != "off", "stop_spinning_after_run": graph == "draft" or mode == "calls"}
