"""`lower --target coreml`: one stateful multifunction mlprogram package converted from the PyTorch modules.

coremltools has no ONNX frontend since 6.0, so the lowering converts the PyTorch modules behind the
export (the checkpoints recorded in OUT's manifest, the same weights) with `torch.jit.trace` +
`ct.convert`: mlprogram, float16 compute, K/V as `ct.StateType` (macOS 15 / iOS 18), optionally block-wise
int4/int8 weights (`--bits`). The modules are the conversion-friendly forms in dflash_onnx/exporter/models/stateful.py
(the same math as the HF model; tested against it). Each call size is its own function with fixed shapes
(coremltools' recommendation for LLMs: the Neural Engine takes fixed shapes): the target's `decode` (1
token), `verify` (a verify's tokens: block_size, or block_size + 1 for a DSpark draft) and `prefill`
(--prefill-len), the draft's `draft` (up to a verify's new context rows) and `draft_prefill` (a prefill chunk
of them). `ct.utils.save_multifunction` writes them into model.mlpackage with each weight stored once: the
three target functions share theirs, and the draft's
embedding and lm_head are the target's. Target functions share one state object (its K/V), the draft's
theirs; the retained runners pad a call to the smallest function with consecutive positions. The package
is then evaluated in numpy from its spec against the converted modules (check.py).

With --layers-per-part the target is converted in parts (each call size's function per part, `decode_0`,
`decode_1`, ..., each part with its own layers' states; StatefulTarget) and the pair is never loaded: the
calibration runs the meta pair with each module's weights read when it is called, and each part's weights (then
the draft's) are read from the checkpoints for its conversion and its check calls only.
"""

from __future__ import annotations

import json
import shutil
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from dflash_onnx.artifacts.progress import Stages
from dflash_onnx.artifacts.publish import copy_tokenizer_files
from dflash_onnx.exporter.lazy_weights import pair_sources, weights_loaded, weights_on_demand
from dflash_onnx.exporter.models.stateful import StatefulDraft, StatefulTarget
from dflash_onnx.exporter.pair import load_tapped_pair, meta_pair
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import GraphSpec, Lowering, Manifest, TensorSpec
from dflash_onnx.targets.backend import LowerRequest
from dflash_onnx.targets.coreml.check import PART_OUTPUTS, check_packages
from dflash_onnx.targets.coreml.options import CoremlOptions
from dflash_onnx.targets.coreml.session import import_coremltools, part_functions, target_parts
from dflash_onnx.targets.coreml.sizes import disk_bytes, estimate, part_conversion_bytes
from dflash_onnx.targets.fp16_calibration import calibrate_for_fp16
from dflash_onnx.targets.lowering import lowered_output, refuse_unbuilt, start_lowering

TESTED_WITH = ("coremltools 9.0 with torch 2.13.0 (TorchScript frontend; coremltools warns it was tested up to "
               "torch 2.7)")


def _quantized(model, bits: int, group_size: int):
    """`model` with its weights block-wise quantized (symmetric int4/int8, one scale per `group_size` inputs)."""
    ct = import_coremltools()
    from coremltools.optimize.coreml import OpLinearQuantizerConfig, OptimizationConfig, linear_quantize_weights

    config = OpLinearQuantizerConfig(mode="linear_symmetric", dtype=f"int{bits}", granularity="per_block",
                                     block_size=group_size)
    try:
        return linear_quantize_weights(model, config=OptimizationConfig(global_config=config))
    except Exception as exc:  # coremltools raises many types; keep its message
        raise DFlashError(f"coremltools could not quantize to {bits} bits: {exc} ({ct.__version__})") from exc


def _float32_after(inputs: set[str]):
    """coremltools' compute precision: float16, except every op that depends on one of `inputs` (a DSpark chain's
    uniforms and temperature). Its draw (softmax / temperature, running sum, the uniform's point) then runs in
    float32 from the row it returns as `logits`, and every row after a draw, biased by the token drawn, is computed
    and returned in float32: rejection sampling reads the very rows each token was drawn from."""
    ct = import_coremltools()
    if not inputs:
        return ct.precision.FLOAT16
    known: dict[int, bool] = {}  # op -> whether it depends on `inputs`

    def arguments(op) -> list:
        return [v for value in op.inputs.values() for v in (value if isinstance(value, (list, tuple)) else (value,))]

    def depends(op) -> bool:
        """Iteratively (a large draft's chains run deeper than Python's recursion limit)."""
        stack = [op]
        while stack:
            current = stack[-1]
            if id(current) in known:
                stack.pop()
                continue
            given = arguments(current)
            pending = [v.op for v in given if v.op is not None and id(v.op) not in known]
            if pending and not any(v.name in inputs for v in given):
                stack.extend(pending)
                continue
            known[id(current)] = any(v.name in inputs or (v.op is not None and known[id(v.op)]) for v in given)
            stack.pop()
        return known[id(op)]

    def in_float16(op) -> bool:
        return not depends(op)
    return ct.transform.FP16ComputePrecision(op_selector=in_float16)


def _convert(module, example: tuple, inputs: list, outputs: list[str], path: Path,
             bits: int | None = None, group_size: int = 32, float32_after: tuple[str, ...] = ()) -> None:
    ct = import_coremltools()
    try:
        with torch.no_grad():
            traced = torch.jit.trace(module, example, check_trace=False)
    except Exception as exc:  # torch raises many types; keep its message
        raise DFlashError(f"torch.jit.trace failed on {type(module).__name__}: {exc} ({TESTED_WITH})") from exc
    states = [ct.StateType(wrapped_type=ct.TensorType(shape=tuple(getattr(module, n).shape), dtype=np.float16),
                           name=n) for n in module.state_names]
    try:
        # the logits of a chain drawn in float32 are returned as computed (see _float32_after)
        wide = {"logits"} if float32_after else set()
        model = ct.convert(traced, inputs=inputs, states=states,
                           outputs=[ct.TensorType(name=n, **({"dtype": np.float32} if n in wide else {}))
                                    for n in outputs],
                           minimum_deployment_target=ct.target.macOS15, convert_to="mlprogram",
                           compute_precision=_float32_after(set(float32_after)))
    except Exception as exc:  # coremltools raises many types; keep its message
        raise DFlashError(f"coremltools could not convert {type(module).__name__}: {exc} ({TESTED_WITH})") from exc
    converted = model
    if bits:
        model = _quantized(model, bits, group_size)
    model.save(str(path))
    for written in {id(m): m for m in (converted, model)}.values():
        _discard(written)


def _discard(model) -> None:
    """Remove the temporary package coremltools wrote `model` to: it keeps them until the process exits, which in
    a lowering of many functions fills the disk (docs/coreml.md#the-target-in-parts)."""
    if getattr(model, "is_temp_package", False):
        shutil.rmtree(model.package_path, ignore_errors=True)


PACKAGE = "model.mlpackage"
ESTIMATE = "estimate.json"  # what --dry-run writes
# peak memory of a whole-target conversion over the pair's float32 size, with margin: the modules are traced in
# float32 whatever the export's dtype (docs/coreml.md#memory-and-time)
WHOLE_CONVERSION_MEMORY = 7.5


def _dry_run(source: Path, out: Path, request: LowerRequest, manifest: Manifest, options: CoremlOptions,
             functions: dict, checkpoints: tuple[Path, Path]) -> Manifest:
    """OUT with estimate.json only (no manifest: nothing in it runs): the sizes estimated from the checkpoints.
    Returns the manifest the lowering would write, the estimate in its report."""
    found = estimate(*checkpoints, options)
    with lowered_output(source, out, request, checkpoints) as tmp:
        (tmp / ESTIMATE).write_text(json.dumps({**found, "options": asdict(options)}, indent=1))
    return replace(manifest, form="retained", costs=None, ctx_len=options.ctx_len, prefill_len=options.prefill_len,
                   dtype="float16", lowering=Lowering(backend="coreml", options=asdict(options),
                                                      padding="consecutive", functions=functions,
                                                      report={"estimate": found}))


def _combine(parts: Path, names: list[str], package: Path) -> None:
    """The single-function packages `names` in `parts` as the functions of one package (identical weights stored
    once; the default function the first), each removed once combined."""
    ct = import_coremltools()
    descriptor = ct.utils.MultiFunctionDescriptor()
    for name in names:
        descriptor.add_function(str(parts / f"{name}.mlpackage"), src_function_name="main", target_function_name=name)
    descriptor.default_function_name = names[0]
    try:
        ct.utils.save_multifunction(descriptor, str(package))
    except Exception as exc:  # coremltools raises many types; keep its message
        raise DFlashError(f"coremltools could not write the multifunction package: {exc} ({TESTED_WITH})") from exc
    for name in names:
        shutil.rmtree(parts / f"{name}.mlpackage")


def _spec(file: str, inputs: dict[str, tuple[str, list]], outputs: dict[str, tuple[str, list]], layers: int,
          kv_heads: int, head_dim: int) -> GraphSpec:
    return GraphSpec(file=file, inputs=[TensorSpec(n, d, s) for n, (d, s) in inputs.items()],
                     outputs=[TensorSpec(n, d, s) for n, (d, s) in outputs.items()], num_layers=layers,
                     num_kv_heads=kv_heads, head_dim=head_dim, kv_inputs=[], kv_outputs=[])


def _target_call(target: StatefulTarget, rows: int, dtype: torch.dtype) -> tuple[tuple, list, list[str]]:
    """Example inputs (floats in `dtype`, the trace's), input types and output names of one target function of
    `rows` tokens (a part's: see StatefulTarget)."""
    ct = import_coremltools()
    positions = torch.arange(rows, dtype=torch.int32)[None]
    position_type = ct.TensorType("position_ids", shape=(1, rows), dtype=np.int32)
    outputs = ["greedy_ids", "logits", "context_hidden"] if target.last else PART_OUTPUTS
    if target.first:
        return ((torch.zeros(1, rows, dtype=torch.int32), positions),
                [ct.TensorType("input_ids", shape=(1, rows), dtype=np.int32), position_type], outputs)
    return ((torch.zeros(1, rows, target.width, dtype=dtype), positions,
             torch.zeros(1, rows, target.draft_width, dtype=dtype)),
            [ct.TensorType("hidden_in", shape=(1, rows, target.width), dtype=np.float16), position_type,
             ct.TensorType("tap_sum_in", shape=(1, rows, target.draft_width), dtype=np.float16)], outputs)


def _selector_outputs(draft, proposals: int) -> dict[str, tuple[str, list]]:
    """A DFlash2 draft's candidates and their scores after each previous candidate, which sampling walks."""
    if not draft.extra_outputs():
        return {}
    k = draft.spec.selector_top_k
    return {"candidates": ("int32", [1, proposals, k]), "candidate_scores": ("float16", [1, proposals, k, k])}


def _parts_hint(num_layers: int, target_dir: Path, draft_dir: Path) -> str:
    """What to do when the whole target's conversion does not fit: convert it in parts, with their memory."""
    per_part = max(1, num_layers // 6)
    need = part_conversion_bytes(target_dir, draft_dir, target_parts(num_layers, per_part))
    return (f"convert the target in parts, e.g. --layers-per-part {per_part} (about {need / 2**30:.1f} GiB at its "
            "peak), or use a machine with more memory")


def lower_coreml(source: Path, out: Path, options: CoremlOptions | None = None,
                 request: LowerRequest | None = None) -> Manifest:
    """Write COREML_DIR: model.mlpackage (stateful, multifunction) and the manifest; with --dry-run only
    estimate.json (the sizes estimated from the checkpoints)."""
    options, request = options or CoremlOptions(), request or LowerRequest()
    ct = import_coremltools()
    manifest, (target_dir, draft_dir) = start_lowering(source, out, options, request, reexport=True)
    refuse_unbuilt(manifest, "coreml", "CoreML")
    # verify_rows: a verify's tokens (a DSpark draft's anchor slot proposes too: block + 1), and the context rows the
    # draft's next call ingests
    block, verify_rows, chunk = manifest.block_size, manifest.verify_rows, options.prefill_len
    parts = target_parts(manifest.target.num_layers, options.layers_per_part)
    prefill = {"prefill": chunk} if chunk != verify_rows else {}  # --prefill-len of a verify: verify's function
    functions = {"target": {"input": "input_ids", "rows": {"decode": 1, "verify": verify_rows, **prefill},
                            **({"parts": [list(p) for p in parts]} if len(parts) > 1 else {})},
                 "draft": {"input": "context_hidden", "rows": {"draft": verify_rows,
                                                               **{f"draft_{k}": v for k, v in prefill.items()}}}}
    names = {graph: part_functions(spec) for graph, spec in functions.items()}
    # building or loading, calibrating, one conversion per function, writing the package(s) (in parts: one per part
    # and the draft's), the check
    packages = len(parts) + 1 if len(parts) > 1 else 1
    stages = Stages(3 + packages + sum(len(fns) for graph in names.values() for fns in graph.values()),
                    enabled=request.progress)
    if options.dry_run:
        return _dry_run(source, out, request, manifest, options, functions, (target_dir, draft_dir))
    streamed = len(parts) > 1
    # peak memory: in parts, the largest conversion (sizes.py); whole, the pair in float32 times a factor
    memory = 0.0 if streamed else WHOLE_CONVERSION_MEMORY * 4 / np.dtype(manifest.numpy_dtype).itemsize
    extra = part_conversion_bytes(target_dir, draft_dir, parts, (len(names["target"]), len(names["draft"]))) \
        if streamed else 0
    hint = "" if streamed else _parts_hint(manifest.target.num_layers, target_dir, draft_dir)
    disk = disk_bytes(target_dir, draft_dir, options, parts, (len(names["target"]), len(names["draft"])))
    with lowered_output(source, out, request, (target_dir, draft_dir), memory_factor=memory, extra_memory=extra,
                        memory_hint=hint, disk_bytes=disk) as tmp:
        if streamed:
            with stages.stage("building target and draft without their weights"):
                tapped, draft = meta_pair(target_dir, draft_dir, manifest.target_layer_ids, "float32")
                sources = pair_sources(tapped, draft, target_dir, draft_dir)

            def weights(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> AbstractContextManager:
                return weights_loaded([module], sources, dtype)
            # traced with float16 weights: coremltools converts float32 weights through several float32 copies
            # (docs/coreml.md#the-target-in-parts)
            trace_dtype = torch.float16
        else:
            with stages.stage("loading target and draft"):
                tapped, draft = load_tapped_pair(target_dir, draft_dir, manifest.target_layer_ids, "float32")

            def weights(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> AbstractContextManager:
                return nullcontext()
            trace_dtype = torch.float32
        with stages.stage("calibrating float16 range"), \
                weights_on_demand([tapped, draft], sources, torch.float32) if streamed else nullcontext():
            calibration = calibrate_for_fp16(tapped, draft, manifest)
        converted = tmp / "functions"
        with weights(draft.fc):  # each part keeps the columns of fc for its taps
            targets = [StatefulTarget(tapped, draft, options.ctx_len, calibration["fc_scale"], trace_dtype,
                                      layers).eval() for layers in parts]
        files = {"target": [f"target_part{k}.mlpackage" for k in range(len(parts))] if streamed else [PACKAGE],
                 "draft": ["draft.mlpackage"] if streamed else [PACKAGE]}
        for k, target in enumerate(targets):
            with weights(target, trace_dtype):
                for rows in functions["target"]["rows"].values():
                    function = names["target"][rows][k]
                    layers = f", layers {target.start}..{target.stop - 1}" if streamed else ""
                    with stages.stage(f"converting the target's {function} function ({rows} tokens{layers})"):
                        example, inputs, outputs = _target_call(target, rows, trace_dtype)
                        _convert(target, example, inputs, outputs, converted / f"{function}.mlpackage", options.bits,
                                 options.group_size)
            if streamed:  # combined at once: the disk holds one part's functions, not every part's
                with stages.stage(f"writing {files['target'][k]}"):
                    _combine(converted, [names["target"][rows][k] for rows in names["target"]],
                             tmp / files["target"][k])
        stateful_draft = StatefulDraft(draft, options.ctx_len, block, trace_dtype).eval()
        width, proposals = draft.spec.config.hidden_size, verify_rows - 1
        with weights(stateful_draft, trace_dtype):
            for name, context_rows in functions["draft"]["rows"].items():
                with stages.stage(f"converting the draft's {name} function ({context_rows} context rows)"):
                    ids = torch.zeros(1, block, dtype=torch.int32)
                    context = torch.arange(context_rows, dtype=torch.int32)[None]
                    chain = [torch.full((1, proposals), 0.5), torch.zeros(1)] if stateful_draft.extra_inputs() \
                        else []
                    _convert(stateful_draft, (ids, torch.zeros(1, context_rows, width, dtype=trace_dtype), context,
                                              context[:, :1] + context_rows +
                                              torch.arange(block, dtype=torch.int32)[None], *chain),
                             [ct.TensorType("input_ids", shape=(1, block), dtype=np.int32),
                              ct.TensorType("context_hidden", shape=(1, context_rows, width), dtype=np.float16),
                              ct.TensorType("ctx_position_ids", shape=(1, context_rows), dtype=np.int32),
                              ct.TensorType("position_ids", shape=(1, block), dtype=np.int32),
                              *[ct.TensorType(n, shape=tuple(t.shape), dtype=np.float32)
                                for n, t in zip(stateful_draft.extra_inputs(), chain)]],
                             stateful_draft.output_names(), converted / f"{name}.mlpackage",
                             options.bits, options.group_size, tuple(stateful_draft.extra_inputs()))
        with stages.stage(f"writing {files['draft'][0]} (one copy of each weight)"):
            if streamed:  # a package per part and one for the draft: save_multifunction holds all it combines
                _combine(converted, [fn for fns in names["draft"].values() for fn in fns], tmp / files["draft"][0])
                functions["target"]["packages"] = files["target"]
            else:
                _combine(converted, [fn for graph in names.values() for fns in graph.values() for fn in fns],
                         tmp / PACKAGE)
            converted.rmdir()
        hidden_size, vocab = draft.spec.config.hidden_size, manifest.vocab_size
        graphs = {
            "target": _spec(files["target"][0], {"input_ids": ("int32", [1, "seq_len"]),
                                                 "position_ids": ("int32", [1, "seq_len"])},
                            {"greedy_ids": ("int32", [1, "seq_len"]), "logits": ("float16", [1, "seq_len", vocab]),
                             "context_hidden": ("float16", [1, "seq_len", hidden_size])},
                            tapped.num_layers, tapped.num_kv_heads, tapped.head_dim),
            "draft": _spec(files["draft"][0], {"input_ids": ("int32", [1, block]),
                                               "context_hidden": ("float16", [1, "seq_len", hidden_size]),
                                               "ctx_position_ids": ("int32", [1, "seq_len"]),
                                               "position_ids": ("int32", [1, block]),
                                               **{n: ("float32", shape) for n, shape in
                                                  zip(stateful_draft.extra_inputs(), ([1, proposals], [1]))}},
                           {"draft_ids": ("int32", [1, proposals]), "draft_confidence": ("float16", [1, proposals]),
                            **{name: ("float16", [1, proposals]) for name in draft.signal_outputs()},
                            "logits": ("float32" if stateful_draft.extra_inputs() else "float16",
                                       [1, proposals, vocab]),
                            **_selector_outputs(draft, proposals)},
                           len(draft.layers), draft.num_kv_heads, draft.head_dim),
        }
        copy_tokenizer_files(source, tmp)
        lowered = replace(manifest, target=graphs["target"], draft=graphs["draft"], form="retained", costs=None,
                          ctx_len=options.ctx_len, prefill_len=chunk, dtype="float16",
                          kv_layout="state: batch,kv_heads,ctx_len,head_dim",
                          lowering=Lowering(backend="coreml", options=asdict(options), padding="consecutive",
                                            functions=functions, row_multiple=verify_rows,
                                            calibration=calibration, report={
                                                "states": {"target": [n for t in targets for n in t.state_names],
                                                           "draft": stateful_draft.state_names},
                                                "converter": TESTED_WITH}))
        with stages.stage("checking the packages (evaluated in numpy) against the converted modules"):
            lowered.lowering.max_relative_difference = check_packages(
                tmp, lowered, targets if streamed else targets[0], stateful_draft, options.bits, options.group_size,
                weights)
        lowered.save(tmp)
    return lowered
