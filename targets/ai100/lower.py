"""`lower --target ai100`: retained-state graphs re-exported from the checkpoints, the compiler's inputs
next to them, a float16 emulation check, and the compile itself when the SDK is present.

The target and draft are exported again from the source checkpoints (recorded in OUT's manifest) in the
retained form of `dflash_onnx.exporter.models.retained` (QEfficient's convention: `past_key.i` / `past_value.i`
paired with `*_RetainedState` outputs, a `comp_ctx_lengths` input per compute-context length). The same
graphs run on ONNX Runtime with the retained state fed back by the host, which is how they are proven
lossless without the hardware; `emulate` runs them again as the compiler's float16 would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import onnx
import torch

from dflash_onnx.artifacts.graph_files import graph_spec, share_initializers
from dflash_onnx.artifacts.model_dirs import largest_tensor_bytes
from dflash_onnx.artifacts.progress import Stages
from dflash_onnx.artifacts.publish import copy_tokenizer_files
from dflash_onnx.exporter.export import export_program, save_graph
from dflash_onnx.exporter.lazy_weights import LazyWeights, Source, pair_sources, traced_weights, weights_on_demand
from dflash_onnx.exporter.models.retained import RetainedDraft, RetainedTarget
from dflash_onnx.exporter.pair import DTYPES, load_tapped_pair, meta_pair
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Lowering, Manifest
from dflash_onnx.runtime.runners import ARGMAX_PROBABILITY
from dflash_onnx.targets.ai100.compiler import (
    check_graph,
    compile_commands,
    compile_script,
    custom_io_yaml,
    flat_specializations,
    named_specializations,
    node_precision_yaml,
    partition_config,
    specializations,
)
from dflash_onnx.targets.ai100.emulate import emulation_check
from dflash_onnx.targets.ai100.options import Ai100Options
from dflash_onnx.targets.ai100.precision import draw_outputs, norm_outputs, plan_report
from dflash_onnx.targets.ai100.sdk import SDK_DIR, find_compiler
from dflash_onnx.targets.backend import LowerRequest
from dflash_onnx.targets.fp16_calibration import calibrate_for_fp16
from dflash_onnx.targets.lowering import lowered_output, refuse_unbuilt, start_lowering

EMULATION_PROMPTS, EMULATION_TOKENS = 2, 24
# peak memory of the float16 emulation's sessions (one twin at a time, its rounded weights folded into constants
# of its own) over a float32 export's size, with margin (docs/ai100.md#the-emulated-check)
EMULATION_MEMORY = 3.8
# peak memory of a --no-stream lowering over the export's size, with margin: the loaded pair and its retained-state
# export, from float32 the emulation's sessions on top (docs/ai100.md#bfloat16-and-large-models)
NO_STREAM_MEMORY_FLOAT32 = 5.5
NO_STREAM_MEMORY_FLOAT16 = 3.5


def kv_names(num_layers: int) -> tuple[list[str], list[str]]:
    """QEfficient's retained-state names: past_key.i / past_value.i and their *_RetainedState outputs."""
    inputs = [f"past_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    return inputs, [f"{name}_RetainedState" for name in inputs]


def round_traffic(manifest: Manifest, hidden_size: int, itemsize: int = 4) -> dict[str, int]:
    """Host<->device bytes of one greedy DFlash round (draft step + target verify) with retained state on
    the device: what this design moves, and what shipping the draft's logits instead of ids would add."""
    block, rows, ids, positions = manifest.block_size, manifest.verify_rows, 4, 8  # rows: a verify's tokens
    draft_in = block * positions + rows * hidden_size * itemsize + (rows + block) * positions  # ids, rows, positions
    confidences = 1 + int(ARGMAX_PROBABILITY in manifest.draft.output_names())  # a confidence head's draft: two
    draft_out = (rows - 1) * (ids + confidences * itemsize)  # int32 ids and their confidences
    target_in = 2 * rows * positions
    target_out = rows * ids + rows * hidden_size * itemsize  # greedy ids + context rows for the next step
    logits = (rows - 1) * manifest.vocab_size * itemsize
    return {"draft_in": draft_in, "draft_out": draft_out, "target_in": target_in, "target_out": target_out,
            "round_total": draft_in + draft_out + target_in + target_out,
            "draft_logits_if_shipped": logits}


def _save(module, args, input_names, output_names, dynamic_shapes, opset, path: Path,
          weights: LazyWeights | None, written: Callable[[int, int], None] | None) -> None:
    program = export_program(module, args, input_names, output_names, dynamic_shapes, opset, weights)
    save_graph(program.model, path, written)


def export_retained(tapped, draft, manifest: Manifest, options: Ai100Options, out: Path, fc_scale: float,
                    sources: dict[int, Source] | None = None,
                    written: Callable[[int, int], None] | None = None) -> None:
    """target.onnx and draft.onnx in the retained form (rotary tables for positions below ctx_len), from a loaded
    pair, or from a meta pair (pair.meta_pair) whose weights `sources` names: each is then read from its checkpoint
    as the graph file is written (lazy_weights.py), so memory does not grow with the model."""
    batch = torch.export.Dim("batch_size", min=1)
    seq = torch.export.Dim("seq_len", min=1)
    ctx = torch.export.Dim("ctx_len", min=2)
    ccl = torch.export.Dim("comp_ctx_lengths", min=1)
    block = manifest.block_size
    dtype = tapped.lm.dtype
    logits = ["logits"] if options.logits else []
    target = RetainedTarget(tapped, draft, fc_scale, options.ctx_len, options.logits).eval()
    draft_module = RetainedDraft(draft, options.ctx_len, options.logits).eval()
    target_weights = draft_weights = None
    if sources is not None:
        sources = {**sources, id(target.fc_weight): replace(sources[id(draft.fc.weight)], divisor=fc_scale)}
        target_weights, draft_weights = traced_weights([target, draft_module], sources, dtype)
    with target_weights.mode if target_weights else nullcontext():  # fake inputs for modules without weights
        read = torch.zeros(12, dtype=torch.int64)
        n = tapped.num_layers
        target_buffers = tuple(torch.zeros(2, tapped.num_kv_heads, 16, tapped.head_dim, dtype=dtype)
                               for _ in range(2 * n))
        ids = torch.randint(0, 8, (2, 3))
        positions = torch.tensor([[2, 3, 4], [5, 6, 15]])
        draft_buffers = tuple(torch.zeros(2, draft.num_kv_heads, 16, draft.head_dim, dtype=dtype)
                              for _ in range(2 * len(draft.layers)))
        hidden = torch.zeros(2, 3, draft.spec.config.hidden_size, dtype=dtype)
        ctx_positions = positions - 2
        block_ids = torch.randint(0, 8, (2, block))
        block_positions = (torch.arange(block) + 5)[None].repeat(2, 1)

    kv_in, kv_out = kv_names(n)
    _save(target, (ids, positions, read, *target_buffers),
          ["input_ids", "position_ids", "comp_ctx_lengths", *kv_in],
          ["greedy_ids", "context_hidden", *logits, *kv_out],
          ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: ccl}, tuple({0: batch, 2: ctx} for _ in range(2 * n))),
          options.opset, out / "target.onnx", target_weights, written)

    n = len(draft.layers)
    kv_in, kv_out = kv_names(n)
    sampling = (torch.full((2, draft.spec.proposals(block)), 0.5), torch.ones(2)) if draft_module.extra_inputs() \
        else ()
    _save(draft_module, (block_ids, hidden, ctx_positions, block_positions, read, *draft_buffers, *sampling),
          ["input_ids", "context_hidden", "ctx_position_ids", "position_ids", "comp_ctx_lengths", *kv_in,
           *draft_module.extra_inputs()],
          [*draft_module.output_names(), *kv_out],
          ({0: batch}, {0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch}, {0: ccl},
           (*({0: batch, 2: ctx} for _ in range(2 * n)), *({0: batch} for _ in sampling))),
          options.opset, out / "draft.onnx", draft_weights, written)


def write_compiler_inputs(directory: Path, manifest: Manifest, options: Ai100Options,
                          fp32_outputs: dict[str, list[str]]) -> None:
    """Specializations (named and flat), custom IO, node precision, the partition config, compile.sh."""
    for graph, specs in specializations(manifest, options).items():
        (directory / f"{graph}_specializations.json").write_text(json.dumps(named_specializations(specs), indent=2))
        (directory / f"{graph}_specializations_flat.json").write_text(json.dumps(flat_specializations(specs),
                                                                                 indent=2))
        spec = getattr(manifest, graph)
        (directory / f"{graph}_custom_io.yaml").write_text(custom_io_yaml(spec.kv_inputs, spec.kv_outputs,
                                                                          options.kv_dtype))
        (directory / f"{graph}_npi.yaml").write_text(node_precision_yaml(fp32_outputs[graph]))
    if len(options.target_device_ids) > 1:
        (directory / "target_mdp.json").write_text(json.dumps(
            partition_config(len(options.target_device_ids), options.target_cores), indent=2))
    script = directory / "compile.sh"
    script.write_text(compile_script(options))
    script.chmod(0o755)


def _compile(directory: Path, compiler: list[str]) -> None:
    """Run compile.sh (the same script a user runs by hand) with the compiler found here."""
    env = {**os.environ, "QAIC_COMPILE": " ".join(compiler)}
    done = subprocess.run(["bash", str(directory / "compile.sh")], cwd=directory, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise DFlashError(f"compile.sh failed ({done.returncode}): {' / '.join(lines[-3:])}")


def _emulation_prompts(manifest: Manifest, options: Ai100Options) -> list[list[int]]:
    """Random prompts whose decode ends near ctx_len, so the check reaches the long positions."""
    rng = np.random.default_rng(0)
    longest = int(options.ctx_len) - EMULATION_TOKENS - manifest.block_size - 2
    lengths = [min(5, longest), longest][:EMULATION_PROMPTS]
    return [rng.integers(1, manifest.vocab_size, n).tolist() for n in lengths]


def _warn_if_unequal(report: dict) -> None:
    decode = report.get("decode")
    if decode and min(decode["greedy_identical"], decode["dflash_identical"]) < decode["prompts"]:
        print(f"warning: under float16 emulation {decode['greedy_identical']}/{decode['prompts']} greedy and "
              f"{decode['dflash_identical']}/{decode['prompts']} DFlash decodes match float32 greedy: see the "
              "manifest's lowering.report.fp16_emulation", file=sys.stderr)


def lower_ai100(source: Path, out: Path, options: Ai100Options | None = None,
                request: LowerRequest | None = None) -> Manifest:
    """Write AI100_DIR (graphs, compiler inputs, compile.sh, manifest, emulation report); compile if possible."""
    options, request = options or Ai100Options(), request or LowerRequest()
    manifest, (target_dir, draft_dir) = start_lowering(source, out, options, request, reexport=True)
    refuse_unbuilt(manifest, "ai100", "Cloud AI 100")
    out = Path(out)
    stages = Stages(6, enabled=request.progress)
    compiler = find_compiler()
    if manifest.dtype == "bfloat16":  # the compiler takes float32 or float16 graphs
        print("the export is bfloat16, which Cloud AI 100 lacks: its graphs are written float16 from the checkpoints "
              "(the device computes float16; a bfloat16 weight within float16's range is exact in it)",
              file=sys.stderr)
        manifest = replace(manifest, dtype="float16")
    torch_dtype = DTYPES[manifest.dtype]
    if options.no_stream:
        factor, extra = (NO_STREAM_MEMORY_FLOAT32 if manifest.dtype == "float32" else NO_STREAM_MEMORY_FLOAT16), 0
    else:
        # streamed: the libraries, the draft's embedding and lm_head while calibration runs it, and the largest
        # tensor twice while it is written; float32 graphs add the float16 emulation's sessions
        factor = EMULATION_MEMORY if manifest.dtype == "float32" else 0.0
        extra = 2**30 + 4 * largest_tensor_bytes([target_dir, draft_dir], torch_dtype.itemsize)
    with lowered_output(source, out, request, (target_dir, draft_dir), memory_factor=factor,
                        extra_memory=extra) as tmp:
        if options.no_stream:
            with stages.stage("loading target and draft"):
                tapped, draft = load_tapped_pair(target_dir, draft_dir, manifest.target_layer_ids, manifest.dtype)
                sources = None
        else:
            with stages.stage("building target and draft without their weights"):
                tapped, draft = meta_pair(target_dir, draft_dir, manifest.target_layer_ids, manifest.dtype)
                sources = pair_sources(tapped, draft, target_dir, draft_dir)
        with stages.stage("calibrating float16 range"), \
                weights_on_demand([tapped, draft], sources, torch_dtype) if sources else nullcontext():
            calibration = calibrate_for_fp16(tapped, draft, manifest, "-convert-to-fp16")
        with stages.stage("exporting retained-state graphs"):
            export_retained(tapped, draft, manifest, options, tmp, calibration["fc_scale"], sources, stages.fraction)
            shared, _ = share_initializers(tmp, "draft.onnx", "target.onnx", manifest.vocab_size)
        with stages.stage("checking graphs and writing compiler inputs"):
            report = {name: check_graph(tmp / f"{name}.onnx", options.opset) for name in ("target", "draft")}
            graphs, fp32_outputs = {}, {}
            for name, layers, heads, dim in (("target", tapped.num_layers, tapped.num_kv_heads, tapped.head_dim),
                                             ("draft", len(draft.layers), draft.num_kv_heads, draft.head_dim)):
                kv_in, kv_out = kv_names(layers)
                graphs[name] = graph_spec(tmp / f"{name}.onnx", layers, heads, dim, kv_in, kv_out)
                graph_proto = onnx.load(str(tmp / f"{name}.onnx"), load_external_data=False)
                fp32_outputs[name] = norm_outputs(graph_proto) + draw_outputs(graph_proto)
            lowered = replace(
                manifest, target=graphs["target"], draft=graphs["draft"], form="retained", ctx_len=options.ctx_len,
                costs=None, prefill_len=options.prefill_len, opset=options.opset,
                kv_layout="batch,kv_heads,ctx_len,head_dim",
                lowering=Lowering(backend="ai100", options=asdict(options), shared_with_target=shared,
                                  compute_context_lengths=options.compute_context_lengths(), calibration=calibration,
                                  report={"graphs": report, "precision_plan": plan_report(fp32_outputs, calibration),
                                          "compile_commands": compile_commands(options),
                                          "round_traffic_bytes": round_traffic(
                                              manifest, draft.spec.config.hidden_size)}))
            write_compiler_inputs(tmp, lowered, options, fp32_outputs)
            copy_tokenizer_files(source, tmp)
            del tapped, draft  # the emulation's sessions hold the graphs' weights themselves
        with stages.stage("emulating the compiler's float16"):
            emulation = emulation_check(tmp, lowered, options, fp32_outputs, _emulation_prompts(manifest, options),
                                        EMULATION_TOKENS)
            lowered.lowering.report["fp16_emulation"] = emulation
            lowered.save(tmp)
            _warn_if_unequal(emulation)
        with stages.stage("compiling" if compiler and not options.dry_run else "compile skipped"):
            if compiler and not options.dry_run:
                _compile(tmp, compiler)
                lowered.lowering.compiled = True
                lowered.save(tmp)
    if not compiler and not options.dry_run:
        raise DFlashError(f"qaic-compile not found (PATH, {SDK_DIR}/exec): wrote {out}/compile.sh; run it on a "
                          "machine with the Cloud AI 100 SDK, or pass --dry-run")
    return lowered
