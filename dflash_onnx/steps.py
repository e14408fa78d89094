"""`dflash-onnx steps`: median latency of the three calls a DFlash round makes, for several exported
directories side by side (round-robin, so machine noise hits all of them alike).

ONNX Runtime for exports, MLX for MLX lowerings. decode = target on 1 token, verify = target on
block_size tokens, draft = one draft step with block_size new context rows; all at `context` tokens of
K/V. Used to measure what a graph pass or a backend buys.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx

from .errors import DFlashError
from .manifest import Manifest, load_manifest


def _kv(manifest: Manifest, graph, context: int) -> dict[str, np.ndarray]:
    dtype = manifest.numpy_dtype
    rng = np.random.default_rng(0)  # random, not zeros: calloc'd zero pages would time page faults
    return {n: rng.standard_normal((1, context, graph.num_kv_heads, graph.head_dim)).astype(dtype)
            for n in graph.kv_inputs}


def target_feeds(manifest: Manifest, context: int, count: int) -> dict[str, np.ndarray]:
    """A target call on `count` new tokens after `context` tokens of K/V (concat form: the K/V are inputs;
    buffer form: the session holds them, the call passes the lengths)."""
    feeds = {"input_ids": np.full((1, count), 3, np.int64),
             "position_ids": np.arange(context, context + count, dtype=np.int64)[None]}
    if manifest.form == "buffer":
        total = context + count
        return {**feeds, "seqlens_k": np.array([total - 1], np.int32), "total_sequence_length": np.array(total, np.int32)}
    return {**feeds, **_kv(manifest, manifest.target, context)}


def draft_feeds(manifest: Manifest, context: int) -> dict[str, np.ndarray]:
    """A draft step with block_size new context rows after `context` cached ones (concat form)."""
    dtype = manifest.numpy_dtype
    block, features = manifest.block_size, manifest.num_taps * manifest.target_hidden_size
    return {"input_ids": np.full((1, block), manifest.mask_token_id, np.int64),
            "target_hidden": np.random.default_rng(1).standard_normal((1, block, features)).astype(dtype),
            "position_ids": np.arange(context, context + 2 * block, dtype=np.int64)[None],
            **_kv(manifest, manifest.draft, context)}


def _feeds(manifest: Manifest, context: int) -> dict[str, dict[str, np.ndarray]]:
    return {"decode": target_feeds(manifest, context, 1), "verify": target_feeds(manifest, context, manifest.block_size),
            "draft": draft_feeds(manifest, context)}


def _size_and_nodes(directory: Path, manifest: Manifest) -> tuple[float, int, int]:
    size = sum(p.stat().st_size for p in directory.iterdir() if p.suffix in (".onnx", ".data", ".safetensors"))
    nodes = [len(onnx.load(str(directory / g.file), load_external_data=False).graph.node)
             for g in (manifest.target, manifest.draft)]
    return size / 2**20, nodes[0], nodes[1]


def measure(directories: list[Path], context: int = 256, repeats: int = 20) -> list[dict]:
    """Median milliseconds per call kind for each directory (concat-form exports)."""
    from targets import open_session

    runs = []
    for directory in directories:
        manifest = load_manifest(directory)
        if manifest.form not in ("concat", "buffer"):
            raise DFlashError(f"{directory}: steps measures exports and their ORT and MLX lowerings")
        backend = "mlx" if manifest.lowering.get("target") == "mlx" else "ort"
        sessions = {"target": open_session(directory, manifest, "target", backend),
                    "draft": open_session(directory, manifest, "draft", backend)}
        runs.append((Path(directory), manifest, sessions, _feeds(manifest, context), {"decode": [], "verify": [],
                                                                                      "draft": []}))
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for _, _, sessions, feeds, times in runs:
            for kind, feed in feeds.items():
                session = sessions["draft" if kind == "draft" else "target"]
                started = time.perf_counter()
                session.run(feed, ["draft_ids"] if kind == "draft" else ["greedy_ids", "target_hidden"])
                times[kind].append(time.perf_counter() - started)
    rows = []
    for directory, manifest, _, _, times in runs:
        size, target_nodes, draft_nodes = _size_and_nodes(directory, manifest)
        medians = {kind: 1000 * float(np.median(values[1:])) for kind, values in times.items()}
        backend = "mlx" if manifest.lowering.get("target") == "mlx" else "ort"
        rows.append({"directory": str(directory), "backend": backend,
                     "passes": [p["name"] for p in manifest.passes], "size_mib": size,
                     "target_nodes": target_nodes, "draft_nodes": draft_nodes, "context": context,
                     "block_size": manifest.block_size, **{f"{k}_ms": v for k, v in medians.items()},
                     "verify_over_decode": medians["verify"] / medians["decode"]})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'directory':<28} {'passes':<16} {'MiB':>9} {'nodes t/d':>11} {'decode ms':>10} "
             f"{'verify ms':>10} {'draft ms':>9} {'verify/decode':>14}"]
    for r in rows:
        lines.append(f"{Path(r['directory']).name:<28} {','.join(r['passes']) or '-':<16} {r['size_mib']:>9.1f} "
                     f"{r['target_nodes']:>5}/{r['draft_nodes']:<5} {r['decode_ms']:>10.2f} {r['verify_ms']:>10.2f} "
                     f"{r['draft_ms']:>9.2f} {r['verify_over_decode']:>14.2f}")
    return "\n".join(lines)
