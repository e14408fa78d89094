"""Backends: each lowers an exported directory and opens Sessions on it.

`open_session(directory, manifest, "target" | "draft", backend)` is all the decoding loop needs.
"""

from __future__ import annotations

from pathlib import Path

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import Manifest
from dflash_onnx.session import Session

BACKENDS = ("ort",)


def open_session(directory: Path, manifest: Manifest, graph: str, backend: str = "ort", **options) -> Session:
    """Open the `graph` ("target" or "draft") of an exported directory on `backend`."""
    if graph not in ("target", "draft"):
        raise ValueError(f"graph must be 'target' or 'draft', not {graph!r}")
    spec = getattr(manifest, graph)
    if backend == "ort":
        from .ort import OrtSession

        return OrtSession(Path(directory) / spec.file, **options)
    raise DFlashError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
