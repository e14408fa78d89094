"""The ORT lowering's output check: the lowered graphs against the export on the same inputs, through the
same runners (so the buffer form's in-place K/V, rollback and the draft's rows are exercised).

Quantized matmuls (MatMulNBits, and the experts' QMoE) are compared computing in float (accuracy_level 0) on both
sides: with int8 activations (the int4/int8 passes' default, accuracy_level 4) a last-bit change in a matmul's
input moves its activations' int8 rounding, and a random-weight model amplifies that to percents of the logit
scale, which
would leave the check no tolerance a wrong rewrite could not pass. In float the lowering's rewrites may only
reorder arithmetic, so a quantized export is held to the same tolerance as its float dtype. (What the int8
kernels' rounding does to tokens is measured separately: row_invariance.py, and bench's agreement figures.)
A mixture-of-experts target's rows whose experts differ at a near tie of its router's logits are left out
(targets/check.py); the lowering reports how many.

A --kv-dtype int8 lowering is checked with its buffers in float (float_cache: the same graph, the quantization
taken off its GroupQueryAttentions), to the same tolerance; what the int8 cache changes is then measured against
that float cache through the same calls, and reported (lowering.report.kv_int8.max_relative_difference)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import onnx

from dflash_onnx.artifacts.graph_files import MOE_DOMAIN, MOE_OP, SWIGLU_MOE_OP
from dflash_onnx.passes.kv_buffer import SCALE_SLOT
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.check import Routers, compare_lowering
from dflash_onnx.targets.ort.session import OrtSession, open_session

# Largest difference allowed between lowered and exported graph outputs, relative to the largest |output|:
# ORT's fusions reorder float arithmetic, nothing more.
LOWERING_TOLERANCE = {"float32": 1e-4, "float16": 1e-2}


def float_accuracy(path: Path) -> onnx.ModelProto | None:
    """The graph at `path` (weights not loaded) with every MatMulNBits and QMoE computing in float
    (accuracy_level 0); None when it has none computing otherwise."""
    graph = onnx.load(str(path), load_external_data=False)
    changed = 0
    for node in graph.graph.node:
        if node.op_type in ("MatMulNBits", "QMoE") and node.domain == "com.microsoft":
            level = next((a for a in node.attribute if a.name == "accuracy_level"), None)
            if level is not None and level.i != 0:
                level.i, changed = 0, changed + 1
    return graph if changed else None


# ONNX Runtime runs a float16 node that its CPU provider has no float16 kernel for (a router's Gemm feeding TopK)
# in float32 between inserted casts, and saves its output under this prefix, in float32
WIDENED_PREFIX = "InsertedPrecisionFreeCast_"


def routers(path: Path, manifest: Manifest) -> Routers | None:
    """The export's mixture-of-experts routers, by their logits: the input of each dflash::MoE or
    dflash::SwigluMoE node, or, once the int4 pass made them QMoE, of the TopK that picks each row's experts (Gemma
    4's router's own, its indices gathered at the real rows);
    None for a dense target."""
    if manifest.experts is None:
        return None
    graph = onnx.load(str(path), load_external_data=False).graph
    producers = {name: node for node in graph.node for name in node.output}
    one_hot = set()
    for node in graph.node:
        if node.op_type == "OneHot":  # its indices, or the real rows' Gather of them (padding rows skipped)
            name = node.input[0]
            while name in producers and producers[name].op_type == "Gather":
                name = producers[name].input[0]
            one_hot.add(name)
    names = [node.input[1] for node in graph.node if node.domain == MOE_DOMAIN and node.op_type in (MOE_OP,
                                                                                                  SWIGLU_MOE_OP)]
    names += [node.input[0] for node in graph.node if node.op_type == "TopK" and node.output[1] in one_hot]
    return Routers(names, [manifest.dtype] * len(names), int(manifest.experts["per_token"]),
                   int(manifest.experts["experts"])) if names else None


def lowered_routers(exported: Routers, path: Path) -> Routers | None:
    """The same routers in the lowered graph at `path` (the value itself, or ONNX Runtime's float32 copy of it);
    None when one is not found."""
    produced = {name for node in onnx.load(str(path), load_external_data=False).graph.node for name in node.output}
    names, dtypes = [], []
    for name, dtype in zip(exported.names, exported.dtypes):
        found = next(((n, d) for n, d in ((name, dtype), (WIDENED_PREFIX + name, "float32")) if n in produced), None)
        if found is None:
            return None
        names.append(found[0])
        dtypes.append(found[1])
    return replace(exported, names=names, dtypes=dtypes)


def _structure(path: Path, outputs: list[str]) -> onnx.ModelProto | None:
    """float_accuracy's graph, also returning `outputs` (values inside the graph); None when neither changes it."""
    graph = float_accuracy(path)
    if not outputs:
        return graph
    graph = graph or onnx.load(str(path), load_external_data=False)
    graph.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in outputs)
    return graph


QUANTIZED_CACHE = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")
FLOAT_TYPES = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16}


def float_cache(graph: onnx.ModelProto, manifest: Manifest) -> onnx.ModelProto:
    """`graph`, the target of a --kv-dtype int8 lowering (`manifest`), with float K/V buffers of the graphs' dtype:
    each GroupQueryAttention without its quantization attributes and scales (changed in place, returned)."""
    for node in graph.graph.node:
        if node.op_type == "GroupQueryAttention" and any(a.name in QUANTIZED_CACHE for a in node.attribute):
            kept = [a for a in node.attribute if a.name not in QUANTIZED_CACHE]
            inputs = list(node.input[:SCALE_SLOT])
            while inputs and not inputs[-1]:
                inputs.pop()
            del node.attribute[:], node.input[:]
            node.attribute.extend(kept)
            node.input.extend(inputs)
    kv = {*manifest.target.kv_inputs, *manifest.target.kv_outputs}
    for value in (*graph.graph.input, *graph.graph.output):
        if value.name in kv:
            value.type.tensor_type.elem_type = FLOAT_TYPES[manifest.dtype]
    return graph


def with_float_cache(manifest: Manifest) -> Manifest:
    """`manifest` as float_cache's graph runs: K/V in the graphs' dtype."""
    return replace(manifest, target=manifest.target.with_kv_dtype(manifest.dtype))


def check_lowering(source: Path, exported: Manifest, directory: Path, manifest: Manifest) -> float:
    """Largest output difference of the lowered graphs in `directory` (`manifest`) against the export at
    `source` (`exported`), relative to the largest |output| (quantized matmuls computing in float on both
    sides, near-tie routing flips left out); refuses the lowering beyond LOWERING_TOLERANCE."""
    routing = routers(Path(source) / exported.target.file, exported)
    if routing is not None:
        found = lowered_routers(routing, Path(directory) / manifest.target.file)
        routing = (routing, found) if found else None

    def reference(graph: str) -> OrtSession:
        path = Path(source) / getattr(exported, graph).file
        return OrtSession(path, structure=_structure(path, routing[0].names if routing and graph == "target" else []))

    int8 = manifest.target.kv_dtype == "int8"
    float_kv = with_float_cache(manifest) if int8 else manifest  # an int8 cache is checked in float first

    def lowered(graph: str, quantized: bool = False, routed: bool = True):
        path = Path(directory) / getattr(manifest, graph).file
        routed = routed and routing is not None
        structure = _structure(path, routing[1].names if routed and graph == "target" else [])
        chosen = manifest if quantized else float_kv
        if int8 and graph == "target" and not quantized:
            structure = float_cache(structure or onnx.load(str(path), load_external_data=False), manifest)
        return open_session(directory, routing[1].exposing(chosen) if routed else chosen, graph, structure=structure)

    allowed = LOWERING_TOLERANCE[manifest.dtype]
    comparison = compare_lowering(exported, reference, lowered, float_kv, routing)
    differences = comparison.differences
    if comparison.flipped_rows:
        manifest.lowering.report["routing_flips_left_out"] = comparison.flipped_rows
        print(f"the check left out {comparison.flipped_rows} rows whose experts differ from the export's where "
              "their router's logits nearly tie (float rounding)", file=sys.stderr)
    for name, difference in differences:
        if difference > allowed:
            buffered = manifest.form == "buffer" and name.startswith("target")
            hint = "--kv-buffer off (a sliding-window target needs its mask)" if buffered else "--passes none"
            if buffered and manifest.lowering is not None and manifest.lowering.provider != "cpu":
                hint = "--kv-buffer off (the concat form, which keeps no buffers on the device)"
            raise DFlashError(f"the ORT lowering changes {name} by {difference:.2g} of its scale (allowed "
                              f"{allowed:g}): lower with {hint}, or report the graph")
    if int8:  # the int8 cache against the float one, through the same calls (the target's: the draft is float)
        parity = compare_lowering(float_kv, lambda graph: lowered(graph, routed=False),
                                  lambda graph: lowered(graph, quantized=True, routed=False), manifest)
        target = {name: d for name, d in parity.differences if name.startswith("target")}
        manifest.lowering.report.setdefault("kv_int8", {}).update(
            max_relative_difference=max(target.values()),
            logits_relative_difference=max(d for name, d in target.items() if name.startswith("target logits")))
    return max(d for _, d in differences)
