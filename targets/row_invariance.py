"""The smallest row multiple that makes a lowered target batch-invariant, measured at lowering (ORT, MLX).

A token's logits should not depend on how many rows its call had: a decode step has 1, a DFlash verify step
up to block_size. ONNX Runtime's CPU matmuls (MLAS, float and int4 with int8 activations alike) run rows in
pairs and give a lone odd row a kernel that rounds differently; then greedy and DFlash can pick different
tokens where the top two logits nearly tie. For each candidate multiple this runs a block of rows once as one
call and once in calls of 1, 3, 2, ... rows (each padded to the multiple, runners.py), after a short and a
longer context (kernels change with the context: a float16 int4 Qwen3-4B-shaped target agreed after 20 tokens
and differed by 1.7 % of its logit scale after 64), and keeps the smallest multiple whose rows agree bit for
bit at every one. A backend's lowering records the result (Lowering.row_multiple and
report["batch_invariance"]) and warns when no candidate makes the rows agree."""

from __future__ import annotations

import sys

import numpy as np

from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.runtime.runners import open_runners
from dflash_onnx.runtime.session import Session

CANDIDATES = (1, 2, 4, 8)
CONTEXTS = (20, 300)  # committed context before the block: within one prefill chunk, and past one
PREFILL_CHUNK = 256
# the token ids come from the first ID_RANGE of the vocabulary: which embedding rows the calls read changes no
# kernel choice, and a narrow range keeps the pages of the memory-mapped embedding the lowering touches few
# (docs/large-models.md#where-an-ort-sessions-memory-goes)
ID_RANGE = 1024


def _call_sizes(rows: int) -> list[int]:
    """Uneven call sizes that add up to `rows`: odd sizes and odd offsets, as a DFlash run produces them."""
    sizes, pattern = [], (1, 3, 2, 1, 4, 5)
    while sum(sizes) < rows:
        sizes.append(min(pattern[len(sizes) % len(pattern)], rows - sum(sizes)))
    return sizes


def _difference(manifest: Manifest, session: Session, multiple: int, ids: np.ndarray, context: int) -> float:
    """After one prefill of ids[:context], the rows of ids[context:] as one call and, rolled back, in uneven
    calls, each padded to `multiple` rows: their largest difference relative to the largest |value| (logits,
    or the hidden features where the graph returns no logits)."""
    runner, _ = open_runners(manifest, session, None, PREFILL_CHUNK, multiple)
    runner.forward(ids[:context])
    logits = "logits" in manifest.target.output_names()
    results = []
    for sizes in ([len(ids) - context], _call_sizes(len(ids) - context)):
        runner.commit(context)  # rollback is a length change: the prefix is shared
        parts, start = [], context
        for size in sizes:
            out = runner.forward(ids[start : start + size], size if logits else 0)
            parts.append(np.array(out.logits if logits else out.context))
            start += size
            runner.commit(start)
        results.append(np.concatenate(parts))
    whole, split = results
    return float(np.abs(split.astype(np.float64) - whole).max()) / max(float(np.abs(whole).max()), 1e-30)


def _contexts(manifest: Manifest) -> list[int]:
    room = int(manifest.ctx_len) - manifest.block_size - max(CANDIDATES) if manifest.ctx_len else max(CONTEXTS)
    return sorted({min(c, max(1, room)) for c in CONTEXTS})


def fewest_calls(manifest: Manifest) -> int:
    """The target calls measure_row_multiple makes at least (the first candidate agreeing at every context)."""
    split = len(_call_sizes(manifest.block_size))
    return sum(-(-context // PREFILL_CHUNK) + 1 + split for context in _contexts(manifest))


def measure_row_multiple(manifest: Manifest, session: Session) -> dict:
    """{"row_multiple": the smallest candidate whose rows agree exactly (1 when none does), "invariant":
    whether one did, "differences": largest difference per candidate relative to the largest |value|}."""
    block, contexts = manifest.block_size, _contexts(manifest)
    ids = np.random.default_rng(0).integers(0, min(manifest.vocab_size, ID_RANGE), max(contexts) + block)
    differences, chosen = {}, None
    for multiple in CANDIDATES:
        worst = 0.0
        for context in contexts:
            worst = max(worst, _difference(manifest, session, multiple, ids[: context + block], context))
            if worst > 0.0:
                break
        differences[str(multiple)] = worst
        if worst == 0.0:
            chosen = multiple
            break
    return {"row_multiple": chosen or 1, "invariant": chosen is not None, "contexts": contexts,
            "differences": differences}


def record_row_multiple(manifest: Manifest, session: Session) -> None:
    """Measure on `session` (the lowered target) and record in `manifest.lowering`; warn when none agrees."""
    measured = measure_row_multiple(manifest, session)
    manifest.lowering.row_multiple = measured["row_multiple"]
    manifest.lowering.report["batch_invariance"] = measured
    if not measured["invariant"]:
        print("warning: no call padding made the target's rows independent of the call's size "
              f"({measured['differences']}): greedy and DFlash may pick different tokens where logits nearly "
              "tie", file=sys.stderr)
