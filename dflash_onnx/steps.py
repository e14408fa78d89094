"""`dflash-onnx steps`: median latency of the three calls a DFlash round makes, for several exported
directories side by side (round-robin, so machine noise hits all of them alike).

Each directory runs on its own backend (ONNX Runtime for exports and ORT lowerings, MLX for MLX lowerings).
decode = target on 1 token, verify = target on block_size tokens, draft = one draft step with block_size
new context rows; all at `context` tokens of K/V. Used to measure what a graph pass or a backend buys.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx

from dflash_onnx.figures import markdown_table, provenance
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.feeds import draft_feeds, target_feeds
from dflash_onnx.runtime.manifest import Manifest, load_manifest
from dflash_onnx.targets import backend_for, open_session


def _feeds(manifest: Manifest, context: int) -> dict[str, dict[str, np.ndarray]]:
    return {"decode": target_feeds(manifest, context, 1),
            "verify": target_feeds(manifest, context, manifest.block_size),
            "draft": draft_feeds(manifest, context)}


def _size_and_nodes(directory: Path, manifest: Manifest) -> tuple[float, int, int]:
    size = sum(p.stat().st_size for p in directory.iterdir() if p.suffix in (".onnx", ".data", ".safetensors"))
    nodes = [len(onnx.load(str(directory / g.file), load_external_data=False).graph.node)
             for g in (manifest.target, manifest.draft)]
    return size / 2**20, nodes[0], nodes[1]


def measure(directories: list[Path], context: int = 256, repeats: int = 20) -> list[dict]:
    """Median milliseconds per call kind for each directory (exports, ORT and MLX lowerings)."""
    runs = []
    for directory in directories:
        manifest = load_manifest(directory)
        if manifest.form not in ("concat", "buffer"):
            raise DFlashError(f"{directory}: steps measures exports and their ORT and MLX lowerings")
        backend = backend_for(directory, manifest).name
        sessions = {"target": open_session(directory, manifest, "target", backend),
                    "draft": open_session(directory, manifest, "draft", backend)}
        runs.append((Path(directory), manifest, backend, sessions, _feeds(manifest, context),
                     {"decode": [], "verify": [], "draft": []}))
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for _, _, _, sessions, feeds, times in runs:
            for kind, feed in feeds.items():
                session = sessions["draft" if kind == "draft" else "target"]
                started = time.perf_counter()
                session.run(feed, ["draft_ids"] if kind == "draft" else ["greedy_ids", "target_hidden"])
                times[kind].append(time.perf_counter() - started)
    rows = []
    for directory, manifest, backend, _, _, times in runs:
        size, target_nodes, draft_nodes = _size_and_nodes(directory, manifest)
        medians = {kind: 1000 * float(np.median(values[1:])) for kind, values in times.items()}
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


def markdown(rows: list[dict], command: list[str]) -> str:
    """The same figures as docs/ prints them (ms per call), with the line naming `command`, date and machine."""
    body = [[f"`{Path(r['directory']).name}`", ", ".join(r["passes"]) or "-",
             f"{r['target_nodes']} / {r['draft_nodes']}", f"{r['decode_ms']:.2f}", f"{r['verify_ms']:.2f}",
             f"{r['draft_ms']:.2f}", f"{r['verify_over_decode']:.2f}"] for r in rows]
    context, block = rows[0]["context"], rows[0]["block_size"]
    header = ["directory", "passes", "nodes target / draft", "decode", f"verify ({block})", "draft", "verify / decode"]
    return f"{markdown_table(header, body)}\n\nms per call at a context of {context} tokens. {provenance(command)}"

