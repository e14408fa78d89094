"""`lower --target ort`: the passes that pay off on ONNX Runtime, ORT's own optimizations saved, checked.

The lowering runs one pass pipeline (passes/): the chosen passes (default rope-fusion, ort-fusions), then
its own rewrites: the draft's attention as ONNX Attention, and in the buffer form the draft's rotations
over a constant cos/sin cache, the target's attention over in-place K/V buffers and the draft's K/V
outputs as new rows; then `tidy`. ORT then optimizes each graph once and saves the result (sessions start
from it), the draft's embedding / lm_head are stored once again (ORT's save writes one data file per
graph), the lowered graphs are checked against the export, and provider and session options are recorded
in the manifest for `generate`, `bench` and `steps`.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from dflash_onnx.artifacts.graph_files import share_initializers
from dflash_onnx.artifacts.publish import copy_tokenizer_files
from dflash_onnx.passes import registry
from dflash_onnx.passes.calibration import record_feeds
from dflash_onnx.passes.pipeline import apply_pipeline
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import KV_LAYOUT, Lowering, Manifest
from dflash_onnx.targets.backend import LowerRequest
from dflash_onnx.targets.lowering import lowered_output, record_measurements, start_lowering
from dflash_onnx.targets.ort.check import check_lowering
from dflash_onnx.targets.ort.options import OrtOptions
from dflash_onnx.targets.ort.session import bfloat16_refusal, open_session, ort_level, provider_name
from dflash_onnx.targets.ort.spinning_measure import measure_spinning

# disk over the export's size: the pipeline's copy, then ORT's
DISK_FACTOR = 2.2
# peak memory over the export's size, with margin, the K/V buffers sized to the context and one graph's session
# open at a time (docs/ort.md#memory-a-lowering-needs)
PEAK_MEMORY_FLOAT32 = 1.8
PEAK_MEMORY_QUANTIZED = 1.3  # int4 / int8 weights
PEAK_MEMORY_FLOAT16_WIDENED = 2.9  # float16 on CPU: its sessions widen the weights to float32
# --kv-dtype int8: the K/V the scales are calibrated on (passes/calibration.py's DFlash decoding of random prompts)
KV_CALIBRATION = {"prompts": 4, "prompt_length": 32, "new_tokens": 16}
INT8_PEAK = 127  # a calibrated peak is stored as 127: ORT writes round(x / scale) saturated to [-128, 127]


def kv_dtype(options: OrtOptions, manifest: Manifest) -> str:
    """The dtype of the target's K/V buffers the lowering writes: the export's (auto, or named), or int8."""
    if options.kv_dtype in ("auto", manifest.dtype):
        return manifest.dtype
    if options.kv_dtype == "int8":
        return "int8"
    if options.kv_dtype == "float16":
        raise DFlashError(f"--kv-dtype float16 on this {manifest.dtype} export: ONNX Runtime's CPU GroupQueryAttention "
                          "takes a float16 cache under float32 queries but attends each call's own new rows unrounded "
                          "(measured), so a verify and a decode step would read a token's K/V differently: use "
                          "--kv-dtype int8, or export --dtype float16")
    raise DFlashError(f"--kv-dtype {options.kv_dtype} on this {manifest.dtype} export: GroupQueryAttention's cache is "
                      "the query's dtype or a quantized one: use --kv-dtype auto or int8")


def kv_scales(source: Path, manifest: Manifest, progress: bool) -> tuple[dict[str, np.ndarray], dict]:
    """Per-channel int8 scales of the target's K/V ([kv_heads, head_dim] per K/V input: what GroupQueryAttention's
    PER_CHANNEL takes), and what the lowering's report says of them. The K/V are recorded while DFlash decodes
    random prompts on the export (KV_CALIBRATION); a value channel's scale is its peak |value| / 127; a key
    channel's is the peak norm of its rotary pair (d, d + head_dim / 2) / 127: RoPE rotates each pair by its
    position's angle and keeps the pair's norm, so a position deeper than the calibration's cannot carry a key
    channel past its scale. A channel never nonzero takes its tensor's largest scale."""
    if manifest.kv_layout != KV_LAYOUT:
        raise DFlashError(f"--kv-dtype int8 calibrates on an export's K/V ({KV_LAYOUT}), not {manifest.kv_layout}")
    if progress:
        print("recording the target's K/V for its int8 scales (DFlash on random prompts)", file=sys.stderr)
    feeds = record_feeds(manifest, lambda graph: open_session(Path(source), manifest, graph), **KV_CALIBRATION)
    target = manifest.target
    scales, ranges = {}, {"key": [], "value": []}
    for index, name in enumerate(target.kv_inputs):
        role, peak = "key" if index % 2 == 0 else "value", np.zeros(target.kv_shape(name), np.float32)
        paired = role == "key" and peak.shape[1] % 2 == 0
        for feed in feeds["target"]:
            rows = feed[name].astype(np.float32)  # [batch, seq, kv_heads, head_dim]
            if not rows.shape[1]:
                continue
            if paired:  # the peak of each rotary pair's norm, for both its channels
                rows = np.tile(np.hypot(*np.split(rows, 2, axis=-1)), 2)
            peak = np.maximum(peak, np.abs(rows).max(axis=(0, 1)))
        largest = float(peak.max()) or 1.0
        scales[name] = (np.where(peak > 0, peak, largest) / INT8_PEAK).astype(np.float32)
        ranges[role] += [float(scales[name].min()), float(scales[name].max())]
    report = {"dtype": "int8", "quantization": "per_channel: [1, kv_heads, 1, head_dim] per layer's K and V",
              "scale": "value: peak |value| / 127; key: peak norm of its rotary pair (d, d + head_dim / 2) / 127",
              "calibration": {**KV_CALIBRATION, "target_calls": len(feeds["target"])},
              **{f"{role}_scales": [min(r), max(r)] for role, r in ranges.items()}}
    return scales, report


def _save_optimized(source: Path, dest: Path, provider: str, level: str) -> None:
    """Let ORT optimize `source` for `provider` at `level` and write the optimized graph to `dest`."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort_level(level)
    options.optimized_model_filepath = str(dest)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{dest.name}.data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    # the saved graph keeps the weights as they are: packing them for the kernels (MatMulNBits' int4 with a float32
    # scale and block sum per block, docs/large-models.md#where-an-ort-sessions-memory-goes) would only raise this
    # step's peak
    options.add_session_config_entry("session.disable_prepacking", "1")
    try:
        ort.InferenceSession(str(source), sess_options=options, providers=[provider])
    except Exception as exc:
        raise DFlashError(f"ONNX Runtime cannot optimize {source.name}: {str(exc).splitlines()[0]}") from None


def _refuse_own_rewrites(passes: tuple[str, ...]) -> None:
    own = sorted({n for n in passes if n in registry() and "ort" in registry()[n].lowerings})
    if own:
        raise DFlashError(f"--passes {','.join(own)}: the ORT lowering applies its own rewrites itself (see "
                          "--kv-buffer); --passes takes the portable passes, e.g. rope-fusion,ort-fusions")


def pipeline(options: OrtOptions, block_size: int, experts: bool = False, quantized: bool = False,
             scales: Path | None = None) -> tuple[list[str], dict[str, dict]]:
    """The passes the lowering runs, in order, and their options (`experts`: the target has mixture-of-experts
    nodes, which become ONNX Runtime's MoE; `quantized`: int4/int8 MatMulNBits, whose siblings are packed;
    `scales`: the npz file of int8 K/V scales, for --kv-dtype int8)."""
    names = list(options.passes)
    rewrites = ["moe-fusion"] if experts else []
    if "ort-fusions" in names:  # it fuses the MultiHeadAttention draft-attention rewrites
        rewrites.append("draft-attention")
    if options.kv_buffer:
        # a cos/sin cache needs a bound on positions: the buffer form's capacity (a draft block runs past it)
        rewrites += ["rope-cache"] if "rope-fusion" in names else []
        rewrites += ["kv-buffer", "draft-rows"]
    rewrites += ["sibling-matmuls"] if quantized else []
    names += [*rewrites, "tidy"] if rewrites else []
    # the ragged form batches requests: its draft's attention takes each request's own rows (one draft call a step)
    ragged = options.kv_buffer and options.kv_attention == "ragged"
    int8 = {"kv_dtype": "int8", "kv_scales": str(scales)} if scales is not None else {}
    return names, {"kv-buffer": {"ctx_len": str(options.ctx_len), "attention": options.kv_attention, **int8},
                   "rope-cache": {"rows": str(options.ctx_len + block_size)},
                   "draft-attention": {"key_mask": "1" if ragged else "0"}}


def _by_pass(report: list[dict]) -> dict[str, dict[str, dict]]:
    rewrites: dict[str, dict[str, dict]] = {}
    for row in report:
        rewrites.setdefault(row["pass"], {})[row["graph"]] = row["details"]
    return rewrites


def lower_ort(source: Path, out: Path, options: OrtOptions | None = None,
              request: LowerRequest | None = None) -> Manifest:
    """Write ORT_DIR: ORT-optimized target and draft graphs, the draft's vocab tensors shared, the manifest."""
    options, request = options or OrtOptions(), request or LowerRequest()
    _refuse_own_rewrites(options.passes)
    manifest, _ = start_lowering(source, out, options, request)
    if options.provider == "cuda" and options.kv_buffer and manifest.dtype == "float32":
        raise DFlashError("--provider cuda: the buffer form's GroupQueryAttention runs float16 (or bfloat16) on "
                          "CUDA only: export with --dtype float16, or lower with --kv-buffer off")
    if manifest.dtype == "bfloat16":
        raise DFlashError(bfloat16_refusal(Path(source)))
    if options.kv_buffer and manifest.kv_shared_layers:
        raise DFlashError(f"lower --target ort: {manifest.kv_shared_layers} of this {manifest.model_type} export's "
                          "layers read an earlier layer's K/V, which the buffer form's GroupQueryAttention rewrite "
                          "does not map yet: lower with --kv-buffer off (the concat form)")
    int8 = kv_dtype(options, manifest) == "int8"
    provider = provider_name(options.provider)
    if options.provider == "cpu" and manifest.dtype == "float16" and not manifest.weight_quantization:
        print("warning: ONNX Runtime's CPU provider has no float16 MatMul: its sessions convert float16 weights to "
              "float32 when they open, so memory is about twice the files (the Qwen3-4B shape's float16 export "
              "peaked at 23.8 GB, as measured for issue 19); on CPU quantize instead: optimize --passes int4 "
              "--pass-option int4.lm_head=true",
              file=sys.stderr)
    widened = options.provider == "cpu" and manifest.dtype == "float16" and not manifest.weight_quantization
    memory = (PEAK_MEMORY_FLOAT16_WIDENED if widened
              else PEAK_MEMORY_QUANTIZED if manifest.weight_quantization else PEAK_MEMORY_FLOAT32)
    with lowered_output(source, out, request, size_factor=DISK_FACTOR, memory_factor=memory) as tmp:
        scales_file, kv_report = None, None
        if int8:  # calibrated on the export; the kv-buffer pass reads them from this file
            scales, kv_report = kv_scales(Path(source), manifest, request.progress)
            scales_file = tmp / "kv_scales.npz"
            np.savez(scales_file, **scales)
        names, pass_options = pipeline(options, manifest.block_size, experts=manifest.experts is not None,
                                       quantized=manifest.weight_quantization is not None, scales=scales_file)
        fused_dir, fused, rewrites = tmp / "fused", manifest, {}
        if names:
            fused, report = apply_pipeline(Path(source), names, fused_dir, pass_options, progress=request.progress,
                                           lowering="ort", manifest=manifest,
                                           open_graph=lambda graph: open_session(Path(source), manifest, graph))
            shutil.move(str(fused_dir / "passes_report.json"), tmp / "passes_report.json")
            rewrites = _by_pass(report)
            # the manifest lists the passes chosen; what the lowering's own rewrites did is in lowering.rewrites
            fused = replace(fused, passes=fused.passes[: len(manifest.passes) + len(options.passes)])
        if options.kv_buffer:
            fused = replace(fused, form="buffer", ctx_len=options.ctx_len, kv_layout="batch,kv_heads,seq,head_dim")
        if int8:  # the graphs still compute in the export's dtype; only the target's K/V buffers are int8
            fused = replace(fused, dtype=manifest.dtype, target=fused.target.with_kv_dtype("int8"))
            scales_file.unlink()
        origin = fused_dir if names else Path(source)
        for graph in ("target", "draft"):
            if request.progress:
                print(f"ONNX Runtime optimizes {graph} ({options.optimization_level}, {provider})", file=sys.stderr)
            file = getattr(manifest, graph).file
            _save_optimized(origin / file, tmp / file, provider, options.optimization_level)
        shutil.rmtree(fused_dir, ignore_errors=True)
        shared, unshared = share_initializers(tmp, manifest.draft.file, manifest.target.file, manifest.vocab_size)
        rows = rewrites.get("draft-rows", {}).get("draft", {}).get("outputs", 0) > 0
        lowered = replace(fused, lowering=Lowering(
            backend="ort", options={**asdict(options), "passes": list(options.passes)}, provider=options.provider,
            draft_kv="rows" if rows else "concat", shared_with_target=shared, rewrites=rewrites,
            report={"kv_int8": kv_report} if int8 else {}))
        lowered.lowering.max_relative_difference = check_lowering(Path(source), manifest, tmp, lowered)

        def spinning() -> None:
            if options.spinning != "auto":
                return
            if request.progress:
                print("timing the spinning modes, quiet and beside one busy process", file=sys.stderr)
            measured = measure_spinning(tmp, lowered, lambda mode: open_session(tmp, lowered, "target", spinning=mode))
            lowered.lowering.options["spinning"] = measured["chosen"]
            lowered.lowering.report["spinning"] = measured

        # the spinning mode is chosen before the cost curve, which the chosen mode's sessions run
        record_measurements(tmp, lowered, open_session, request.progress, before_costs=spinning)
        if unshared:
            print(f"warning: draft tensors {unshared} are stored twice (no identical target tensor after ORT's "
                  "optimizations)", file=sys.stderr)
        copy_tokenizer_files(source, tmp)
        lowered.save(tmp)
    return lowered
