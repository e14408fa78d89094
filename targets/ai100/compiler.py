"""What `qaic-compile` takes: named specializations, the retained K/V's precision, the command lines, and
graphs it accepts (standard ONNX ops at the opset it reads)."""

from __future__ import annotations

import shlex
from pathlib import Path

import onnx

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import Manifest

from .options import Ai100Options


def specializations(manifest: Manifest, options: Ai100Options) -> dict[str, dict]:
    """Named specializations per graph; the symbols are the graphs' dynamic dims (string values)."""
    def entry(name: str, seq_len: int) -> dict:
        return {"name": name, "symbols": {"batch_size": "1", "seq_len": str(seq_len), "ctx_len": str(options.ctx_len)}}

    return {
        "target": {"specializations": [entry("prefill", options.prefill_len),
                                       entry("verify", manifest.block_size)]},
        "draft": {"specializations": [entry("step", manifest.block_size),
                                      entry("ingest", options.prefill_len)]},
    }


def custom_io_yaml(kv_inputs: list[str], kv_outputs: list[str], precision: str) -> str:
    lines = []
    for name in [n for pair in zip(kv_inputs, kv_outputs) for n in pair]:
        lines += [f"- IOName: {name}", f"  Precision: {precision}", ""]
    return "\n".join(lines)


def compile_commands(compiler: list[str], options: Ai100Options) -> list[list[str]]:
    commands = []
    for graph in ("target", "draft"):
        command = [*compiler, "-aic-hw", "-aic-hw-version=ai100", f"-m={graph}.onnx", "-retained-state",
                   "-convert-to-fp16"]
        if options.mxfp6_matmul:
            command.append("-mxfp6-matmul")
        command += [f"-aic-num-cores={options.num_cores}",
                    f"-network-specialization-config={graph}_specializations.json",
                    f"-custom-IO-list-file={graph}_custom_io.yaml", f"-aic-binary-dir=qpc/{graph}"]
        commands.append(command)
    return commands


def compile_script(commands: list[list[str]]) -> str:
    body = "\n".join(shlex.join(c) for c in commands)
    return ("#!/usr/bin/env bash\n# Compile both graphs for Cloud AI 100 (run where the Qualcomm SDK is installed).\n"
            f"set -euo pipefail\ncd \"$(dirname \"$0\")\"\n{body}\n")


def check_graph(path: Path, opset: int) -> dict:
    """Standard-domain ops only, within the opset; returns node counts for the report."""
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    domains = {n.domain for n in model.graph.node} - {"", "ai.onnx"}
    if domains:
        raise DFlashError(f"{path.name} uses ops outside the standard ONNX domain: {sorted(domains)}")
    versions = {o.domain: o.version for o in model.opset_import}
    if versions.get("", versions.get("ai.onnx")) != opset:
        raise DFlashError(f"{path.name} imports opset {versions}, expected {opset}")
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return {"nodes": len(model.graph.node), "scatters": counts.get("ScatterND", 0), "ops": counts}
