"""The ORT lowering's output check: the lowered graphs against the export on the same inputs, through the
same runners (so the buffer form's in-place K/V, rollback and the draft's rows are exercised).

Quantized matmuls (MatMulNBits) are compared computing in float (accuracy_level 0) on both sides: with int8
activations (the int4/int8 passes' default, accuracy_level 4) a last-bit change in a matmul's input moves its
activations' int8 rounding, and a random-weight model amplifies that to percents of the logit scale, which
would leave the check no tolerance a wrong rewrite could not pass. In float the lowering's rewrites may only
reorder arithmetic, so a quantized export is held to the same tolerance as its float dtype. (What the int8
kernels' rounding does to tokens is measured separately: row_invariance.py, and bench's agreement figures.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from dflash_onnx.errors import DFlashError
from dflash_onnx.feeds import draft_feeds, target_feeds
from dflash_onnx.manifest import Manifest
from dflash_onnx.runners import open_runners

from .session import OrtSession, open_session

# Largest difference allowed between lowered and exported graph outputs, relative to the largest |output|:
# ORT's fusions reorder float arithmetic, nothing more.
LOWERING_TOLERANCE = {"float32": 1e-4, "float16": 1e-2}


def float_accuracy(path: Path) -> onnx.ModelProto | None:
    """The graph at `path` (weights not loaded) with every MatMulNBits computing in float (accuracy_level 0);
    None when it has no MatMulNBits computing otherwise."""
    graph = onnx.load(str(path), load_external_data=False)
    changed = 0
    for node in graph.graph.node:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            level = next((a for a in node.attribute if a.name == "accuracy_level"), None)
            if level is not None and level.i != 0:
                level.i, changed = 0, changed + 1
    return graph if changed else None


def _sample_calls(manifest: Manifest, target: bool) -> list[tuple[str, dict]]:
    calls = [("draft", draft_feeds(manifest, 0)), ("draft", draft_feeds(manifest, 9))]
    if target:
        calls += [("target", target_feeds(manifest, 0, 5)), ("target", target_feeds(manifest, 7, manifest.block_size)),
                  ("target", target_feeds(manifest, 12, 1))]
    return calls


def _target_sequence(manifest: Manifest, session) -> dict[str, np.ndarray]:
    """A prefill, a verify, a partial commit, another verify and a decode through the manifest's runner (the
    buffer form's rollback included): (name, output) per call, the same ids for every graph form."""
    runner, _ = open_runners(manifest, session, None, 256)
    rng = np.random.default_rng(0)
    outputs, length = {}, 0
    for step, (count, keep) in enumerate(((20, 20), (manifest.block_size, 2), (3, 3), (1, 1))):
        out = runner.forward(rng.integers(0, manifest.vocab_size, size=count), count)
        outputs.update({f"target logits (step {step})": out.logits, f"target_hidden (step {step})": out.context})
        length += keep
        runner.commit(length)
    return outputs


def _draft_sequence(manifest: Manifest, sessions: dict) -> dict[str, np.ndarray]:
    """Draft logits over four proposals through the manifest's draft runner, its context cache growing by
    20, a block, 3 and 1 rows (the same features and ids for every form)."""
    _, runner = open_runners(manifest, sessions["target"], sessions["draft"], 256)
    rng = np.random.default_rng(1)
    outputs = {}
    for step, rows in enumerate((20, manifest.block_size, 3, 1)):
        features = rng.standard_normal((rows, manifest.num_taps * manifest.target_hidden_size))
        context = features.astype(manifest.numpy_dtype)
        block = rng.integers(0, manifest.vocab_size, size=manifest.block_size)
        outputs[f"draft logits (proposal {step})"] = runner.propose(block, context, True).logits
    return outputs


def _outputs(manifest: Manifest, sessions: dict, calls: list[tuple[str, dict]],
             sequence: bool) -> dict[str, np.ndarray]:
    """The float outputs of the sample calls (of the draft's K/V, the call's new rows: all a rows-form draft
    returns), then of the target and draft call sequences when `sequence`, by name."""
    outputs = {}
    for index, (graph, feeds) in enumerate(calls):
        for name, value in sessions[graph].run(feeds).items():
            if value.dtype.kind == "f":
                if graph == "draft" and name in manifest.draft.kv_outputs:
                    value = value[:, value.shape[1] - feeds["target_hidden"].shape[1]:]
                outputs[f"{graph} output {name} (call {index})"] = value
    if sequence:
        outputs.update({**_target_sequence(manifest, sessions["target"]), **_draft_sequence(manifest, sessions)})
    return outputs


def check_lowering(source: Path, exported: Manifest, directory: Path, manifest: Manifest) -> float:
    """Largest output difference of the lowered graphs in `directory` (`manifest`) against the export at
    `source` (`exported`), relative to the largest |output| (quantized matmuls computing in float on both
    sides); refuses the lowering beyond LOWERING_TOLERANCE. The export's outputs are computed and its
    sessions closed before the lowered sessions open, so the check holds one model's sessions at a time."""
    calls, sequence = _sample_calls(exported, target=manifest.form == "concat"), manifest.form == "buffer"
    reference = {}
    for g in ("target", "draft"):
        path = Path(source) / getattr(exported, g).file
        reference[g] = OrtSession(path, structure=float_accuracy(path))
    wanted = _outputs(exported, reference, calls, sequence)
    del reference
    lowered = {g: open_session(directory, manifest, g,
                               structure=float_accuracy(Path(directory) / getattr(manifest, g).file))
               for g in ("target", "draft")}
    got = _outputs(manifest, lowered, calls, sequence)
    del lowered
    allowed = LOWERING_TOLERANCE[manifest.dtype]
    worst = 0.0
    for name, want in wanted.items():
        value = got[name]
        scale = max(float(np.abs(want).max()), 1e-6)
        difference = float(np.abs(value.astype(np.float64) - want).max()) / scale
        worst = max(worst, difference)
        if difference > allowed:
            buffered = manifest.form == "buffer" and name.startswith("target")
            hint = "--kv-buffer off (a sliding-window target needs its mask)" if buffered else "--passes none"
            if buffered and manifest.lowering is not None and manifest.lowering.provider == "cuda":
                hint = ("--kv-buffer off (ONNX Runtime's CUDA GroupQueryAttention was measured to disagree with "
                        "the export on verify and decode calls over in-place buffers)")
            raise DFlashError(f"the ORT lowering changes {name} by {difference:.2g} of its scale (allowed "
                              f"{allowed:g}): lower with {hint}, or report the graph")
    return worst
