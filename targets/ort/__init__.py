"""ONNX Runtime: runs exports, ORT lowerings and AI 100 lowerings' graphs; `lower --target ort` fuses and
rewrites the graphs for it (lower.py). The session (session.py) needs only numpy and onnxruntime."""

from __future__ import annotations

from pathlib import Path

from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.backend import Backend, LowerRequest, recorded_options
from dflash_onnx.targets.ort.options import FLAGS, OrtOptions


def _open_session(directory: Path, manifest: Manifest, graph: str, **overrides):
    from dflash_onnx.targets.ort.session import (
        open_session,  # imports onnx (~1 s with ml_dtypes): only when a session opens
    )

    return open_session(directory, manifest, graph, **overrides)


def _lower(source: Path, out: Path, options: OrtOptions, request: LowerRequest) -> Manifest:
    from dflash_onnx.targets.ort.lower import lower_ort

    return lower_ort(source, out, options, request)


def _summary(manifest: Manifest, out: Path) -> str:
    options = recorded_options(OrtOptions, manifest)
    kv = f"K/V buffers growing to {manifest.ctx_len} rows" if manifest.form == "buffer" else "concat K/V"
    if manifest.target.kv_dtype == "int8":
        kv = f"int8 {kv} (per-channel scales calibrated here)"
    return (f"lowered to {out} for ONNX Runtime ({options.provider}; {kv}; passes "
            f"{', '.join(options.passes) or 'none'}; ORT optimizations '{options.optimization_level}' saved; "
            f"{len(manifest.lowering.shared_with_target)} draft tensors shared with the target; largest difference "
            f"to the export {manifest.lowering.max_relative_difference:.1g} of scale; {_rows(manifest)}; threads "
            f"spin: {_spinning(options, manifest)})")


def _rows(manifest: Manifest) -> str:
    """What the batch-invariance measurement found (targets/row_invariance.py)."""
    measured = manifest.lowering.report.get("batch_invariance")
    if not measured:
        return "batch invariance not measured"
    if not measured["invariant"]:
        return "rows NOT batch-invariant (greedy and DFlash may differ at near ties)"
    multiple = measured["row_multiple"]
    return f"calls padded to {multiple} rows (batch-invariant)" if multiple > 1 else "rows batch-invariant"


def _spinning(options: OrtOptions, manifest: Manifest) -> str:
    measured = manifest.lowering.report.get("spinning")
    if not measured:
        return f"{options.spinning_mode()} (chosen)"
    times = ", ".join(f"{mode} {m['quiet_ms']:.3g}/{m['loaded_ms']:.3g}" for mode, m in measured["modes"].items())
    return f"{measured['chosen']} (decode ms quiet/loaded: {times})"


def _can_open(directory: Path, manifest: Manifest) -> str | None:
    if manifest.backend in (None, "ort", "ai100"):  # ONNX graphs with their weights
        return None
    return f"{directory} was lowered for {manifest.backend}: run it with --backend {manifest.backend}"


BACKEND = Backend(name="ort", title="ONNX Runtime", options_type=OrtOptions, flags=FLAGS, reexports=False,
                  lower=_lower, summary=_summary, can_open=_can_open, open_session=_open_session,
                  session_options=("providers", "intra_op_threads", "allow_spinning", "optimization_level",
                                   "session_config", "spinning"))
