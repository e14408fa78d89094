"""MLX (Apple silicon; `mlx[cpu]` on Linux): the exported graphs executed op by op in MLX (session.py,
ops.py) on weights converted, optionally quantized, by `lower --target mlx` (lower.py)."""

from __future__ import annotations

from pathlib import Path

from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.backend import Backend, LowerRequest, own_lowerings_only, recorded_options
from dflash_onnx.targets.mlx.options import FLAGS, MlxOptions


def _open_session(directory: Path, manifest: Manifest, graph: str):
    from dflash_onnx.targets.mlx.session import (
        open_session,  # imports onnx (~1 s with ml_dtypes): only when a session opens
    )

    return open_session(directory, manifest, graph)


def _lower(source: Path, out: Path, options: MlxOptions, request: LowerRequest) -> Manifest:
    from dflash_onnx.targets.mlx.lower import lower_mlx

    return lower_mlx(source, out, options, request)


def _summary(manifest: Manifest, out: Path) -> str:
    options, weights = recorded_options(MlxOptions, manifest), manifest.lowering.report["weights"]
    precision = f"{options.bits}-bit, group {options.group_size}" if options.bits else "float"
    return (f"lowered to {out} for MLX ({precision}; {sum(w['quantized'] for w in weights.values())} quantized "
            f"MatMul weights, {len(manifest.lowering.shared_with_target)} draft tensors shared with the target)")


BACKEND = Backend(name="mlx", title="MLX", options_type=MlxOptions, flags=FLAGS, reexports=False, lower=_lower,
                  summary=_summary, can_open=own_lowerings_only("mlx", "MLX"), open_session=_open_session,
                  session_options=())
