"""What every lowering does before it writes anything (lowering side: reads the export, not a runtime)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_onnx.manifest import Manifest, load_export
from dflash_onnx.publish import check_out_dir

from .backend import LowerRequest


def start_lowering(source: Path, out: Path, options: Any, request: LowerRequest,
                   reexport: bool = False) -> tuple[Manifest, tuple[Path, Path] | None]:
    """What every lowering does first: read the export, check the options against it, find the checkpoints
    (`reexport`) and refuse an --out that exists or would replace an input. Returns the export's manifest
    and the (target, draft) checkpoint directories when asked for."""
    manifest = load_export(source, "lower")
    options.validate(manifest.block_size)
    checkpoints = manifest.checkpoints(request.target_dir, request.draft_dir, flag="--{kind}-dir") if reexport \
        else None
    check_out_dir(Path(out), (Path(source), *(checkpoints or ())), request.overwrite)
    return manifest, checkpoints
