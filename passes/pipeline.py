"""Apply registered passes to an exported directory, writing a complete new one with a report."""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import onnx_ir as ir

from dflash_onnx.artifacts.graph_files import checked_graph, graph_io, share_initializers
from dflash_onnx.artifacts.progress import Stages
from dflash_onnx.artifacts.publish import check_out_dir, copy_tokenizer_files, staged_directory
from dflash_onnx.passes import registry
from dflash_onnx.passes.base import GraphPass, PassContext
from dflash_onnx.passes.calibration import OpenGraph, record_feeds
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import GraphSpec, Manifest, load_export

# memory counted for a pass that reads every weight (GraphPass.loads_weights), over the source's bytes
# (docs/passes.md#what-the-pipeline-checks-first)
LOADED_PASS_MEMORY = 1.3
DISK_MARGIN = 1.1  # free space counted over the bytes the passes are expected to write


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


def _size(model: ir.Model) -> int:
    """Bytes of the initializers, from shapes and dtypes (mapped weights are not read)."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def select_passes(names: list[str], lowering: str | None) -> list[GraphPass]:
    """The registered passes `names`, in order; a lowering's own rewrites only for that lowering."""
    passes = registry()
    unknown = [n for n in names if n not in passes]
    if unknown or not names:
        public = [n for n, p in passes.items() if not p.lowerings]
        raise DFlashError(f"unknown passes {unknown or names}: choose from {', '.join(public)}")
    foreign = [n for n in names if passes[n].lowerings and lowering not in passes[n].lowerings]
    if foreign:
        first, *others = passes[foreign[0]].lowerings
        also = "".join(f" (and --target {o})" for o in others)
        raise DFlashError(f"{', '.join(foreign)}: applied by 'dflash-onnx lower --target {first}'{also}, "
                          "not on their own")
    return [passes[n] for n in names]


def _run_graph(path: Path, spec: GraphSpec, context: dict, chosen: list[GraphPass], pass_options: dict,
               stages: Stages) -> tuple[ir.Model, list[dict]]:
    """Every pass on one graph, loaded with its weights memory-mapped; returns the model and report rows."""
    checked_graph(path)  # its external data stays beside it, before onnx-ir maps it
    model, rows = ir.load(str(path)), []
    for graph_pass in chosen:
        options = {**pass_options.get("*", {}), **pass_options.get(graph_pass.name, {})}
        before_nodes, before_bytes = len(model.graph), _size(model)
        started = time.perf_counter()
        model, details = graph_pass.run(model, PassContext(pass_name=graph_pass.name, options=options, **context))
        stages.done(f"{graph_pass.name} on the {context['graph']}", time.perf_counter() - started)
        if graph_pass.loads_weights:
            gc.collect()  # its protobuf and IR copies of the weights are reference cycles: free them now
        row = {"pass": graph_pass.name, "graph": context["graph"], "nodes_before": before_nodes,
               "nodes_after": len(model.graph), "bytes_before": before_bytes, "bytes_after": _size(model),
               "seconds": round(time.perf_counter() - started, 3), "details": details}
        rows.append(row)
        for warning in details.get("warnings", []):
            print(f"warning: {graph_pass.name}: {warning}", file=sys.stderr)
    return model, rows


def apply_pipeline(source: Path, names: list[str], out: Path, pass_options: dict[str, dict] | None = None,
                   overwrite: bool = False, progress: bool = True, lowering: str | None = None, *,
                   manifest: Manifest | None = None, open_graph: OpenGraph | None = None
                   ) -> tuple[Manifest, list[dict]]:
    """Run `names` in order on both graphs of the export in `source`; write `out` (atomically) with
    passes_report.json. The manifest returned describes the graphs written (their inputs and outputs read back
    from the files). `lowering` names the backend whose own rewrites may run; `manifest` is the source's, where
    the caller has read it already (`load_export`); `open_graph` opens the source's graphs, on which calibrated
    passes record decoding inputs."""
    chosen = select_passes(names, lowering)
    manifest = manifest or load_export(source, "run passes on")
    out = Path(out)
    check_out_dir(out, (Path(source),), overwrite)
    pass_options = pass_options or {}
    report: list[dict] = []
    source_bytes = sum(p.stat().st_size for p in Path(source).glob("*.onnx*"))
    memory = int(LOADED_PASS_MEMORY * source_bytes) if any(p.loads_weights for p in chosen) else 0
    written = source_bytes * math.prod(p.written_ratio for p in chosen)
    with staged_directory(out, (Path(source),), overwrite, int(DISK_MARGIN * written), memory) as tmp:
        feeds = {}
        if any(p.calibrated for p in chosen):
            if progress:
                print("recording calibration inputs (DFlash on random prompts)", file=sys.stderr)
            if open_graph is None:
                raise ValueError(f"{[p.name for p in chosen if p.calibrated]}: calibrated passes need open_graph")
            feeds = record_feeds(manifest, open_graph)
        specs = {}
        stages = Stages(2 * len(chosen), enabled=progress)
        for graph in ("target", "draft"):
            spec = getattr(manifest, graph)
            context = {"graph": graph, "manifest": manifest, "calibration_feeds": feeds.get(graph)}
            model, rows = _run_graph(Path(source) / spec.file, spec, context, chosen, pass_options, stages)
            report += rows
            # written tensor by tensor, mapped weights straight from the source file
            ir.save(model, str(tmp / spec.file), external_data=f"{spec.file}.data", size_threshold_bytes=1024)
            del model
            gc.collect()
            inputs, outputs = graph_io(tmp / spec.file)
            specs[graph] = replace(spec, inputs=inputs, outputs=outputs)
        share_initializers(tmp, manifest.draft.file, manifest.target.file, manifest.vocab_size)
        copy_tokenizer_files(source, tmp)
        applied = [{"name": p.name, "options": {**p.recorded_defaults, **pass_options.get("*", {}),
                                                **pass_options.get(p.name, {})},
                    "bound": p.bound, "lossy": p.lossy} for p in chosen]
        # other graphs now, fed at their K/V's precision (fp32 widens a bfloat16 export)
        result = replace(manifest, passes=[*manifest.passes, *applied], costs=None, dtype=specs["target"].kv_dtype,
                         **specs)
        result.save(tmp)
        (tmp / "passes_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return result, report
