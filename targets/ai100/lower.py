"""`lower --target ai100`: retained-state graphs re-exported from the checkpoints, the compiler's inputs
next to them, and the compile itself when the SDK is present.

The target and draft are exported again from the source checkpoints (recorded in OUT's manifest) in the
retained form of `dflash_onnx.models.retained` (QEfficient's convention: `past_key.i` / `past_value.i`
paired with `*_RetainedState` outputs), with rope-fusion's opset-18 `hoist` form applied. The same
graphs run on ONNX Runtime with the retained state fed back by the host, which is how they are proven
lossless without the hardware.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dflash_onnx.errors import DFlashError
from dflash_onnx.export import export_program
from dflash_onnx.graph_files import graph_spec, share_initializers
from dflash_onnx.manifest import Lowering, Manifest
from dflash_onnx.models.calibration import calibrate_for_fp16
from dflash_onnx.models.retained import RetainedDraft, RetainedTarget
from dflash_onnx.pair import load_tapped_pair
from dflash_onnx.progress import Stages
from dflash_onnx.publish import copy_tokenizer_files
from passes.rope_fusion import fuse

from ..backend import LowerRequest
from ..lowering import lowered_output, start_lowering
from .compiler import check_graph, compile_commands, compile_script, custom_io_yaml, specializations
from .options import Ai100Options
from .sdk import SDK_DIR, find_compiler


def kv_names(num_layers: int) -> tuple[list[str], list[str]]:
    """QEfficient's retained-state names: past_key.i / past_value.i and their *_RetainedState outputs."""
    inputs = [f"past_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    return inputs, [f"{name}_RetainedState" for name in inputs]


def round_traffic(manifest: Manifest, hidden_size: int, itemsize: int = 4) -> dict[str, int]:
    """Host<->device bytes of one greedy DFlash round (draft step + target verify) with retained state on
    the device: what this design moves, and what shipping the draft's logits instead of ids would add."""
    block, ids = manifest.block_size, 8
    draft_in = block * ids + block * hidden_size * itemsize + 2 * block * ids  # ids, context rows, 2 positions
    draft_out = (block - 1) * (ids + itemsize)  # ids and their confidences
    target_in = 2 * block * ids
    target_out = block * ids + block * hidden_size * itemsize  # greedy ids + context rows for the next step
    logits = (block - 1) * manifest.vocab_size * itemsize
    return {"draft_in": draft_in, "draft_out": draft_out, "target_in": target_in, "target_out": target_out,
            "round_total": draft_in + draft_out + target_in + target_out,
            "draft_logits_if_shipped": logits}


def _export(module, args, input_names, output_names, dynamic_shapes, opset, path: Path) -> dict:
    """Export, then share cos/sin per position stream (rope-fusion's opset-17/18 form); returns its report."""
    program = export_program(module, args, input_names, output_names, dynamic_shapes, opset)
    hoisting = fuse(program.model, "hoist")
    program.save(str(path), external_data=True)
    return hoisting


def export_retained(tapped, draft, manifest: Manifest, options: Ai100Options, out: Path,
                    fc_scale: float) -> dict[str, dict]:
    """target.onnx and draft.onnx in the retained form; returns rope-fusion's report per graph."""
    batch = torch.export.Dim("batch_size", min=1)
    seq = torch.export.Dim("seq_len", min=1)
    ctx = torch.export.Dim("ctx_len", min=2)
    block = manifest.block_size
    dtype = tapped.lm.dtype

    n = tapped.num_layers
    kv_in, kv_out = kv_names(n)
    buffers = tuple(torch.zeros(2, tapped.num_kv_heads, 16, tapped.head_dim, dtype=dtype) for _ in range(2 * n))
    ids = torch.randint(0, 8, (2, 3))
    positions = torch.tensor([[2, 3, 4], [5, 6, 15]])
    target = _export(RetainedTarget(tapped, draft, fc_scale).eval(), (ids, positions, *buffers),
                     ["input_ids", "position_ids", *kv_in], ["greedy_ids", "logits", "context_hidden", *kv_out],
                     ({0: batch, 1: seq}, {0: batch, 1: seq}, tuple({0: batch, 2: ctx} for _ in range(2 * n))),
                     options.opset, out / "target.onnx")

    n = len(draft.layers)
    kv_in, kv_out = kv_names(n)
    buffers = tuple(torch.zeros(2, draft.num_kv_heads, 16, draft.head_dim, dtype=dtype) for _ in range(2 * n))
    hidden = torch.zeros(2, 3, draft.spec.config.hidden_size, dtype=dtype)
    block_ids = torch.randint(0, 8, (2, block))
    block_positions = (torch.arange(block) + 5)[None].repeat(2, 1)
    draft_report = _export(RetainedDraft(draft).eval(), (block_ids, hidden, positions, block_positions, *buffers),
                           ["input_ids", "context_hidden", "ctx_position_ids", "position_ids", *kv_in],
                           ["draft_ids", "draft_confidence", "logits", *kv_out],
                           ({0: batch}, {0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch},
                            tuple({0: batch, 2: ctx} for _ in range(2 * n))),
                           options.opset, out / "draft.onnx")
    return {"target": target, "draft": draft_report}


def _compile(directory: Path, compiler: list[str], options: Ai100Options) -> None:
    for command in compile_commands(compiler, options):
        done = subprocess.run(command, cwd=directory, capture_output=True, text=True)
        if done.returncode != 0:
            raise DFlashError(f"{command[0]} failed ({done.returncode}): "
                              f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")


def lower_ai100(source: Path, out: Path, options: Ai100Options | None = None,
                request: LowerRequest | None = None) -> Manifest:
    """Write AI100_DIR (graphs, specializations, custom IO, compile.sh, manifest); compile if possible."""
    options, request = options or Ai100Options(), request or LowerRequest()
    manifest, (target_dir, draft_dir) = start_lowering(source, out, options, request, reexport=True)
    out = Path(out)
    stages = Stages(5, enabled=request.progress)
    compiler = find_compiler()
    with lowered_output(source, out, request, (target_dir, draft_dir)) as tmp:
        with stages.stage("loading target and draft"):
            tapped, draft = load_tapped_pair(target_dir, draft_dir, manifest.target_layer_ids, manifest.dtype)
        with stages.stage("calibrating float16 range"):
            calibration = calibrate_for_fp16(tapped, draft, manifest, "-convert-to-fp16")
        with stages.stage("exporting retained-state graphs"):
            rope_hoisting = export_retained(tapped, draft, manifest, options, tmp, calibration["fc_scale"])
            shared, _ = share_initializers(tmp, "draft.onnx", "target.onnx", manifest.vocab_size)
        with stages.stage("checking graphs and writing compiler inputs"):
            report = {name: check_graph(tmp / f"{name}.onnx", options.opset) for name in ("target", "draft")}
            graphs = {}
            for name, layers, heads, dim in (("target", tapped.num_layers, tapped.num_kv_heads, tapped.head_dim),
                                             ("draft", len(draft.layers), draft.num_kv_heads, draft.head_dim)):
                kv_in, kv_out = kv_names(layers)
                graphs[name] = graph_spec(tmp / f"{name}.onnx", layers, heads, dim, kv_in, kv_out)
                (tmp / f"{name}_custom_io.yaml").write_text(custom_io_yaml(kv_in, kv_out, options.kv_dtype))
            for name, spec in specializations(manifest, options).items():
                (tmp / f"{name}_specializations.json").write_text(json.dumps(spec, indent=2) + "\n")
            script = tmp / "compile.sh"
            script.write_text(compile_script(compile_commands(compiler or ["qaic-compile"], options)))
            script.chmod(0o755)
            copy_tokenizer_files(source, tmp)
            lowered = replace(
                manifest, target=graphs["target"], draft=graphs["draft"], form="retained", ctx_len=options.ctx_len,
                costs=None, prefill_len=options.prefill_len, opset=options.opset,
                kv_layout="batch,kv_heads,ctx_len,head_dim",
                lowering=Lowering(backend="ai100", options=asdict(options), shared_with_target=shared,
                                  rewrites={"rope-fusion": rope_hoisting}, calibration=calibration,
                                  report={"graphs": report, "round_traffic_bytes": round_traffic(
                                      manifest, draft.spec.config.hidden_size)}))
            lowered.save(tmp)
        with stages.stage("compiling" if compiler and not options.dry_run else "compile skipped"):
            if compiler and not options.dry_run:
                _compile(tmp, compiler, options)
                lowered.lowering.compiled = True
                lowered.save(tmp)
    if not compiler and not options.dry_run:
        raise DFlashError(f"qaic-compile not found (PATH, {SDK_DIR}/exec): wrote {out}/compile.sh; run it on a "
                          "machine with the Cloud AI 100 SDK, or pass --dry-run")
    return lowered
