"""A lowering's output check: the lowered graphs against the export (run on ONNX Runtime) on the same inputs,
through the same runners, so a buffer form's in-place K/V, rollback and the draft's rows are exercised. Each
lowering that can run its graphs here calls `compare_lowering` with its sessions and its tolerance.

A mixture-of-experts target picks each row's experts by the order of its router's logits: where two logits
nearly tie, float16's rounding (the lowering's fused kernels round differently from the export's ops) can pick
another expert for that row, which moves the row by percents of the logits' scale while every other row agrees
to the last bits (measured: 2 of 20 rows on a 24-layer float16 gpt-oss). Given the routers, the check records
each call's router logits on both sides and leaves out of the comparison the rows whose chosen experts differ
where the reference's logits nearly tie (ROUTER_TIE) at the first router where they differ (the row's later
routers follow from that flip: on a 24-layer gpt-oss one row first flipped at a gap of 4e-4 of its logits'
scale, then at gaps up to 0.11 further on); it leaves out none when that would be more than half a call's rows,
and none where a row's experts first differ without a near tie (a wrong router)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np

from dflash_onnx.runtime.differences import scaled_difference
from dflash_onnx.runtime.feeds import draft_feeds, target_feeds
from dflash_onnx.runtime.manifest import Manifest, TensorSpec
from dflash_onnx.runtime.runners import open_draft_runner, open_runners
from dflash_onnx.runtime.session import Session

# a row's experts may differ between the export and its lowering where the reference's k-th and (k + 1)-th router
# logits are this close, relative to the row's largest |logit| (float16 carries about 1e-3)
ROUTER_TIE = 1e-2


@dataclass
class Routers:
    """A mixture-of-experts target's routers as one graph computes them: the names and dtypes of their logits
    [rows, experts], in layer order, and how many experts each picks per row."""

    names: list[str]
    dtypes: list[str]
    per_row: int
    experts: int

    def exposing(self, manifest: Manifest) -> Manifest:
        """`manifest` with the router logits among the target's outputs (a session binds only what it lists)."""
        extra = [TensorSpec(name, dtype, ["rows", self.experts]) for name, dtype in zip(self.names, self.dtypes)]
        return replace(manifest, target=replace(manifest.target, outputs=[*manifest.target.outputs, *extra]))


@dataclass
class _RoutingRecorder:
    """A target session that also fetches the router logits of every run and keeps them, in run order."""

    session: Session
    routers: Routers
    runs: list[list[np.ndarray]] = field(default_factory=list)

    def __getattr__(self, name: str):
        return getattr(self.session, name)

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        routers = self.routers.names
        names = [n for n in (output_names or self.session.output_names) if n not in routers]
        out = self.session.run(feeds, names + routers)
        self.runs.append([np.asarray(out.pop(name), np.float32).reshape(-1, self.routers.experts)
                          for name in routers])
        return out


def _near_tie_flips(reference: list[np.ndarray], lowered: list[np.ndarray], k: int) -> set[int]:
    """The rows of one run whose experts first differ between the sides (routers in layer order) where the
    reference's logits nearly tie; every row when a row's first difference is not at a near tie, or when they are
    more than half the rows. A flipped row's later routers see hidden states that already differ by percents:
    their choices are its consequences, not new evidence."""
    flipped, rows = set(), min(min(len(r), len(w)) for r, w in zip(reference, lowered))
    for want, got in zip(reference, lowered):
        for row in sorted(set(range(rows)) - flipped):
            chosen, other = np.argsort(-want[row], kind="stable")[:k], np.argsort(-got[row], kind="stable")[:k]
            if set(chosen) == set(other):
                continue
            ranked = np.sort(want[row])[::-1]
            if ranked[k - 1] - ranked[k] > ROUTER_TIE * np.abs(want[row]).max():
                return set(range(rows))
            flipped.add(row)
    return flipped if 2 * len(flipped) <= rows else set(range(rows))


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


def _target_sequence(manifest: Manifest, session, runs: dict[str, int]) -> dict[str, np.ndarray]:
    """A prefill, a verify, a partial commit, another verify and a decode through the manifest's runner (the
    buffer form's rollback included): (name, output) per call, the same ids for every graph form. `runs`: the
    recorded session run each output came from, where a step was one run."""
    runner, _ = open_runners(manifest, session, None, 256)
    rng = np.random.default_rng(0)
    outputs, length = {}, 0
    for step, (count, keep) in enumerate(_target_steps(manifest)):
        before = len(getattr(session, "runs", ()))
        out = runner.forward(rng.integers(0, manifest.vocab_size, size=count), count)
        named = {f"target logits (step {step})": out.logits, f"target_hidden (step {step})": out.context}
        outputs.update(named)
        if len(getattr(session, "runs", ())) == before + 1:
            runs.update(dict.fromkeys(named, before))
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
             sequence: bool, routers: Routers | None = None) -> tuple[dict[str, np.ndarray], dict[str, int], list]:
    """The float outputs of the sample calls (of the draft's K/V, the call's new rows: all a rows-form draft
    returns), then of the target and draft call sequences when `sequence`, by name; with `routers`, the target
    run each target output came from and every run's router logits. One graph's session is open at a time (the
    draft's calls take sample features, not the target's)."""
    outputs, runs, recorded = {}, {}, []
    for graph in ("draft", "target"):
        session = open_graph(graph)
        if graph == "target" and routers is not None:
            session = _RoutingRecorder(session, routers)
            recorded = session.runs
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
                    runs[f"{graph} output {name} (call {index})"] = len(recorded) - 1
        if sequence:
            outputs.update(_target_sequence(manifest, session, runs) if graph == "target" else
                           _draft_sequence(manifest, session))
        del session
    return outputs, {name: run for name, run in runs.items() if name.startswith("target") and run >= 0}, recorded


def _without_rows(value: np.ndarray, rows: set[int], count: int) -> np.ndarray:
    """`value` with the positions of a call's `rows` (of `count`) zeroed on its rows axis (-2: logits and hidden
    [.., rows, width], K/V [.., past + rows, head_dim])."""
    if not rows or value.ndim < 2 or value.shape[-2] < count:
        return value
    kept = np.array(value, np.float64)
    kept[..., [value.shape[-2] - count + row for row in sorted(rows)], :] = 0
    return kept


@dataclass
class Comparison:
    """compare_lowering's result: (name, difference relative to the largest |output|) per compared output, and
    how many rows it left out as near-tie routing flips."""

    differences: list[tuple[str, float]]
    flipped_rows: int = 0


def compare_lowering(exported: Manifest, open_reference: Callable[[str], Session],
                     open_lowered: Callable[[str], Session], manifest: Manifest,
                     routers: tuple[Routers, Routers] | None = None) -> Comparison:
    """Every compared output of the lowered graphs (`manifest`, sessions from `open_lowered(graph)`) against the
    export (`exported`, `open_reference(graph)`); with `routers` (sessions that return their logits when asked),
    the rows whose experts differ at a near tie left out. The check holds one graph's session at a time: the
    export's, then the lowering's, draft then target. `routers`: the reference's and the lowering's."""
    calls, sequence = _sample_calls(exported, target=manifest.form == "concat"), manifest.form == "buffer"
    wanted, runs, reference = _outputs(exported, open_reference, calls, sequence, routers and routers[0])
    got, lowered_runs, lowered = _outputs(manifest, open_lowered, calls, sequence, routers and routers[1])
    flips: dict[int, set[int]] = {}  # run -> rows left out (fewer than the run's rows)
    if routers is not None and len(reference) == len(lowered) and runs == lowered_runs:
        for run, (want, have) in enumerate(zip(reference, lowered)):
            rows = _near_tie_flips(want, have, routers[0].per_row)
            if len(rows) < len(want[0]):
                flips[run] = rows
    differences = []
    for name, want in wanted.items():
        have = np.asarray(got[name], np.float64)
        if flips.get(runs.get(name)):
            rows, count = flips[runs[name]], len(reference[runs[name]][0])
            want, have = _without_rows(want, rows, count), _without_rows(have, rows, count)
        differences.append((name, scaled_difference(want, have)))
    return Comparison(differences, sum(len(rows) for rows in flips.values()))
