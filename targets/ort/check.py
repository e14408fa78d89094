"""The ORT lowering's output check: the lowered graphs against the export on the same inputs, through the
same runners (so the buffer form's in-place K/V, rollback and the draft's rows are exercised).

Quantized matmuls (MatMulNBits, and the experts' QMoE) are compared computing in float (accuracy_level 0) on both
sides: with int8 activations (the int4/int8 passes' default, accuracy_level 4) a last-bit change in a matmul's
input moves its activations' int8 rounding, and a random-weight model amplifies that to percents of the logit
scale, which
would leave the check no tolerance a wrong rewrite could not pass. In float the lowering's rewrites may only
reorder arithmetic, so a quantized export is held to the same tolerance as its float dtype. (What the int8
kernels' rounding does to tokens is measured separately: row_invariance.py, and bench's agreement figures.)"""

from __future__ import annotations

from pathlib import Path

import onnx

from runtime.errors import DFlashError
from runtime.manifest import Manifest

from ..check import compare_lowering
from .session import OrtSession, open_session

# Largest difference allowed between lowered and exported graph outputs, relative to the largest |output|:
# ORT's fusions reorder float arithmetic, nothing more.
LOWERING_TOLERANCE = {"float32": 1e-4, "float16": 1e-2}


def float_accuracy(path: Path) -> onnx.ModelProto | None:
    """The graph at `path` (weights not loaded) with every MatMulNBits and QMoE computing in float
    (accuracy_level 0); None when it has none computing otherwise."""
    graph = onnx.load(str(path), load_external_data=False)
    changed = 0
    for node in graph.graph.node:
        if node.op_type in ("MatMulNBits", "QMoE") and node.domain == "com.microsoft":
            level = next((a for a in node.attribute if a.name == "accuracy_level"), None)
            if level is not None and level.i != 0:
                level.i, changed = 0, changed + 1
    return graph if changed else None


def check_lowering(source: Path, exported: Manifest, directory: Path, manifest: Manifest) -> float:
    """Largest output difference of the lowered graphs in `directory` (`manifest`) against the export at
    `source` (`exported`), relative to the largest |output| (quantized matmuls computing in float on both
    sides); refuses the lowering beyond LOWERING_TOLERANCE."""
    def reference(graph: str) -> OrtSession:
        path = Path(source) / getattr(exported, graph).file
        return OrtSession(path, structure=float_accuracy(path))

    def lowered(graph: str):
        return open_session(directory, manifest, graph,
                            structure=float_accuracy(Path(directory) / getattr(manifest, graph).file))

    allowed = LOWERING_TOLERANCE[manifest.dtype]
    differences = compare_lowering(exported, reference, lowered, manifest)
    for name, difference in differences:
        if difference > allowed:
            buffered = manifest.form == "buffer" and name.startswith("target")
            hint = "--kv-buffer off (a sliding-window target needs its mask)" if buffered else "--passes none"
            if buffered and manifest.lowering is not None and manifest.lowering.provider == "cuda":
                hint = ("--kv-buffer off (ONNX Runtime's CUDA GroupQueryAttention was measured to disagree with "
                        "the export on verify and decode calls over in-place buffers)")
            raise DFlashError(f"the ORT lowering changes {name} by {difference:.2g} of its scale (allowed "
                              f"{allowed:g}): lower with {hint}, or report the graph")
    return max(d for _, d in differences)
