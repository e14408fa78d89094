"""Measuring what a DFlash round costs on the backend a directory runs on: the target's step for T new tokens
and the draft's step on sample feeds (numpy only; the sessions are given). `lower` records the curve in the
manifest, `calibrate` refreshes it, and a JSON file can replay one measured elsewhere.

Other work on the machine only ever adds time, and it comes and goes: the curve's calls are interleaved (every T
once per round) and each T keeps its fastest round, so a neighbour that starts halfway cannot make the long
verifies look dear (a lowering beside a busy process once recorded t(16) 24x its quiet value). A decode checks the
step times it observes against the curve (`curve_disagreement`) and says when they part by a wide margin."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.feeds import draft_feeds, target_feeds
from dflash_onnx.runtime.manifest import CostModel, Manifest
from dflash_onnx.runtime.policy import isotonic
from dflash_onnx.runtime.session import Session

TARGET_OUTPUTS, DRAFT_OUTPUTS = ["greedy_ids", "target_hidden"], ["draft_ids"]


def call_ms(session: Session, feeds: dict[str, np.ndarray], names: list[str], repeats: int) -> float:
    """Median milliseconds of `repeats` back-to-back calls, after one dropped warm-up call."""
    runs = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        session.run(feeds, names)
        runs.append(time.perf_counter() - started)
    return 1000 * float(np.median(runs[1:]))


def interleaved_min_ms(session: Session, calls: list[dict[str, np.ndarray]], names: list[str],
                       repeats: int) -> list[float]:
    """Each call's fastest of `repeats` rounds (milliseconds), every round running every call once, after one
    dropped warm-up round."""
    best = [float("inf")] * len(calls)
    for round_index in range(repeats + 1):
        for index, feeds in enumerate(calls):
            started = time.perf_counter()
            session.run(feeds, names)
            if round_index:
                best[index] = min(best[index], 1000 * (time.perf_counter() - started))
    return best


# a curve is off when a step length ran this many times faster than recorded (it was measured beside other work),
# or when the observed over recorded times differ by this much between the shortest and the longest verify
# observed (a slower or faster machine alone scales every step alike)
DISAGREEMENT = 3.0
DEPTHS = (1024, 4096, 16384)  # the contexts a curve is measured at besides its own (cut to what a lowering holds)
EXPORT_DEEPEST = 4096  # an export's deepest: its K/V are fed whole, 1.8 GB per call at 16K on a float32 0.6B
MIN_OBSERVED = 3  # steps of a length before its time is compared


def curve_disagreement(costs: CostModel | None, verified: list[int], step_ms: list[float]) -> str | None:
    """One line when a decode's target steps (`step_ms`, verifying `verified[i]` drafted tokens, so i + 1 rows)
    disagree with the recorded curve; None when they agree or too few were observed. A curve recorded beside
    other work is too steep for auto to ever verify a long block, so the short steps alone must tell it."""
    if costs is None:
        return None
    observed: dict[int, list[float]] = {}
    for drafted, ms in zip(verified, step_ms):
        if drafted < len(costs.verify_ms):
            observed.setdefault(drafted + 1, []).append(ms)
    ratios = {rows: float(np.median(times)) / costs.verify_ms[rows - 1]
              for rows, times in observed.items() if len(times) >= MIN_OBSERVED}
    if not ratios:
        return None

    def shown(rows: int) -> str:
        return (f"t({rows}) {costs.verify_ms[rows - 1]:.2f} ms recorded, "
                f"{ratios[rows] * costs.verify_ms[rows - 1]:.2f} observed")

    fastest, short, long = min(ratios, key=ratios.get), min(ratios), max(ratios)
    if ratios[fastest] * DISAGREEMENT < 1:
        found = f"{shown(fastest)}: it was measured while other work shared the machine"
    elif max(ratios[short], ratios[long]) > DISAGREEMENT * min(ratios[short], ratios[long]):
        found = f"{shown(short)}; {shown(long)}"
    else:
        return None
    return (f"the cost curve the verify policy weighs disagrees with this run's steps ({found}); re-measure it with "
            "'dflash-onnx calibrate DIR' on a quiet machine, or pass --cost-model")


def measurable(manifest: Manifest) -> str | None:
    """None when single calls of any length can be timed on these graphs, else why not."""
    if manifest.form in ("concat", "buffer"):
        return None
    return (f"{manifest.form}-form graphs run at their compiled sizes only: replay a curve measured on the device "
            "with 'dflash-onnx calibrate DIR --from FILE'")


def deepest(manifest: Manifest) -> int:
    """The deepest context a cost curve is measured at: what a lowering's buffers hold besides a block and the
    draft's block after it; an export (its K/V fed as inputs, no bound) up to EXPORT_DEEPEST."""
    return manifest.ctx_len - 2 * manifest.block_size if manifest.ctx_len else EXPORT_DEEPEST


def depth_contexts(manifest: Manifest, context: int) -> list[int]:
    """The deeper contexts a curve is measured at besides `context`: DEPTHS, each cut to `deepest`, dropping any
    within a quarter of the one before."""
    chosen: list[int] = []
    for depth in DEPTHS:
        depth = min(depth, deepest(manifest))
        if depth > 1.25 * max([context, *chosen]):
            chosen.append(depth)
    return chosen


def measure_costs(manifest: Manifest, open_graph: Callable[[str], Session], context: int = 256, repeats: int = 10,
                  source: str = "", depths: Sequence[int] = ()) -> CostModel:
    """t(T) for T = 1..block_size and the draft step, at `context` tokens of K/V and at each of `depths` (the
    curve's context axis, CostModel.deeper), every length at every context once per round. `open_graph("target")`
    and `open_graph("draft")` are called in turn and each session dropped before the next opens, so the peak
    memory is the larger graph's, not the pair's (each is timed alone either way)."""
    reason = measurable(manifest)
    if reason is not None:
        raise DFlashError(reason)
    contexts, rows = [context, *depths], manifest.verify_rows
    target = open_graph("target")
    verify = interleaved_min_ms(target, [target_feeds(manifest, c, t) for c in contexts for t in range(1, rows + 1)],
                                TARGET_OUTPUTS, repeats)
    del target
    drafting = interleaved_min_ms(open_graph("draft"), [draft_feeds(manifest, c) for c in contexts], DRAFT_OUTPUTS,
                                  repeats)
    # verifying more tokens never costs less: timing noise that says so is averaged away
    curves = [([round(float(v), 4) for v in isotonic(verify[i * rows:(i + 1) * rows])], round(drafting[i], 4))
              for i in range(len(contexts))]
    deeper = [{"context": int(c), "verify_ms": v, "draft_ms": d} for c, (v, d) in zip(depths, curves[1:])]
    return CostModel(curves[0][0], curves[0][1], context, source, deeper)


def read_costs(path: Path, block_size: int) -> CostModel:
    """A cost curve from a JSON file ({"verify_ms": [t(1), ..., t(B)], "draft_ms": d}), to replay here."""
    try:
        raw = json.loads(Path(path).read_text())
        costs = CostModel(verify_ms=[float(v) for v in raw["verify_ms"]], draft_ms=float(raw["draft_ms"]),
                          context=int(raw.get("context", 0)), source=str(path),
                          deeper=[{"context": int(c["context"]), "verify_ms": [float(v) for v in c["verify_ms"]],
                                   "draft_ms": float(c["draft_ms"])} for c in raw.get("deeper", [])])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise DFlashError(f"--cost-model {path}: give a JSON object with verify_ms (milliseconds for T = 1.."
                          f"{block_size}) and draft_ms, and optionally context and deeper (the same at deeper "
                          f"contexts, rising) ({exc})") from None
    if len(costs.verify_ms) < block_size:
        raise DFlashError(f"--cost-model {path}: verify_ms has {len(costs.verify_ms)} entries, the block needs "
                          f"{block_size}")
    return costs
