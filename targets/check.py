"""A lowering's output check: the lowered graphs against the export (run on ONNX Runtime) on the same inputs,
through the same runners, so a buffer form's in-place K/V, rollback and the draft's rows are exercised. Each
lowering that can run its graphs here calls `compare_lowering` with its sessions and its tolerance."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from runtime.feeds import draft_feeds, target_feeds
from runtime.manifest import Manifest
from runtime.runners import open_draft_runner, open_runners
from runtime.session import Session


def _sample_calls(manifest: Manifest, target: bool) -> list[tuple[str, dict]]:
    calls = [("draft", draft_feeds(manifest, 0)), ("draft", draft_feeds(manifest, 9))]
    if target:
        calls += [("target", target_feeds(manifest, 0, 5)), ("target", target_feeds(manifest, 7, manifest.block_size)),
                  ("target", target_feeds(manifest, 12, 1))]
    return calls


def _target_steps(manifest: Manifest) -> tuple[tuple[int, int], ...]:
    """(rows, rows kept) of each call of the target sequence."""
    return (20, 20), (manifest.block_size, 2), (3, 3), (1, 1)


def target_calls(manifest: Manifest) -> int:
    """The lowered target's calls in compare_lowering (what a lowering weighs before running the check)."""
    sequence = len(_target_steps(manifest)) if manifest.form == "buffer" else 0
    return sequence + sum(graph == "target" for graph, _ in _sample_calls(manifest, manifest.form == "concat"))


def _target_sequence(manifest: Manifest, session) -> dict[str, np.ndarray]:
    """A prefill, a verify, a partial commit, another verify and a decode through the manifest's runner (the
    buffer form's rollback included): (name, output) per call, the same ids for every graph form."""
    runner, _ = open_runners(manifest, session, None, 256)
    rng = np.random.default_rng(0)
    outputs, length = {}, 0
    for step, (count, keep) in enumerate(_target_steps(manifest)):
        out = runner.forward(rng.integers(0, manifest.vocab_size, size=count), count)
        outputs.update({f"target logits (step {step})": out.logits, f"target_hidden (step {step})": out.context})
        length += keep
        runner.commit(length)
    return outputs


def _draft_sequence(manifest: Manifest, session) -> dict[str, np.ndarray]:
    """Draft logits over four proposals through the manifest's draft runner, its context cache growing by
    20, a block, 3 and 1 rows (the same features and ids for every form)."""
    runner = open_draft_runner(manifest, session)
    rng = np.random.default_rng(1)
    outputs = {}
    for step, rows in enumerate((20, manifest.block_size, 3, 1)):
        features = rng.standard_normal((rows, manifest.num_taps * manifest.target_hidden_size))
        context = features.astype(manifest.numpy_dtype)
        block = rng.integers(0, manifest.vocab_size, size=manifest.block_size)
        outputs[f"draft logits (proposal {step})"] = runner.propose(block, context, True).logits
    return outputs


def _on_host(value) -> np.ndarray:
    """A session's output as numpy, bfloat16 widened to float32 (exact): numpy has no bfloat16 of its own, and
    cannot read MLX's at all."""
    try:
        value = np.asarray(value)
    except ValueError:
        import mlx.core as mx

        value = np.asarray(value.astype(mx.float32))
    return value.astype(np.float32) if value.dtype == ml_dtypes.bfloat16 else value


def _outputs(manifest: Manifest, open_graph: Callable[[str], Session], calls: list[tuple[str, dict]],
             sequence: bool) -> dict[str, np.ndarray]:
    """The float outputs of the sample calls (of the draft's K/V, the call's new rows: all a rows-form draft
    returns), then of the target and draft call sequences when `sequence`, by name. One graph's session is
    open at a time (the draft's calls take sample features, not the target's)."""
    outputs = {}
    for graph in ("draft", "target"):
        session = open_graph(graph)
        for index, (called, feeds) in enumerate(calls):
            if called != graph:
                continue
            feeds = {n: v.astype(manifest.numpy_dtype) if v.dtype.kind == "f" else v for n, v in feeds.items()}
            for name, value in session.run(feeds).items():
                value = _on_host(value)  # K/V a session keeps on its device (MLX) included
                if value.dtype.kind == "f":
                    if graph == "draft" and name in manifest.draft.kv_outputs:
                        value = value[:, value.shape[1] - feeds["target_hidden"].shape[1]:]
                    outputs[f"{graph} output {name} (call {index})"] = value
        if sequence:
            outputs.update(_target_sequence(manifest, session) if graph == "target" else
                           _draft_sequence(manifest, session))
        del session
    return outputs


def compare_lowering(exported: Manifest, open_reference: Callable[[str], Session],
                     open_lowered: Callable[[str], Session], manifest: Manifest) -> list[tuple[str, float]]:
    """(name, difference relative to the largest |output|) of every compared output of the lowered graphs
    (`manifest`, sessions from `open_lowered(graph)`) against the export (`exported`, `open_reference(graph)`).
    The check holds one graph's session at a time: the export's, then the lowering's, draft then target."""
    calls, sequence = _sample_calls(exported, target=manifest.form == "concat"), manifest.form == "buffer"
    wanted = _outputs(exported, open_reference, calls, sequence)
    got = _outputs(manifest, open_lowered, calls, sequence)
    differences = []
    for name, want in wanted.items():
        scale = max(float(np.abs(want).max()), 1e-6)
        differences.append((name, float(np.abs(np.asarray(got[name], np.float64) - want).max()) / scale))
    return differences
