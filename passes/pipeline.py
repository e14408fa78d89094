"""Apply registered passes to an exported directory, writing a complete new one with a report."""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import onnx
import onnx_ir as ir

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import Manifest, load_export

from . import registry
from .calibration import record_feeds


def parse_pass_options(items: list[str]) -> dict[str, dict]:
    """`int4.block_size=64` -> {"int4": {"block_size": "64"}}; `block_size=64` applies to every pass."""
    options: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DFlashError(f"--pass-option {item!r} must look like NAME.KEY=VALUE or KEY=VALUE")
        name, _, option = key.rpartition(".")
        options.setdefault(name or "*", {})[option] = value
    return options


def _size(model: onnx.ModelProto | ir.Model) -> int:
    if isinstance(model, ir.Model):  # from shapes and dtypes: mapped weights are not read
        return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    return sum(len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def _nodes(model: onnx.ModelProto | ir.Model) -> int:
    return len(model.graph) if isinstance(model, ir.Model) else len(model.graph.node)


def apply_pipeline(source: Path, names: list[str], out: Path, pass_options: dict[str, dict] | None = None,
                   overwrite: bool = False, progress: bool = True) -> tuple[Manifest, list[dict]]:
    """Run `names` in order on both graphs of `source`; write `out` (atomically) with passes_report.json."""
    from dflash_onnx.export import (
        check_out_dir,
        copy_tokenizer_files,
        publish_dir,
        share_initializers,
    )

    passes = registry()
    unknown = [n for n in names if n not in passes]
    if unknown or not names:
        raise DFlashError(f"unknown passes {unknown or names}: choose from {', '.join(passes)}")
    manifest = load_export(source, "run passes on")
    out = Path(out)
    check_out_dir(out, (Path(source),), overwrite)
    pass_options = pass_options or {}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    report = []
    try:
        feeds = {}
        if any(passes[n].calibrated for n in names):
            if progress:
                print("recording calibration inputs (DFlash on random prompts)", file=sys.stderr)
            feeds = record_feeds(Path(source))
        # structure-only passes run on the graph with its weights memory-mapped, not read into memory
        mapped = all(passes[n].run_ir is not None for n in names)
        for graph in ("target", "draft"):
            spec = getattr(manifest, graph)
            path = Path(source) / spec.file
            model = ir.load(str(path)) if mapped else onnx.load(str(path))
            for name in names:
                options = {**pass_options.get("*", {}), **pass_options.get(name, {}),
                           "vocab_size": manifest.vocab_size, "calibration_feeds": feeds.get(graph)}
                before_nodes, before_bytes = _nodes(model), _size(model)
                started = time.perf_counter()
                if mapped:
                    details = passes[name].run_ir(model, graph, options)
                else:
                    model, details = passes[name].run(model, graph, options)
                    gc.collect()  # the pass's IR graph (reference cycles) still holds a model-sized copy
                row = {"pass": name, "graph": graph, "nodes_before": before_nodes, "nodes_after": _nodes(model),
                       "bytes_before": before_bytes, "bytes_after": _size(model),
                       "seconds": round(time.perf_counter() - started, 3), "details": details}
                report.append(row)
                for warning in details.get("warnings", []):
                    print(f"warning: {name}: {warning}", file=sys.stderr)
                if progress:
                    print(f"{name:>8} {graph:<6} nodes {before_nodes:>6} -> {row['nodes_after']:<6} "
                          f"MiB {before_bytes / 2**20:8.2f} -> {row['bytes_after'] / 2**20:<8.2f}", file=sys.stderr)
            if mapped:  # written tensor by tensor from the mapped source
                ir.save(model, str(tmp / spec.file), external_data=f"{spec.file}.data", size_threshold_bytes=1024)
            else:
                onnx.save_model(model, str(tmp / spec.file), save_as_external_data=True,
                                all_tensors_to_one_file=True, location=f"{spec.file}.data", size_threshold=1024)
            del model
            gc.collect()
        share_initializers(tmp, manifest.draft.file, manifest.target.file, manifest.vocab_size)
        copy_tokenizer_files(source, tmp)
        applied = [{"name": n, "options": {**pass_options.get("*", {}), **pass_options.get(n, {})},
                    "bound": passes[n].bound, "lossy": passes[n].lossy} for n in names]
        result = replace(manifest, passes=[*manifest.passes, *applied])
        result.save(tmp)
        (tmp / "passes_report.json").write_text(json.dumps(report, indent=2) + "\n")
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result, report
