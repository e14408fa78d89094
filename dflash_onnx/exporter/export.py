"""torch -> ONNX for the target and the draft, written atomically into one directory with its manifest.

The draft graph is specialized to one block size (static block axis); every other axis is dynamic.
The target's embedding and lm_head are stored once: the draft graph's copies point into the
target's external data file. By default the pair is traced without its weights and each weight is written
straight from the checkpoint (lazy_weights.py), so the export's memory does not grow with the model.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import onnx
import onnx_ir
import torch

from dflash_onnx.artifacts.graph_files import graph_spec, share_initializers
from dflash_onnx.artifacts.hub import resolve_pair, snapshot_origin
from dflash_onnx.artifacts.model_dirs import export_bytes, largest_tensor_bytes
from dflash_onnx.artifacts.progress import Stages
from dflash_onnx.artifacts.publish import copy_tokenizer_files, staged_directory
from dflash_onnx.exporter.architectures import refused_unless_built
from dflash_onnx.exporter.export_request import DEFAULT_OPSET, check_export_request
from dflash_onnx.exporter.lazy_weights import LazyWeights, pair_weights
from dflash_onnx.exporter.models.draft import DFlashDraft, DraftSpec
from dflash_onnx.exporter.models.experts import TRANSLATIONS as EXPERT_TRANSLATIONS
from dflash_onnx.exporter.models.experts import add_moe_function, experts_as_one_op, experts_summary
from dflash_onnx.exporter.models.hybrid import HybridTarget, wrap_target
from dflash_onnx.exporter.models.sink_attention import has_sinks, sinks_as_one_op
from dflash_onnx.exporter.models.target import TappedTarget, check_against_hf
from dflash_onnx.exporter.pair import (
    DTYPES,
    LOGIT_TOLERANCE,
    TargetInfo,
    architecture_check_model,
    load_draft,
    load_target,
    meta_pair,
    validate_pair,
)
from dflash_onnx.runtime import __version__
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import GraphSpec, Manifest

# Changes whenever the graphs' inputs or outputs change (2: the draft's `draft_confidence`), so that caches of
# exports (the demo's) are rebuilt rather than reused with an older contract.
GRAPH_REVISION = 2
EXTERNAL_BYTES = 256  # smaller tensors stay inside the graph file (onnx-ir's default, as ONNXProgram.save)
# peak memory counted for an export (docs/export.md#streamed-export): streamed, the libraries and about
# two copies of the largest tensor, with margin; loaded (--no-stream), a factor of the weights written
STREAMED_BASE_MEMORY = 2**30
STREAMED_TENSOR_COPIES = 3
LOADED_MEMORY = 1.5
WRITTEN_MARGIN = 1.05  # free space counted over the weights written


def kv_names(prefix: str, num_layers: int) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def export_program(module: torch.nn.Module, args: tuple, input_names, output_names, dynamic_shapes, opset: int,
                   weights: LazyWeights | None = None):
    """The ONNX program of `module`. A module traced without weights gets its initializers' values from
    `weights` before the exporter's optimizer runs (it folds constants, so it needs them). Mixture-of-experts
    blocks routed through dflash::moe (experts_as_one_op) become dflash::MoE nodes, defined after the optimizer
    (which would inline them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                module, args, input_names=input_names, output_names=output_names,
                dynamic_shapes=dynamic_shapes, dynamo=True, opset_version=opset, verbose=False,
                optimize=weights is None, custom_translation_table=EXPERT_TRANSLATIONS,
            )
            if weights is not None:
                weights.attach(program.model)
                program.optimize()
            add_moe_function(program.model)
        except DFlashError:
            raise
        except Exception as exc:  # the exporter raises many types; keep its summary for the user
            summary = str(exc).split("## Exception summary")[-1].strip().splitlines()
            raise DFlashError(f"torch.onnx.export failed for {type(module).__name__}: {' '.join(summary[:3])}") from exc
    return program


def save_graph(model: onnx_ir.Model, path: Path, written: Callable[[int, int], None] | None = None) -> None:
    """The graph at `path`, its weights in `{name}.data` (what ONNXProgram.save writes), tensor by tensor;
    `written(bytes so far, total)` after each tensor."""
    total = sum(v.const_value.nbytes for v in model.graph.initializers.values()
                if v.const_value is not None and v.const_value.nbytes >= EXTERNAL_BYTES)
    done = 0

    def callback(tensor, info) -> None:
        nonlocal done
        done += tensor.nbytes
        written(done, total)

    onnx_ir.save(model, str(path), external_data=f"{path.name}.data", size_threshold_bytes=EXTERNAL_BYTES,
                 callback=callback if written else None)
    if written:
        written(total, total)


def export_target(target: TappedTarget, out: Path, opset: int, dtype: torch.dtype,
                  weights: LazyWeights | None = None, written: Callable[[int, int], None] | None = None) -> None:
    batch, seq, past = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1), torch.export.Dim("past", min=0)
    with weights.mode if weights else nullcontext():  # fake inputs for a module traced without weights
        ids = torch.randint(0, 8, (2, 3))
        positions = (torch.arange(3) + 4)[None].repeat(2, 1)
        state = tuple(target.sample_state(2, 4, 3, dtype))
    state_in, state_out = target.state_names()
    state_shapes = target.state_dynamic_shapes(batch, past, torch.export.Dim("pending", min=0))
    with experts_as_one_op(target.lm), sinks_as_one_op(target.lm):
        program = export_program(
            target, (ids, positions, *state), ["input_ids", "position_ids", *state_in],
            ["logits", "greedy_ids", "target_hidden", *state_out],
            ({0: batch, 1: seq}, {0: batch, 1: seq}, state_shapes), opset, weights,
        )
    save_graph(program.model, out / "target.onnx", written)


def export_draft(draft: DFlashDraft, block_size: int, out: Path, opset: int, dtype: torch.dtype,
                 weights: LazyWeights | None = None, written: Callable[[int, int], None] | None = None) -> None:
    batch = torch.export.Dim("batch", min=1)
    ctx_new = torch.export.Dim("ctx_new", min=1)
    ctx_past = torch.export.Dim("ctx_past", min=0)
    n = len(draft.layers)
    features = len(draft.spec.target_layer_ids) * draft.spec.config.hidden_size
    with weights.mode if weights else nullcontext():
        ids = torch.randint(0, 8, (2, block_size))
        hidden = torch.zeros(2, 3, features, dtype=dtype)
        positions = (torch.arange(3 + block_size) + 4)[None].repeat(2, 1)
        past_kv = tuple(torch.zeros(2, 4, draft.num_kv_heads, draft.head_dim, dtype=dtype) for _ in range(2 * n))
        # DSpark's sampled chain: a uniform per proposal and a temperature per row (float32, whatever the dtype)
        sampling = (torch.full((2, draft.spec.proposals(block_size)), 0.5), torch.ones(2)) \
            if draft.extra_inputs() else ()
    program = export_program(
        draft, (ids, hidden, positions, *past_kv, *sampling),
        ["input_ids", "target_hidden", "position_ids", *kv_names("past_key_values", n), *draft.extra_inputs()],
        ["logits", "draft_ids", "draft_confidence", *draft.signal_outputs(), *draft.extra_outputs(),
         *kv_names("present", n)],
        ({0: batch}, {0: batch, 1: ctx_new}, {0: batch, 1: ctx_new + block_size},
         (*({0: batch, 1: ctx_past} for _ in range(2 * n)), *({0: batch} for _ in sampling))),
        opset, weights,
    )
    save_graph(program.model, out / "draft.onnx", written)


def target_graph_spec(path: Path, tapped: TappedTarget) -> GraphSpec:
    """The target graph's manifest entry: its K/V pairs (the layers with K/V of their own: not a hybrid's linear
    layers nor Gemma 4's sharing ones), their shapes where they differ by layer, and a hybrid's linear-attention
    state beside them."""
    state_in, state_out = tapped.state_names()
    kv_in = [name for name in state_in if name.startswith("past_key_values.")]
    kv_out = [name for name in state_out if name.startswith("present.") and name.endswith((".key", ".value"))]
    recurrent = tapped.recurrent_spec() if isinstance(tapped, HybridTarget) else None
    shapes = [] if tapped.uniform_kv else [list(shape) for shape in tapped.kv_shapes.values()]
    windows = [tapped.window(i) or 0 for i in tapped.kv_shapes]
    return graph_spec(path, len(tapped.kv_shapes), tapped.num_kv_heads, tapped.head_dim, kv_in, kv_out,
                      recurrent=recurrent, kv_shapes=shapes, kv_windows=windows if any(windows) else [])


def check_symbolic(graph: GraphSpec, promised: dict[str, list[int]]) -> None:
    """Fail loudly if the exporter fixed an axis that must stay dynamic."""
    shapes = {t.name: t.shape for t in graph.inputs + graph.outputs}
    for name, axes in promised.items():
        for axis in axes:
            if not isinstance(shapes[name][axis], str):
                raise DFlashError(f"{graph.file}: axis {axis} of {name} was exported static ({shapes[name]})")


def _file_hashes(directory: Path) -> dict[str, str]:
    hashes = {}
    for path in sorted(Path(directory).iterdir()):
        if path.suffix in (".json", ".safetensors", ".bin") and path.is_file():
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(chunk)
            hashes[path.name] = digest.hexdigest()
    return hashes


def export_pair(
    target_dir: Path, draft_dir: Path, out: Path, block_size: int | None = None, dtype: str = "float32",
    opset: int = DEFAULT_OPSET, allow_longer_block: bool = False, overwrite: bool = False, progress: bool = True,
    stream: bool = True, revision: str | None = None, draft_revision: str | None = None,
) -> Manifest:
    """Export target and draft into `out` (created atomically); return the manifest written there. `stream`
    (the default) traces the graphs without weights and writes each weight from the checkpoints as the graph
    files are saved (lazy_weights.py): peak memory about one tensor. Without it the pair is loaded whole.
    Each checkpoint is a directory or a Hugging Face hub name (at `revision` / `draft_revision`, default main);
    `target_dir` None takes the target the draft names, `draft_dir` "auto" the published draft of the target
    (artifacts/hub.py)."""
    target_dir, draft_dir = resolve_pair(target_dir, draft_dir, revision, draft_revision, progress)
    out = Path(out)
    check_export_request(target_dir, draft_dir, out, opset, overwrite, block_size)
    info = TargetInfo.from_dir(target_dir)
    spec = DraftSpec.from_dir(draft_dir)
    block = validate_pair(info, spec, block_size, allow_longer_block, dtype)
    torch_dtype = DTYPES[dtype]
    stages = Stages(7 if stream else 6, enabled=progress)
    written = export_bytes([target_dir, draft_dir], torch_dtype.itemsize)
    need_memory = (STREAMED_BASE_MEMORY
                   + STREAMED_TENSOR_COPIES * largest_tensor_bytes([target_dir, draft_dir], torch_dtype.itemsize)
                   if stream else int(LOADED_MEMORY * written))
    with staged_directory(out, (target_dir, draft_dir), overwrite, int(WRITTEN_MARGIN * written), need_memory) as tmp:
        target_weights = draft_weights = None
        if stream:
            step = "checking the wrapper on a small random model of the target's architecture"
            with stages.stage(step), refused_unless_built(info.model_type, step):
                check_against_hf(architecture_check_model(target_dir, dtype), LOGIT_TOLERANCE[dtype])
            step = "building target and draft without their weights"
            with stages.stage(step), refused_unless_built(info.model_type, step):
                tapped, draft = meta_pair(target_dir, draft_dir, spec.target_layer_ids, dtype)
                target_weights, draft_weights = pair_weights(tapped, draft, target_dir, draft_dir, torch_dtype)
        else:
            step = "loading target and draft"
            with stages.stage(step), refused_unless_built(info.model_type, step), torch.no_grad():
                lm = load_target(target_dir, dtype)
                draft = load_draft(draft_dir, lm, dtype)
                tapped = wrap_target(lm, spec.target_layer_ids)
                check_against_hf(tapped, LOGIT_TOLERANCE[dtype])
        with stages.stage("exporting target graph"), refused_unless_built(info.model_type, "exporting the target"):
            export_target(tapped, tmp, opset, torch_dtype, target_weights, stages.fraction)
        with stages.stage(f"exporting draft graph (block size {block})"):
            export_draft(draft, block, tmp, opset, torch_dtype, draft_weights, stages.fraction)
        with stages.stage("sharing embedding and lm_head weights"):
            _, unshared = share_initializers(tmp, "draft.onnx", "target.onnx", info.vocab_size)
            if unshared:
                print(f"warning: draft tensors {unshared} have no identical copy in the target graph; "
                      "they are stored twice", file=sys.stderr)
        with stages.stage("checking graphs"):
            for name in ("target.onnx", "draft.onnx"):
                onnx.checker.check_model(str(tmp / name))
            n_d = len(draft.layers)
            target_graph = target_graph_spec(tmp / "target.onnx", tapped)
            draft_graph = graph_spec(tmp / "draft.onnx", n_d, draft.num_kv_heads, draft.head_dim,
                                     kv_names("past_key_values", n_d), kv_names("present", n_d))
            kv_t = {name: [0, 1] for name in target_graph.kv_inputs + target_graph.kv_outputs}
            check_symbolic(target_graph, {"input_ids": [0, 1], "position_ids": [0, 1], "logits": [0, 1],
                                          "target_hidden": [0, 1], **kv_t})
            kv_d = {name: [0, 1] for name in draft_graph.kv_inputs + draft_graph.kv_outputs}
            check_symbolic(draft_graph, {"input_ids": [0], "target_hidden": [0, 1], "position_ids": [0, 1], **kv_d})
            block_axis = next(t for t in draft_graph.inputs if t.name == "input_ids").shape[1]
            if block_axis != block:
                raise DFlashError(f"draft.onnx block axis is {block_axis}, expected the static {block}")
        with stages.stage("writing manifest and tokenizer"):
            copied = copy_tokenizer_files(target_dir, tmp)
            manifest = Manifest(
                block_size=block, trained_block_size=spec.block_size, target_layer_ids=spec.target_layer_ids,
                mask_token_id=int(spec.mask_token_id), stop_token_ids=info.stop_token_ids,
                vocab_size=info.vocab_size, target_hidden_size=info.hidden_size,
                draft_hidden_size=spec.config.hidden_size, dtype=dtype, opset=opset,
                target=target_graph, draft=draft_graph, model_type=info.model_type,
                tokenizer="tokenizer.json" in copied or "tokenizer.model" in copied or "vocab.json" in copied,
                sources={"target": _file_hashes(target_dir), "draft": _file_hashes(draft_dir)},
                tool_version=__version__,
                source_dirs={"target": str(target_dir.resolve()), "draft": str(draft_dir.resolve())},
                hub={kind: origin for kind, directory in (("target", target_dir), ("draft", draft_dir))
                     if (origin := snapshot_origin(directory))},
                experts=experts_summary(tapped.lm),
                attention_sinks=has_sinks(tapped.lm),
                kv_shared_layers=tapped.num_layers - len(tapped.kv_shapes) - len(getattr(tapped, "linear", ())),
                logit_softcapping=tapped.softcap,
                draft_kind=spec.kind, draft_layout=spec.layout,
                draft_proposals=spec.proposals(block) if spec.sample_from_anchor else None,
            )
            manifest.save(tmp)
    return manifest
