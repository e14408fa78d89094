"""Qualcomm Cloud AI 100: retained-state graphs, specializations, custom IO, compile, and a qaicrt Session.

`lower_ai100` re-exports target and draft from the source checkpoints (recorded in OUT's manifest)
in the retained form of `dflash_onnx.models.retained`, writes what `qaic-compile` needs next to them
(`*_specializations.json`, `*_custom_io.yaml`, `compile.sh`) and compiles when the SDK is present.
The same graphs run on ONNX Runtime with the retained state fed back by the host, which is how they
are proven lossless without the hardware.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import Manifest, load_export
from passes.calibration import FP16_MAX, power_of_two_scale

SDK_DIR = Path("/opt/qti-aic")
DEFAULT_OPSET = 18  # AI 100 takes 17 or 18; torch's dynamo exporter emits 18 and newer
KV_DTYPES = ("float16", "mxint8")


@dataclass(frozen=True)
class Ai100Options:
    ctx_len: int = 4096
    prefill_len: int = 128
    num_cores: int = 16
    mxfp6_matmul: bool = False
    kv_dtype: str = "float16"
    opset: int = DEFAULT_OPSET

    def validate(self, block_size: int) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise DFlashError(f"--kv-dtype {self.kv_dtype} is not one of {', '.join(KV_DTYPES)}")
        if self.opset != 18:
            raise DFlashError(f"AI 100 graphs use opset 18 here (17 is not reachable from torch's exporter), "
                              f"not {self.opset}")
        if self.prefill_len % block_size or self.prefill_len == block_size:
            raise DFlashError(f"--prefill-len {self.prefill_len} must be a multiple of the block size {block_size} "
                              "and larger than it")
        if self.ctx_len <= self.prefill_len:
            raise DFlashError(f"--ctx-len {self.ctx_len} must exceed --prefill-len {self.prefill_len}")
        if not 1 <= self.num_cores <= 16:
            raise DFlashError(f"--num-cores {self.num_cores} must be in 1..16")


def kv_names(num_layers: int) -> tuple[list[str], list[str]]:
    """QEfficient's retained-state names: past_key.i / past_value.i and their *_RetainedState outputs."""
    inputs = [f"past_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    return inputs, [f"{name}_RetainedState" for name in inputs]


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


def find_compiler() -> list[str] | None:
    """`qaic-compile` (SDK >= 1.22), else `qaic-exec -compile-only`, on PATH or under /opt/qti-aic/exec."""
    for name, extra in (("qaic-compile", []), ("qaic-exec", ["-compile-only"])):
        found = shutil.which(name) or (str(SDK_DIR / "exec" / name) if (SDK_DIR / "exec" / name).is_file() else None)
        if found:
            return [found, *extra]
    return None


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
    import onnx

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


def calibrate_fc_scale(tapped, draft, vocab_size: int, mask_token_id: int, block_size: int, prompts: int = 4,
                       length: int = 64, seed: int = 0) -> dict:
    """Run target and draft on random prompts: the largest activation anywhere (is float16 safe?) and the
    fc scale keeping fc's output squares (RMSNorm) inside float16: |fc(x)| / scale <= 128."""
    import torch

    largest = {"value": 0.0, "where": ""}

    def hook(name):
        def record(_module, _args, output):
            for tensor in output if isinstance(output, tuple) else (output,):
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
                    peak = float(tensor.detach().float().abs().max())
                    if peak > largest["value"]:
                        largest.update(value=peak, where=name)
        return record

    modules = [(f"target.{n}", m) for n, m in tapped.lm.named_modules() if n]
    modules += [(f"draft.{n}", m) for n, m in draft.named_modules() if n]
    handles = [module.register_forward_hook(hook(name)) for name, module in modules]
    generator = torch.Generator().manual_seed(seed)
    fc_peak = 0.0
    try:
        with torch.no_grad():
            for _ in range(prompts):
                ids = torch.randint(0, vocab_size, (1, length), generator=generator)
                out = tapped(ids, torch.arange(length)[None], *tapped.empty_cache(dtype=tapped.lm.dtype))
                fc_peak = max(fc_peak, float(draft.fc(out[2]).float().abs().max()))
                block = torch.full((1, block_size), mask_token_id)
                block[0, 0] = out[1][0, -1]
                draft(block, out[2], torch.arange(length + block_size)[None], *draft.empty_cache(dtype=out[2].dtype))
    finally:
        for handle in handles:
            handle.remove()
    scale = power_of_two_scale(fc_peak)
    return {"largest_activation": largest["value"], "largest_activation_at": largest["where"],
            "fc_output_peak": fc_peak, "fc_scale": scale, "fp16_overflow": largest["value"] > FP16_MAX}


def round_traffic(manifest: Manifest, hidden_size: int, itemsize: int = 4) -> dict[str, int]:
    """Host<->device bytes of one greedy DFlash round (draft step + target verify) with retained state on
    the device: what this design moves, and what shipping the draft's logits instead of ids would add."""
    block, ids = manifest.block_size, 8
    draft_in = block * ids + block * hidden_size * itemsize + 2 * block * ids  # ids, context rows, 2 positions
    draft_out = (block - 1) * ids
    target_in = 2 * block * ids
    target_out = block * ids + block * hidden_size * itemsize  # greedy ids + context rows for the next step
    logits = (block - 1) * manifest.vocab_size * itemsize
    return {"draft_in": draft_in, "draft_out": draft_out, "target_in": target_in, "target_out": target_out,
            "round_total": draft_in + draft_out + target_in + target_out,
            "draft_logits_if_shipped": logits}


def _export(module, args, input_names, output_names, dynamic_shapes, opset, path: Path) -> dict:
    """Export, then share cos/sin per position stream (rope-fusion's opset-17/18 form); returns its report."""
    from dflash_onnx.export import export_program
    from passes.rope_fusion import fuse

    program = export_program(module, args, input_names, output_names, dynamic_shapes, opset)
    hoisting = fuse(program.model, "hoist")
    program.save(str(path), external_data=True)
    return hoisting


def export_retained(tapped, draft, manifest: Manifest, options: Ai100Options, out: Path,
                    fc_scale: float) -> dict[str, dict]:
    import torch

    from dflash_onnx.models.retained import RetainedDraft, RetainedTarget

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
                           ["draft_ids", "logits", *kv_out],
                           ({0: batch}, {0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch},
                            tuple({0: batch, 2: ctx} for _ in range(2 * n))),
                           options.opset, out / "draft.onnx")
    return {"target": target, "draft": draft_report}


def lower_ai100(source: Path, out: Path, options: Ai100Options, dry_run: bool = False,
                target_dir: Path | None = None, draft_dir: Path | None = None, progress: bool = True) -> Manifest:
    """Write AI100_DIR (graphs, specializations, custom IO, compile.sh, manifest); compile if possible."""
    import torch

    from dflash_onnx.export import (
        check_out_dir,
        copy_tokenizer_files,
        graph_spec,
        publish_dir,
        share_initializers,
    )
    from dflash_onnx.models.target import TappedTarget
    from dflash_onnx.pair import load_draft, load_target
    from dflash_onnx.progress import Stages

    manifest = load_export(source, "lower")
    options.validate(manifest.block_size)
    target_dir, draft_dir = manifest.checkpoints(target_dir, draft_dir, flag="--{kind}-dir")
    out = Path(out)
    check_out_dir(out, (target_dir, draft_dir, Path(source)), overwrite=False)
    stages = Stages(5, enabled=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with stages.stage("loading target and draft"), torch.no_grad():
            lm = load_target(target_dir, manifest.dtype)
            draft = load_draft(draft_dir, lm, manifest.dtype)
            tapped = TappedTarget(lm, manifest.target_layer_ids).eval()
        with stages.stage("calibrating float16 range"):
            calibration = calibrate_fc_scale(tapped, draft, manifest.vocab_size, manifest.mask_token_id,
                                             manifest.block_size)
            if calibration["fp16_overflow"]:
                print(f"warning: activation {calibration['largest_activation']:.3g} at "
                      f"{calibration['largest_activation_at']} overflows float16 (-convert-to-fp16)", file=sys.stderr)
        with stages.stage("exporting retained-state graphs"):
            rope_hoisting = export_retained(tapped, draft, manifest, options, tmp, calibration["fc_scale"])
            share_initializers(tmp, "draft.onnx", "target.onnx", manifest.vocab_size)
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
            compiler = find_compiler()
            script = tmp / "compile.sh"
            script.write_text(compile_script(compile_commands(compiler or ["qaic-compile"], options)))
            script.chmod(0o755)
            copy_tokenizer_files(source, tmp)
            lowered = replace(
                manifest, target=graphs["target"], draft=graphs["draft"], form="retained", ctx_len=options.ctx_len,
                prefill_len=options.prefill_len, opset=options.opset, kv_layout="batch,kv_heads,ctx_len,head_dim",
                lowering={"target": "ai100", "options": options.__dict__, "calibration": calibration,
                          "graphs": report, "rope_hoisting": rope_hoisting, "compiled": False,
                          "round_traffic_bytes": round_traffic(manifest, draft.spec.config.hidden_size)},
            )
            lowered.save(tmp)
        with stages.stage("compiling" if compiler and not dry_run else "compile skipped"):
            if compiler and not dry_run:
                for command in compile_commands(compiler, options):
                    done = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise DFlashError(f"{command[0]} failed ({done.returncode}): "
                                          f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
                lowered.lowering["compiled"] = True
                lowered.save(tmp)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not compiler and not dry_run:
        raise DFlashError(f"qaic-compile not found (PATH, {SDK_DIR}/exec): wrote {out}/compile.sh; run it on a "
                          "machine with the Cloud AI 100 SDK, or pass --dry-run")
    return lowered


class Ai100Session:
    """A compiled QPC on Cloud AI 100 through qaicrt; retained-state buffers never leave the device.

    Output buffers are sized per call from the ONNX graph's output dims (the input shapes pick the
    specialization); outputs not asked for, such as logits during greedy decoding, are skipped so they
    are never copied to the host.
    """

    retains_state = True

    def __init__(self, qpc_dir: Path, graph_file: Path, device_id: int = 0):
        import onnx

        qaicrt, aicapi = _import_sdk()
        qpc_path = Path(qpc_dir)
        if not qpc_path.is_dir():
            raise DFlashError(f"{qpc_path} does not exist: compile first (AI100_DIR/compile.sh)")
        graph = onnx.load(str(graph_file), load_external_data=False)
        shape = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        self.input_dims = {v.name: shape(v) for v in graph.graph.input}
        self.output_dims = {v.name: shape(v) for v in graph.graph.output}
        self._qaicrt = qaicrt
        self.context = qaicrt.Context()
        self.queue = qaicrt.Queue(self.context, device_id)
        qpc = qaicrt.Qpc(str(qpc_path))
        status, raw = qpc.getIoDescriptor()
        if status != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError(f"cannot read the IO descriptor of {qpc_path}")
        descriptor = aicapi.IoDesc()
        descriptor.ParseFromString(bytes(raw))
        self.bindings = list(descriptor.selected_set.bindings)
        self.index = {b.name: b.index for b in self.bindings}
        types = {aicapi.FLOAT_TYPE: np.float32, aicapi.FLOAT_16_TYPE: np.float16,
                 aicapi.INT64_I_TYPE: np.int64, aicapi.INT32_I_TYPE: np.int32}
        self.dtypes = {b.name: np.dtype(types[b.type]) for b in self.bindings}
        self.input_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_INPUT]
        self.output_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_OUTPUT]
        self.program = qaicrt.Program(self.context, device_id, qpc, qaicrt.QAicProgramProperties())
        if self.program.load() != qaicrt.QStatus.QS_SUCCESS or self.program.activate() != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError(f"cannot load {qpc_path} on AI 100 device {device_id}")
        self.exec_obj = qaicrt.ExecObj(self.context, self.program)
        self.buffers = [qaicrt.QBuffer(bytes(b.size)) for b in self.bindings]
        self.dims = qaicrt.BufferDimensionsVecRef([(self.dtypes[b.name].itemsize, list(b.dims)) for b in self.bindings])
        self._skip([n for n in self.input_names + self.output_names if n.startswith("past_")])

    def _put(self, name: str, array: np.ndarray) -> None:
        index = self.index[name]
        self.buffers[index] = self._qaicrt.QBuffer(np.ascontiguousarray(array).tobytes())
        self.dims[index] = (array.itemsize, list(array.shape) if array.ndim else [1])

    def _skip(self, names: list[str]) -> None:
        for name in names:
            self._put(name, np.array([], dtype=self.dtypes[name]))

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        qaicrt = self._qaicrt
        visible = [n for n in self.output_names if not n.startswith("past_")]
        wanted = output_names or visible
        symbols = {}
        for name, array in feeds.items():
            if name.startswith("past_"):
                continue
            self._put(name, array.astype(self.dtypes[name], copy=False))
            symbols.update({d: n for d, n in zip(self.input_dims[name], array.shape) if isinstance(d, str)})
        for name in visible:
            if name in wanted:
                shape = [symbols[d] if isinstance(d, str) else d for d in self.output_dims[name]]
                self._put(name, np.zeros(shape, dtype=self.dtypes[name]))
            else:
                self._skip([name])
        if self.exec_obj.setData(self.buffers, self.dims) != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError("AI 100: setData failed")
        if self.queue.enqueue(self.exec_obj) != qaicrt.QStatus.QS_SUCCESS or \
                self.exec_obj.waitForCompletion() != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError("AI 100: the run failed (input shapes must match a compiled specialization)")
        status, outputs = self.exec_obj.getData()
        if status != qaicrt.QStatus.QS_SUCCESS:
            raise DFlashError("AI 100: getData failed")
        result = {}
        for name in wanted:
            index = self.index[name]
            result[name] = np.frombuffer(bytes(outputs[index]), self.dtypes[name]).reshape(self.dims[index][1])
        return result


def _import_sdk():
    """qaicrt and the IO-descriptor protobufs from the Cloud AI 100 SDK, or a clear error."""
    import platform

    for extra in (f"{SDK_DIR}/dev/lib/{platform.machine()}", f"{SDK_DIR}/dev/python"):
        if os.path.isdir(extra) and extra not in sys.path:
            sys.path.append(extra)
    try:
        import QAicApi_pb2 as aicapi
        import qaicrt
    except ImportError:
        raise DFlashError(
            "--backend ai100 needs the Cloud AI 100 platform and apps SDKs (qaicrt, QAicApi_pb2 under "
            f"{SDK_DIR}); on other machines run the same graphs with --backend ort"
        ) from None
    return qaicrt, aicapi
