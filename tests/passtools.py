"""Running one pass on a hand-made protobuf graph, as the pipeline runs it on an exported one."""

from __future__ import annotations

import onnx
import onnx_ir as ir
from fakes import make_manifest

from dflash_onnx.passes import PassContext


def apply_pass(run, model: onnx.ModelProto, graph: str = "target", options: dict | None = None,
               feeds: list | None = None, vocab_size: int = 32) -> tuple[onnx.ModelProto, dict]:
    """`run` (a pass function) on `model` as graph `graph`; the model comes back as a protobuf."""
    context = PassContext(pass_name=run.__module__, graph=graph, manifest=make_manifest(vocab_size=vocab_size),
                          options=options or {}, calibration_feeds=feeds)
    result, details = run(ir.from_proto(model), context)
    return ir.to_proto(result), details


def on_ort(directory):
    """How the CLI hands calibrated passes an export's graphs: its sessions on ONNX Runtime, via the registry."""
    from dflash_onnx.runtime.manifest import load_manifest
    from dflash_onnx.targets import open_session

    manifest = load_manifest(directory)
    return lambda graph: open_session(directory, manifest, graph, "ort")
