"""What `qaic-compile` takes, as QEfficient writes it: specializations (named, and flat for older SDKs), the
retained K/V's precision (custom IO), the nodes kept in float32 (node precision info), the multi-device
partition, the command lines, and compile.sh, which finds the SDK and runs them."""

from __future__ import annotations

import shlex
from pathlib import Path

import onnx

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.ai100.options import Ai100Options

GRAPHS = ("target", "draft")
SDK_EXEC = "/opt/qti-aic/exec"
QAIC_UTIL = "/opt/qti-aic/tools/qaic-util"


def smallest_covering(lengths: list[int], needed: int) -> int:
    """The compute-context length a call whose last row sits at position needed - 1 reads."""
    for length in lengths:
        if length >= needed:
            return length
    raise DFlashError(f"a context of {needed} positions exceeds the largest compute-context length {lengths[-1]}")


def specializations(manifest: Manifest, options: Ai100Options) -> dict[str, list[tuple[str, dict[str, str]]]]:
    """(name, symbols) per graph: each call size at each compute-context length; symbols are the graphs' dynamic
    dims, as strings."""
    rows = manifest.verify_rows  # a verify's tokens, and the context rows the draft's next step ingests
    sizes = {"target": (("prefill", options.prefill_len), ("verify", rows)),
             "draft": (("ingest", options.prefill_len), ("step", rows))}
    return {graph: [(f"{name}_ccl{ccl}", {"batch_size": "1", "seq_len": str(seq_len), "ctx_len": str(options.ctx_len),
                                          "comp_ctx_lengths": str(ccl)})
                    for name, seq_len in sizes[graph] for ccl in options.compute_context_lengths()]
            for graph in GRAPHS}


def named_specializations(specs: list[tuple[str, dict[str, str]]]) -> dict:
    return {"specializations": [{"name": name, "symbols": symbols} for name, symbols in specs]}


def flat_specializations(specs: list[tuple[str, dict[str, str]]]) -> dict:
    """The format SDKs before named specializations read."""
    return {"specializations": [dict(symbols) for _, symbols in specs]}


def custom_io_yaml(kv_inputs: list[str], kv_outputs: list[str], precision: str) -> str:
    lines = []
    for name in [n for pair in zip(kv_inputs, kv_outputs) for n in pair]:
        lines += [f" - IOName: {name}", f"   Precision: {precision}", ""]
    return "\n".join(lines)


def node_precision_yaml(fp32_outputs: list[str]) -> str:
    """-node-precision-info: the nodes (named by their output tensors) the compiler keeps in float32."""
    return "FP32NodeInstanceNames:\n" + "".join(f"  - {name}\n" for name in fp32_outputs)


def partition_config(num_devices: int, cores: int) -> dict:
    """-mdp-load-partition-config for one program tensor-sliced over `num_devices` devices (logical ids; the
    session maps them to the physical ones)."""
    return {"connections": [{"devices": list(range(num_devices)), "type": "p2p"}],
            "partitions": [{"name": "Partition0",
                            "devices": [{"deviceId": d, "numCores": cores} for d in range(num_devices)]}]}


def compile_flags(graph: str, options: Ai100Options) -> list[str]:
    """Flags between -m and the specializations, in QEfficient's order."""
    cores = options.target_cores if graph == "target" else options.draft_cores
    flags = ["-retained-state", "-convert-to-fp16"]
    if options.mxfp6_matmul == "on":
        flags.append("-mxfp6-matmul")
    flags.append(f"-aic-num-cores={cores}")
    if options.mos:
        flags.append(f"-mos={options.mos}")
    flags.append(f"-node-precision-info={graph}_npi.yaml")
    if graph == "target" and len(options.target_device_ids) > 1:
        flags.append("-mdp-load-partition-config=target_mdp.json")
    return flags


def compile_commands(options: Ai100Options, compiler: str = "qaic-compile", hw_version: str | None = None,
                     flat: bool = False) -> list[list[str]]:
    """The command per graph, as compile.sh runs it (for reports and tests)."""
    hw = hw_version or (options.hw_version if options.hw_version != "auto" else "ai100")
    suffix = "_flat" if flat else ""
    return [[*shlex.split(compiler), "-aic-hw", f"-aic-hw-version={hw}", f"-m={graph}.onnx",
             *compile_flags(graph, options), f"-network-specialization-config={graph}_specializations{suffix}.json",
             f"-custom-IO-list-file={graph}_custom_io.yaml", f"-aic-binary-dir=qpc/{graph}"] for graph in GRAPHS]


SCRIPT = """#!/usr/bin/env bash
# Compiles target.onnx and draft.onnx for Cloud AI 100 into qpc/target and qpc/draft (written by dflash-onnx
# lower --target ai100, which runs it when it finds the compiler). Run it where the Cloud AI 100 Apps SDK is.
#   QAIC_COMPILE   the compiler command (default: qaic-compile on PATH or in {sdk}, else qaic-exec -compile-only)
#   AIC_HW_VERSION ai100 or ai200 (default: {hw_default})
set -euo pipefail
cd "$(dirname "$0")"

find_compiler() {{
  if [ -n "${{QAIC_COMPILE:-}}" ]; then echo "$QAIC_COMPILE"; return; fi
  local name
  for name in qaic-compile {sdk}/qaic-compile; do
    if command -v "$name" >/dev/null 2>&1; then echo "$name"; return; fi
  done
  for name in qaic-exec {sdk}/qaic-exec; do
    if command -v "$name" >/dev/null 2>&1; then echo "$name -compile-only"; return; fi
  done
  echo "compile.sh: qaic-compile not found (PATH, {sdk}): install the Cloud AI 100 Apps SDK or set QAIC_COMPILE" >&2
  exit 127
}}

hw_version() {{  # the card's hardware version
  if [ -n "${{AIC_HW_VERSION:-}}" ]; then echo "$AIC_HW_VERSION"; return; fi
{hw_body}
}}

compiler_line=$(find_compiler)
read -r -a COMPILER <<< "$compiler_line"
HW=$(hw_version)
mkdir -p qpc

# compile GRAPH FLAGS...: named specializations; a compiler that rejects them gets the flat format
compile() {{
  local graph=$1 spec
  shift
  for spec in "${{graph}}_specializations.json" "${{graph}}_specializations_flat.json"; do
    rm -rf "qpc/$graph"
    if "${{COMPILER[@]}}" -aic-hw "-aic-hw-version=$HW" "-m=$graph.onnx" "$@" \\
        "-network-specialization-config=$spec" "-custom-IO-list-file=${{graph}}_custom_io.yaml" \\
        "-aic-binary-dir=qpc/$graph" >"qpc/$graph.log" 2>&1; then
      return 0
    fi
    grep -qi "specialization" "qpc/$graph.log" || break
    echo "compile.sh: $graph: the compiler rejected $spec; trying the flat format" >&2
  done
  echo "compile.sh: compiling $graph failed ("${{COMPILER[0]}}", qpc/$graph.log):" >&2
  tail -n 20 "qpc/$graph.log" >&2
  exit 1
}}

{commands}
echo "compiled: qpc/target qpc/draft"
"""

DETECT_HW = f"""  local util  # qaic-util reports the firmware variant
  util=$(command -v qaic-util || echo {QAIC_UTIL})
  if [ -x "$util" ] && "$util" -q 2>/dev/null | grep -q "AIC200"; then echo ai200; else echo ai100; fi"""


def compile_script(options: Ai100Options) -> str:
    fixed = options.hw_version != "auto"
    return SCRIPT.format(
        sdk=SDK_EXEC, hw_default=options.hw_version if fixed else "asked of qaic-util, else ai100",
        hw_body=f"  echo {options.hw_version}" if fixed else DETECT_HW,
        commands="\n".join(f"compile {graph} {shlex.join(compile_flags(graph, options))}" for graph in GRAPHS))


def check_graph(path: Path, opset: int) -> dict:
    """Standard-domain ops only, within the opset, no in-graph trigonometry; returns node counts for the report."""
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
    trig = {op: counts[op] for op in ("Cos", "Sin") if op in counts}
    if trig:
        raise DFlashError(f"{path.name} computes rotary angles in the graph ({trig}): float16 conversion would "
                          "lose positions; the rotary tables did not replace them")
    return {"nodes": len(model.graph.node), "scatters": counts.get("ScatterND", 0), "ops": counts}
