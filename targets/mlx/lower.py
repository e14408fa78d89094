"""`lower --target mlx`: each graph's structure (the ONNX file without its weights: the graph stays the
source of truth) and its weights as MLX safetensors, optionally with MatMul weights quantized by
`mx.quantize` (4 or 8 bits, per-group scales and biases) for `mx.quantized_matmul`. The draft's embedding
and lm_head are not written twice: the manifest maps them to the target's tensors.

By default (`--kv-buffer on`) the graphs are first rewritten by the passes the ORT lowering runs (rope-fusion,
ort-fusions, the draft's grouped Attention, the rope cache, the target's GroupQueryAttention over K/V buffers,
the draft's new-rows outputs): a few fused nodes per layer, which the session runs on MLX's fast kernels
(mx.fast.rms_norm, mx.fast.rope, mx.fast.scaled_dot_product_attention on grouped K/V) with K/V in
preallocated buffers written in place (ops.py, session.py).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import asdict, replace
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

from dflash_onnx.artifacts.graph_files import checked_graph, share_initializers
from dflash_onnx.artifacts.publish import available_memory, copy_tokenizer_files
from dflash_onnx.passes.pipeline import apply_pipeline
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Lowering, Manifest
from dflash_onnx.targets.backend import LowerRequest
from dflash_onnx.targets.check import compare_lowering, target_calls
from dflash_onnx.targets.lowering import (
    decode_seconds,
    lowered_output,
    record_measurements,
    refuse_unbuilt,
    start_lowering,
    within_budget,
)
from dflash_onnx.targets.mlx.options import MlxOptions
from dflash_onnx.targets.mlx.rounded import rounded_initializers
from dflash_onnx.targets.mlx.session import import_mlx, open_session

# disk over the export's size (docs/mlx.md#quantized-weights): the fused copy, with margin
FUSED_COPY_DISK = 1.1
# the MLX weights with --bits 4 / 8, with margin (unquantized: the export's size)
QUANTIZED_WEIGHTS_DISK = {4: 0.35, 8: 0.6}
BFLOAT16_TWIN_DISK = 2.0  # the check's float32 twin of a bfloat16 export


def weight_uses(graph: onnx.GraphProto) -> dict[str, set[str]]:
    """How each initializer is read: "direct" (x @ W), "transposed" (x @ Transpose(W), or FusedMatMul with
    transB), "rows" (Gather of whole rows: an embedding lookup), "float" (anything else)."""
    initializers = {t.name for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def transposes_into_matmuls(node: onnx.NodeProto) -> bool:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        return node.op_type == "Transpose" and perm == [1, 0] and all(
            c.op_type == "MatMul" and c.input[1] == node.output[0] for c in consumers.get(node.output[0], []))

    uses: dict[str, set[str]] = {}
    for name in initializers:
        for node in consumers.get(name, []):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "MatMul" and node.input[1] == name:
                kind = "direct"
            elif node.op_type == "FusedMatMul" and node.input[1] == name and attrs.get("alpha", 1.0) == 1.0 and \
                    not attrs.get("transA", 0):
                kind = "transposed" if attrs.get("transB", 0) else "direct"
            elif transposes_into_matmuls(node):
                kind = "transposed"
            elif node.op_type == "Gather" and node.input[0] == name and attrs.get("axis", 0) == 0:
                kind = "rows"
            else:
                kind = "float"
            uses.setdefault(name, set()).add(kind)
    return uses


def _quantizable(array: np.ndarray, group_size: int) -> bool:
    floating = array.dtype.kind == "f" or array.dtype == ml_dtypes.bfloat16
    return array.ndim == 2 and floating and min(array.shape) >= group_size and \
        all(d % group_size == 0 for d in array.shape)


def _convert_weights(model: onnx.ModelProto, bits: int | None, group_size: int,
                     skip: set[str], base_dir: Path) -> tuple[dict, dict]:
    """MLX arrays per initializer: the float tensor where something reads it as such, and for MatMul weights
    and embeddings (with `bits`) `NAME.q.*` (quantized for x @ W) and/or `NAME.qt.*` (for x @ W^T, and for row
    lookups: a tied embedding is stored once, quantized, for both its lookup and the lm_head). `model` is the
    graph's structure: each weight is read from its data file beside it (`base_dir`) when converted, so with
    `bits` only the quantized arrays accumulate."""
    mx = import_mlx()
    uses = weight_uses(model.graph)
    arrays, report = {}, {"quantized": 0, "kept_float": []}
    for tensor in model.graph.initializer:
        if tensor.name in skip or tensor.name not in uses:
            continue
        value = numpy_helper.to_array(tensor, str(base_dir))
        kinds = uses[tensor.name]
        if bits and kinds & {"direct", "transposed", "rows"}:
            if _quantizable(value, group_size):
                if "rows" in kinds:  # a lookup reads whole rows: the layout x @ W^T quantizes (groups along a row)
                    kinds = (kinds - {"rows"}) | {"transposed"}
                for kind, suffix, rows in (("direct", "q", value.T), ("transposed", "qt", value)):
                    if kind in kinds:  # mx.quantize takes the [N, K] layout quantized_matmul(transpose=True) reads
                        w, scales, biases = mx.quantize(mx.array(np.ascontiguousarray(rows)), group_size=group_size,
                                                        bits=bits)
                        mx.eval(w, scales, biases)  # lazy, they would keep every float weight alive until saved
                        arrays.update({f"{tensor.name}.{suffix}.w": w, f"{tensor.name}.{suffix}.scales": scales,
                                       f"{tensor.name}.{suffix}.biases": biases})
                report["quantized"] += 1
                if "float" not in kinds:
                    continue
            else:
                report["kept_float"].append(tensor.name)
        arrays[tensor.name] = mx.array(value)
    return arrays, report


def _shared_with_target(draft: onnx.ModelProto, target: onnx.ModelProto) -> dict[str, str]:
    """Draft initializers stored in the target's data file at the bytes of a target initializer that the
    target reads the same ways (so every stored variant the draft needs exists once, in the target's file)."""
    def location(tensor):
        info = {e.key: e.value for e in tensor.external_data}
        return info.get("location"), info.get("offset", "0"), info.get("length")

    target_at = {location(t): t.name for t in target.graph.initializer if t.external_data}
    target_uses, draft_uses = weight_uses(target.graph), weight_uses(draft.graph)
    return {t.name: target_at[location(t)] for t in draft.graph.initializer
            if t.external_data and location(t) in target_at
            and draft_uses.get(t.name, set()) <= target_uses.get(target_at[location(t)], set())}


def _strip_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    structure = onnx.ModelProto()
    structure.CopyFrom(model)
    del structure.graph.initializer[:]
    return structure


def lower_mlx(source: Path, out: Path, options: MlxOptions | None = None,
              request: LowerRequest | None = None) -> Manifest:
    """Write MLX_DIR: graph structures, MLX safetensors weights (optionally quantized), manifest."""
    options, request = options or MlxOptions(), request or LowerRequest()
    mx = import_mlx()
    manifest, _ = start_lowering(source, out, options, request)
    refuse_unbuilt(manifest, "mlx", "MLX")
    if options.kv_buffer and any(manifest.target.kv_windows):
        raise DFlashError(f"lower --target mlx: this {manifest.model_type} export's sliding-window layers need their "
                          "window, which MLX's GroupQueryAttention does not apply yet: lower with --kv-buffer off")
    manifest_of_export = manifest
    bits = options.bits
    # disk: the fused copy beside the MLX weights
    written = QUANTIZED_WEIGHTS_DISK.get(bits, 1.0)
    widened = BFLOAT16_TWIN_DISK if manifest.dtype == "bfloat16" else 0.0
    with lowered_output(source, out, request, size_factor=FUSED_COPY_DISK + written + widened) as tmp:
        origin = Path(source)
        if options.kv_buffer:
            origin = tmp / "fused"
            manifest = _fused(Path(source), origin, options, manifest, request.progress)
        structures = {g: checked_graph(origin / getattr(manifest, g).file) for g in ("target", "draft")}
        unsupported = _unsupported_ops(structures)
        if unsupported:
            raise DFlashError(f"{source} uses ops the MLX backend does not run: {', '.join(unsupported)} "
                              "(lower an fp32/fp16 export, optionally after cleanup or rope-fusion; "
                              "quantize with --bits)")
        shared = _shared_with_target(structures["draft"], structures["target"])
        report = {}
        for graph in ("target", "draft"):
            if request.progress:
                print(f"lowering {graph} to MLX{f' ({bits}-bit)' if bits else ''}", file=sys.stderr)
            model = structures[graph]
            skip = set(shared) if graph == "draft" else set()
            arrays, report[graph] = _convert_weights(model, bits, options.group_size, skip, origin)
            mx.save_safetensors(str(tmp / f"{graph}.safetensors"), arrays)
            onnx.save_model(_strip_weights(model), str(tmp / getattr(manifest, graph).file))
            del arrays, model
        shutil.rmtree(tmp / "fused", ignore_errors=True)
        copy_tokenizer_files(source, tmp)
        lowered = replace(manifest, lowering=Lowering(backend="mlx", options=asdict(options),
                                                      shared_with_target=shared, report={"weights": report},
                                                      draft_kv="rows" if options.kv_buffer else "concat"))
        target = open_session(tmp, lowered, "target")
        seconds = decode_seconds(lowered, target)  # mlx[cpu] at 4B: minutes (quantized matmuls run row by row)
        del target
        lowered.lowering.max_relative_difference = _checked(Path(source), manifest_of_export, tmp, lowered, bits,
                                                            request.progress, seconds)
        record_measurements(tmp, lowered, open_session, request.progress, seconds=seconds)
        lowered.save(tmp)
    return lowered


# Largest difference allowed between the MLX graphs and the export on ONNX Runtime, relative to the largest
# |output|: float kernels that round differently (docs/mlx.md#the-check). With --bits the
# reference reads the quantized weights rounded as the lowering stored them (rounded.py), so the same bounds hold;
# only where a weight is read more than one way (no rounded value fits every reader) are quantized weights held to
# the int8/int4 passes' bounds.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 8e-2}
UNROUNDED_TOLERANCE = {8: 0.15, 4: 0.75}


def _check(source: Path, exported: Manifest, directory: Path, lowered: Manifest, bits: int | None) -> float:
    """The MLX graphs against the export on ONNX Runtime (targets/check.py), its weights rounded as the MLX
    graphs' are; refused beyond TOLERANCE. A bfloat16 export runs there widened to float32 (the fp32 pass: the
    same weights; ONNX Runtime's CPU provider has no bfloat16 kernels)."""
    if exported.dtype == "bfloat16":
        widened = directory / "reference"
        exported, _ = apply_pipeline(source, ["fp32"], widened, progress=False, manifest=exported)
        try:
            return _check(widened, exported, directory, lowered, bits)
        finally:
            shutil.rmtree(widened, ignore_errors=True)
    from dflash_onnx.targets.ort.session import OrtSession

    mixed: list[str] = []

    def reference(graph: str) -> OrtSession:
        path = source / getattr(exported, graph).file
        if not bits:
            return OrtSession(path)
        rounded, unrounded = rounded_initializers(directory, lowered, graph)
        exported_as = {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}
        fits = {n for n, v in rounded.items() if n in exported_as and tuple(exported_as[n].dims) == v.shape}
        mixed.extend(unrounded + sorted(rounded.keys() - fits))
        return OrtSession(path, initializers={
            n: rounded[n].astype(onnx.helper.tensor_dtype_to_np_dtype(exported_as[n].data_type), copy=False)
            for n in fits})

    differences = compare_lowering(exported, reference, lambda g: open_session(directory, lowered, g),
                                   lowered).differences
    allowed = UNROUNDED_TOLERANCE[bits] if mixed else TOLERANCE[lowered.dtype]
    for name, difference in differences:
        if difference > allowed:
            raise DFlashError(f"the MLX lowering changes {name} by {difference:.2g} of its scale (allowed "
                              f"{allowed:g}): lower with --kv-buffer off, or report the graph")
    return max(d for _, d in differences)


def _checked(source: Path, exported: Manifest, directory: Path, lowered: Manifest, bits: int | None,
             progress: bool, seconds: float) -> float | None:
    """_check, unless the export on ONNX Runtime cannot fit (its CPU sessions hold float16 weights as float32,
    so the reference needs about twice a float16 export's size: the Qwen3-4B shape's target ~15 GB; the check
    holds one graph's session at a time, so the larger graph counts) or the MLX target's calls, `seconds` each,
    would outlast the lowering's budget; then a warning with the figures, and None recorded."""
    weights = max(sum(p.stat().st_size for p in source.glob(f"{getattr(exported, graph).file}*"))
                  for graph in ("target", "draft"))
    # with --bits, beside it the quantized weights dequantized for it (rounded.py): about the graph's weights again
    need = weights * ((1 if exported.dtype == "float32" else 2) + (1 if bits else 0))
    available = available_memory()
    if available is not None and need > 0.8 * available:
        print(f"warning: the check against the export is skipped: ONNX Runtime would hold about {need / 1e9:.1f} GB "
              f"for the reference and {available / 1e9:.1f} GB is available (check it on a larger machine with "
              "'dflash-onnx lower' there, or compare tokens with 'dflash-onnx bench')", file=sys.stderr)
        return None
    if not within_budget(seconds, target_calls(lowered), "the check against the export is",
                         "check it on the machine that decodes with 'dflash-onnx lower' there, or compare tokens with "
                         "'dflash-onnx bench'"):
        return None
    if progress:
        print("checking the MLX graphs against the export (ONNX Runtime)", file=sys.stderr)
    return _check(source, exported, directory, lowered, bits)


FUSED_PASSES = ["rope-fusion", "ort-fusions", "draft-attention", "rope-cache", "kv-buffer", "draft-rows", "tidy"]


def _fused(source: Path, out: Path, options: MlxOptions, manifest: Manifest, progress: bool) -> Manifest:
    """The export rewritten into the fused buffer form (the ORT lowering's passes), the draft's vocab tensors
    pointed back at the target's; its manifest."""
    names = [n for n in FUSED_PASSES if n not in {p["name"] for p in manifest.passes}]
    pass_options = {"kv-buffer": {"ctx_len": str(options.ctx_len)},
                    "rope-cache": {"rows": str(options.ctx_len + manifest.block_size)}}
    fused, _ = apply_pipeline(source, names, out, pass_options, progress=progress, lowering="mlx",
                              manifest=manifest)
    (out / "passes_report.json").unlink()
    share_initializers(out, manifest.draft.file, manifest.target.file, manifest.vocab_size)
    return replace(fused, passes=manifest.passes, form="buffer", ctx_len=options.ctx_len,
                   kv_layout="batch,kv_heads,seq,head_dim")


def _unsupported_ops(structures: dict[str, onnx.ModelProto]) -> list[str]:
    from dflash_onnx.targets.mlx.ops import OPS

    return sorted({f"{n.domain + '.' if n.domain else ''}{n.op_type}" for m in structures.values()
                   for n in m.graph.node if (n.domain if n.domain != "ai.onnx" else "", n.op_type) not in OPS})
