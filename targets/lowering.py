"""What every lowering does before it writes anything (lowering side: reads the export, not a runtime)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from dflash_onnx.costs import measurable, measure_costs
from dflash_onnx.manifest import CostModel, Manifest, load_export
from dflash_onnx.publish import check_out_dir, directory_bytes, staged_directory

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


def lowered_costs(directory: Path, manifest: Manifest, open_session, context: int = 256,
                  repeats: int = 5) -> CostModel | None:
    """The cost curve of the lowered graphs in `directory`, measured on the backend they were lowered for (None
    for graphs that run at compiled sizes only: `calibrate --from FILE` replays a curve measured on the device)."""
    if measurable(manifest) is not None:
        return None
    if manifest.ctx_len:  # the buffers must hold the context, the block and the draft's block after it
        context = max(0, min(context, manifest.ctx_len - 2 * manifest.block_size))
    sessions = [open_session(Path(directory), manifest, graph) for graph in ("target", "draft")]
    return measure_costs(manifest, *sessions, context=context, repeats=repeats, source="lower")


def lowered_output(source: Path, out: Path, request: LowerRequest, checkpoints: tuple[Path, Path] | None = None,
                   size_factor: float = 1.1, memory_factor: float = 0.0) -> AbstractContextManager[Path]:
    """The staging directory a lowering writes OUT into (published whole, OUT locked meanwhile), with the
    free space it needs taken as `size_factor` times the export's size, and the memory (checked where the
    backend measured its peak) `memory_factor` times it."""
    size = directory_bytes(Path(source))
    return staged_directory(Path(out), (Path(source), *(checkpoints or ())), request.overwrite,
                            int(size_factor * size), int(memory_factor * size))
