"""What every lowering does before it writes anything (lowering side: reads the export, not a runtime)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from dflash_onnx.artifacts.hub import checkpoints as hub_checkpoints
from dflash_onnx.artifacts.publish import check_out_dir, directory_bytes, staged_directory
from dflash_onnx.runtime.costs import TARGET_OUTPUTS, depth_contexts, measurable, measure_costs
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.feeds import target_feeds
from dflash_onnx.runtime.manifest import CostModel, Manifest, load_export
from dflash_onnx.runtime.session import Session
from dflash_onnx.targets.backend import LowerRequest
from dflash_onnx.targets.row_invariance import fewest_calls, record_row_multiple

COST_REPEATS = 5  # timed calls per step size in the lowering's cost curve
COST_CONTEXT = 256  # the context of the curve's first row; deeper ones follow (runtime/costs.py DEPTHS)
# the lowering's measurements are skipped when even their fewest calls would take longer than this: a Qwen3-4B-
# shaped float16 int4 MLX target on mlx[cpu] takes minutes per decode call (its quantized matmuls run row by row)
MEASUREMENT_BUDGET_S = 600.0


def start_lowering(source: Path, out: Path, options: Any, request: LowerRequest,
                   reexport: bool = False) -> tuple[Manifest, tuple[Path, Path] | None]:
    """What every lowering does first: read the export, check the options against it, find the checkpoints
    (`reexport`) and refuse an --out that exists or would replace an input. Returns the export's manifest
    and the (target, draft) checkpoint directories when asked for."""
    manifest = load_export(source, "lower")
    options.validate(manifest.block_size)
    checkpoints = hub_checkpoints(manifest, request.target_dir, request.draft_dir, progress=request.progress,
                                  flag="--{kind}-dir") if reexport else None
    check_out_dir(Path(out), (Path(source), *(checkpoints or ())), request.overwrite)
    return manifest, checkpoints


def refuse_unbuilt(manifest: Manifest, target: str, title: str) -> None:
    """One line for an export with layers this lowering has no form for yet: mixture-of-experts layers, K/V shaped
    or shared per layer (Gemma 4), or a hybrid target's linear-attention layers (the ORT lowering builds them all)."""
    if manifest.experts:
        experts = manifest.experts
        raise DFlashError(f"lower --target {target}: this {manifest.model_type} export has mixture-of-experts layers "
                          f"({experts['experts']} experts, {experts['per_token']} per token), which the {title} "
                          "lowering does not build yet; lower it with --target ort")
    varied = "K/V of different shapes per layer" if manifest.target.kv_shapes else ""
    shared = f"{manifest.kv_shared_layers} layers reading an earlier layer's K/V" if manifest.kv_shared_layers else ""
    if varied or shared:
        parts = " and ".join(part for part in (varied, shared) if part)
        raise DFlashError(f"lower --target {target}: this {manifest.model_type} export has {parts}, which the {title} "
                          "lowering does not build yet; lower it with --target ort")
    if manifest.target.recurrent:
        layers = len(manifest.target.recurrent.layers)
        raise DFlashError(f"lower --target {target}: this {manifest.model_type} export has {layers} Gated-DeltaNet "
                          f"linear-attention layers (conv and recurrent state beside the K/V), which the {title} "
                          "lowering does not build yet; lower it with --target ort")


def decode_seconds(manifest: Manifest, target: Session) -> float:
    """One decode call's wall time on the lowered `target`; a first call over a second (compiling included) is
    timed again."""
    feeds = target_feeds(manifest, 0, 1)
    for _ in range(2):
        started = time.perf_counter()
        target.run(feeds, TARGET_OUTPUTS)
        seconds = time.perf_counter() - started
        if seconds <= 1.0:
            break
    return seconds


def within_budget(seconds: float, calls: int, skipped: str, instead: str) -> bool:
    """Whether `calls` target calls of at least `seconds` each fit MEASUREMENT_BUDGET_S; if not, a warning that
    `skipped` is skipped, with both figures and what to do `instead`."""
    if seconds * calls <= MEASUREMENT_BUDGET_S:
        return True
    print(f"warning: {skipped} skipped: one decode call took {seconds:.1f} s here, so its {calls} calls would take "
          f"over {seconds * calls / 60:.0f} min; {instead}", file=sys.stderr)
    return False


def record_measurements(directory: Path, manifest: Manifest, open_session, progress: bool,
                        before_costs: Callable[[], None] | None = None, seconds: float | None = None) -> None:
    """Batch invariance, `before_costs` (the ORT lowering's spinning modes), then the cost curve of the lowered
    graphs in `directory`, recorded in `manifest`, unless their fewest calls times one decode call (`seconds`,
    timed here if not given; a call of more rows costs no less) would outlast MEASUREMENT_BUDGET_S."""
    target = open_session(directory, manifest, "target")
    seconds = decode_seconds(manifest, target) if seconds is None else seconds
    contexts = 1 + len(depth_contexts(manifest, COST_CONTEXT))
    calls = fewest_calls(manifest) + (COST_REPEATS + 1) * manifest.block_size * contexts
    if not within_budget(seconds, calls, "measuring batch invariance and the cost curve is",
                         "until they are measured, greedy and DFlash may pick different tokens where logits nearly "
                         "tie and --verify auto verifies full blocks: measure both on the machine that decodes "
                         "with 'dflash-onnx calibrate DIR'"):
        return
    if progress:
        print("measuring batch invariance (the target's rows in calls of each size)", file=sys.stderr)
    record_row_multiple(manifest, target)
    del target  # the sessions below hold the weights again, one at a time
    if before_costs is not None:
        before_costs()
    if progress:
        depths = ", ".join(str(c) for c in [COST_CONTEXT, *depth_contexts(manifest, COST_CONTEXT)])
        print(f"measuring the cost curve (target steps of 1..block tokens, a draft step; at {depths} tokens of "
              "context)", file=sys.stderr)
    manifest.costs = lowered_costs(directory, manifest, open_session)


def lowered_costs(directory: Path, manifest: Manifest, open_session, context: int = COST_CONTEXT,
                  repeats: int = COST_REPEATS) -> CostModel | None:
    """The cost curve of the lowered graphs in `directory`, measured on the backend they were lowered for (None
    for graphs that run at compiled sizes only: `calibrate --from FILE` replays a curve measured on the device)."""
    if measurable(manifest) is not None:
        return None
    if manifest.ctx_len:  # the buffers must hold the context, the block and the draft's block after it
        context = max(0, min(context, manifest.ctx_len - 2 * manifest.block_size))
    return measure_costs(manifest, lambda graph: open_session(Path(directory), manifest, graph), context=context,
                         repeats=repeats, source="lower", depths=depth_contexts(manifest, context))


def lowered_output(source: Path, out: Path, request: LowerRequest, checkpoints: tuple[Path, Path] | None = None,
                   size_factor: float = 1.1, memory_factor: float = 0.0,
                   extra_memory: int = 0, memory_hint: str = "", disk_bytes: int | None = None
                   ) -> AbstractContextManager[Path]:
    """The staging directory a lowering writes OUT into (published whole, OUT locked meanwhile), with the
    free space it needs taken as `size_factor` times the export's size (or `disk_bytes`, where the backend
    estimates it), and the memory (checked where the
    backend measured its peak) `memory_factor` times it plus `extra_memory` bytes (`memory_hint`: what the user can
    do when the machine has less)."""
    size = directory_bytes(Path(source))
    return staged_directory(Path(out), (Path(source), *(checkpoints or ())), request.overwrite,
                            int(size_factor * size) if disk_bytes is None else disk_bytes,
                            int(memory_factor * size) + extra_memory, memory_hint)
