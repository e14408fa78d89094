"""CoreML lowering and session: stateful mlprogram packages converted here, run on macOS.

coremltools has no ONNX frontend since 6.0, so `lower_coreml` converts the PyTorch modules behind the
export (the checkpoints recorded in OUT's manifest, the same weights) with `torch.jit.trace` +
`ct.convert`: mlprogram, float16 compute, K/V as `ct.StateType` (macOS 15 / iOS 18). The modules are
the conversion-friendly forms in dflash_onnx/models/stateful.py (the same math as the HF model; tested
against it). Sequence lengths are `ct.EnumeratedShapes`: the verify step specialized to block_size and
one prefill chunk size; the retained runners pad a call up to one of them with consecutive positions.
Prediction needs macOS 15+: elsewhere `CoremlSession` says so.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import GraphSpec, Manifest, TensorSpec, load_export

COMPUTE_UNITS = ("all", "cpu_and_ne", "cpu_and_gpu", "cpu_only")
TESTED_WITH = ("coremltools 9.0 with torch 2.13.0 (TorchScript frontend; coremltools warns it was tested up to "
               "torch 2.7)")


@dataclass(frozen=True)
class CoremlOptions:
    ctx_len: int = 4096
    prefill_len: int = 64
    compute_units: str = "all"

    def validate(self, block_size: int) -> None:
        if self.compute_units not in COMPUTE_UNITS:
            raise DFlashError(f"--compute-units {self.compute_units}: choose from {', '.join(COMPUTE_UNITS)}")
        if self.prefill_len < block_size or self.prefill_len % block_size:
            raise DFlashError(f"--prefill-len {self.prefill_len} must be a multiple of the block size {block_size}")
        if self.ctx_len < 2 * self.prefill_len:
            raise DFlashError(f"--ctx-len {self.ctx_len} must hold at least two prefill chunks "
                              f"({2 * self.prefill_len})")


def _import_coremltools():
    try:
        import coremltools as ct
    except ImportError as exc:
        raise DFlashError(f"lowering for CoreML needs coremltools: pip install 'coremltools>=9,<10' ({exc})") from None
    return ct


def _convert(module, example: tuple, inputs: list, outputs: list[str], path: Path) -> None:
    import torch

    ct = _import_coremltools()
    with torch.no_grad():
        traced = torch.jit.trace(module, example, check_trace=False)
    states = [ct.StateType(wrapped_type=ct.TensorType(shape=tuple(getattr(module, n).shape), dtype=np.float16),
                           name=n) for n in module.state_names]
    try:
        model = ct.convert(traced, inputs=inputs, outputs=[ct.TensorType(name=n) for n in outputs], states=states,
                           minimum_deployment_target=ct.target.macOS15, convert_to="mlprogram",
                           compute_precision=ct.precision.FLOAT16)
    except Exception as exc:  # coremltools raises many types; keep its message
        raise DFlashError(f"coremltools could not convert {type(module).__name__}: {exc} ({TESTED_WITH})") from exc
    model.save(str(path))


def _spec(file: str, inputs: dict[str, tuple[str, list]], outputs: dict[str, tuple[str, list]], layers: int,
          kv_heads: int, head_dim: int) -> GraphSpec:
    return GraphSpec(file=file, inputs=[TensorSpec(n, d, s) for n, (d, s) in inputs.items()],
                     outputs=[TensorSpec(n, d, s) for n, (d, s) in outputs.items()], num_layers=layers,
                     num_kv_heads=kv_heads, head_dim=head_dim, kv_inputs=[], kv_outputs=[])


def lower_coreml(source: Path, out: Path, options: CoremlOptions, target_dir: Path | None = None,
                 draft_dir: Path | None = None, progress: bool = True) -> Manifest:
    """Write COREML_DIR: target.mlpackage, draft.mlpackage (stateful, fp16) and the manifest."""
    import torch

    from dflash_onnx.export import check_out_dir, copy_tokenizer_files, staged_directory
    from dflash_onnx.models.stateful import StatefulDraft, StatefulTarget
    from dflash_onnx.models.target import TappedTarget
    from dflash_onnx.pair import load_draft, load_target
    from dflash_onnx.progress import Stages

    from .ai100 import calibrate_fc_scale

    ct = _import_coremltools()
    manifest = load_export(source, "lower")
    options.validate(manifest.block_size)
    target_dir, draft_dir = manifest.checkpoints(target_dir, draft_dir, flag="--{kind}-dir")
    out = Path(out)
    check_out_dir(out, (target_dir, draft_dir, Path(source)), overwrite=False)
    stages = Stages(4, enabled=progress)
    block, chunk = manifest.block_size, options.prefill_len
    sizes = ct.EnumeratedShapes(shapes=[(1, block), (1, chunk)], default=(1, block))
    with staged_directory(out) as tmp:
        with stages.stage("loading target and draft"), torch.no_grad():
            lm = load_target(target_dir, "float32")
            draft = load_draft(draft_dir, lm, "float32")
            tapped = TappedTarget(lm, manifest.target_layer_ids).eval()
        with stages.stage("calibrating float16 range"):
            calibration = calibrate_fc_scale(tapped, draft, manifest.vocab_size, manifest.mask_token_id, block)
            if calibration["fp16_overflow"]:
                print(f"warning: activation {calibration['largest_activation']:.3g} at "
                      f"{calibration['largest_activation_at']} overflows float16", file=sys.stderr)
        with stages.stage("converting the target (stateful mlprogram)"):
            target = StatefulTarget(tapped, draft, options.ctx_len, calibration["fc_scale"], torch.float32).eval()
            ids = torch.zeros(1, block, dtype=torch.int32)
            positions = torch.arange(block, dtype=torch.int32)[None]
            _convert(target, (ids, positions), [ct.TensorType("input_ids", shape=sizes, dtype=np.int32),
                                                 ct.TensorType("position_ids", shape=sizes, dtype=np.int32)],
                     ["greedy_ids", "logits", "context_hidden"], tmp / "target.mlpackage")
        with stages.stage("converting the draft (stateful mlprogram)"):
            stateful_draft = StatefulDraft(draft, options.ctx_len, block, torch.float32).eval()
            hidden = torch.zeros(1, block, draft.spec.config.hidden_size)
            block_shape = (1, block)
            _convert(stateful_draft, (ids, hidden, positions, positions + block),
                     [ct.TensorType("input_ids", shape=block_shape, dtype=np.int32),
                      ct.TensorType("context_hidden", shape=ct.EnumeratedShapes(
                          shapes=[(1, block, hidden.shape[-1]), (1, chunk, hidden.shape[-1])],
                          default=(1, block, hidden.shape[-1])), dtype=np.float16),
                      ct.TensorType("ctx_position_ids", shape=sizes, dtype=np.int32),
                      ct.TensorType("position_ids", shape=block_shape, dtype=np.int32)],
                     ["draft_ids", "logits"], tmp / "draft.mlpackage")
        hidden_size, vocab = draft.spec.config.hidden_size, manifest.vocab_size
        graphs = {
            "target": _spec("target.mlpackage", {"input_ids": ("int32", [1, "seq_len"]),
                                                 "position_ids": ("int32", [1, "seq_len"])},
                            {"greedy_ids": ("int32", [1, "seq_len"]), "logits": ("float16", [1, "seq_len", vocab]),
                             "context_hidden": ("float16", [1, "seq_len", hidden_size])},
                            tapped.num_layers, tapped.num_kv_heads, tapped.head_dim),
            "draft": _spec("draft.mlpackage", {"input_ids": ("int32", [1, block]),
                                               "context_hidden": ("float16", [1, "seq_len", hidden_size]),
                                               "ctx_position_ids": ("int32", [1, "seq_len"]),
                                               "position_ids": ("int32", [1, block])},
                           {"draft_ids": ("int32", [1, block - 1]), "logits": ("float16", [1, block - 1, vocab])},
                           len(draft.layers), draft.num_kv_heads, draft.head_dim),
        }
        copy_tokenizer_files(source, tmp)
        lowered = replace(manifest, target=graphs["target"], draft=graphs["draft"], form="retained",
                          ctx_len=options.ctx_len, prefill_len=chunk, dtype="float16",
                          kv_layout="state: batch,kv_heads,ctx_len,head_dim",
                          lowering={"target": "coreml", "options": options.__dict__, "calibration": calibration,
                                    "padding": "consecutive", "states": {"target": target.state_names,
                                                                         "draft": stateful_draft.state_names},
                                    "converter": TESTED_WITH})
        lowered.save(tmp)
    return lowered


def macos_version() -> tuple[int, ...] | None:
    if platform.system() != "Darwin":
        return None
    return tuple(int(p) for p in platform.mac_ver()[0].split(".") if p.isdigit())


class CoremlSession:
    """A stateful CoreML package: K/V live in the model's state object, kept for the session's life."""

    retains_state = True

    def __init__(self, package: Path, compute_units: str = "all"):
        version = macos_version()
        if version is None or version < (15,):
            raise DFlashError(f"CoreML prediction needs macOS 15 or newer (this is {platform.system()} "
                              f"{platform.release()}): copy {Path(package).parent} to a Mac and run "
                              "'dflash-onnx generate COREML_DIR --backend coreml' there")
        ct = _import_coremltools()
        units = {"all": ct.ComputeUnit.ALL, "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE,
                 "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU, "cpu_only": ct.ComputeUnit.CPU_ONLY}
        self.model = ct.models.MLModel(str(package), compute_units=units[compute_units])
        self.state = self.model.make_state()
        spec = self.model.get_spec().description
        self.input_names = [i.name for i in spec.input]
        self.output_names = [o.name for o in spec.output]

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        inputs = {name: value.astype(np.int32) if value.dtype.kind == "i" else value.astype(np.float16)
                  for name, value in feeds.items()}
        out = self.model.predict(inputs, state=self.state)
        names = output_names or self.output_names
        return {n: np.asarray(out[n]).astype(np.int64) if n.endswith("_ids") else np.asarray(out[n]) for n in names}
