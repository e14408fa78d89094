"""Backends: each lowers an exported directory and opens Sessions on it.

`open_session(directory, manifest, "target" | "draft", backend)` is all the decoding loop needs.
"""

from __future__ import annotations

from pathlib import Path

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import Manifest
from dflash_onnx.session import Session

BACKENDS = ("ort", "ai100", "mlx", "coreml")


def open_session(directory: Path, manifest: Manifest, graph: str, backend: str = "ort", **options) -> Session:
    """Open the `graph` ("target" or "draft") of an exported directory on `backend`."""
    if graph not in ("target", "draft"):
        raise ValueError(f"graph must be 'target' or 'draft', not {graph!r}")
    spec = getattr(manifest, graph)
    lowered_for = manifest.lowering.get("target")
    if lowered_for in ("mlx", "coreml") and backend != lowered_for:
        raise DFlashError(f"{directory} was lowered for {lowered_for}: run it with --backend {lowered_for}")
    if backend == "coreml":
        if lowered_for != "coreml":
            raise DFlashError(f"{directory} is not a CoreML lowering: run 'dflash-onnx lower OUT --target coreml "
                              "--out COREML_DIR' first")
        from .coreml import CoremlSession

        units = options.get("compute_units") or manifest.lowering["options"]["compute_units"]
        return CoremlSession(Path(directory) / spec.file, units)
    if backend == "mlx":
        if lowered_for != "mlx":
            raise DFlashError(f"{directory} is not an MLX lowering: run 'dflash-onnx lower OUT --target mlx "
                              "--out MLX_DIR' first")
        from .mlx import MlxSession

        return MlxSession(Path(directory), manifest, graph)
    if backend == "ort":
        from .ort import OrtSession

        return OrtSession.for_directory(Path(directory), manifest, graph, **options)
    if backend == "ai100":
        if manifest.form != "retained":
            raise DFlashError(f"{directory} holds {manifest.form}-form graphs: lower it with "
                              "'dflash-onnx lower OUT --target ai100' first")
        from .ai100 import Ai100Session

        return Ai100Session(Path(directory) / "qpc" / graph, Path(directory) / spec.file, **options)
    raise DFlashError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
