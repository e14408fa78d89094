"""ONNX Runtime: the `lower --target ort` lowering and the Session every ORT run goes through.

The lowering applies the passes that pay off on ORT (default: rope-fusion then ort-fusions), lets ORT
run its graph optimizations once and saves the result (so sessions start from the optimized graph),
stores the draft's embedding / lm_head once again (ORT's save writes one data file per graph), checks
the lowered graphs against the export on sample inputs, and records the provider and session options
in the manifest; `generate`, `bench` and `steps` on the lowered directory open sessions with them.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import Manifest, load_export

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider",
             "dml": "DmlExecutionProvider", "openvino": "OpenVINOExecutionProvider",
             "coreml": "CoreMLExecutionProvider", "qnn": "QNNExecutionProvider"}
LEVELS = ("disabled", "basic", "extended", "all")
DEFAULT_PASSES = ("rope-fusion", "ort-fusions")
# Largest difference allowed between lowered and exported graph outputs, relative to the largest |output|:
# ORT's fusions reorder float arithmetic, nothing more.
LOWERING_TOLERANCE = {"float32": 1e-4, "float16": 1e-2}


@dataclass
class OrtOptions:
    provider: str = "cpu"
    passes: tuple[str, ...] = DEFAULT_PASSES
    optimization_level: str = "extended"  # saved into the model files; "all" adds hardware-specific layouts
    intra_op_threads: int = 0  # 0: ORT's default (one per physical core)
    allow_spinning: bool = True


def _ort_level(name: str):
    import onnxruntime as ort

    levels = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    if name not in levels:
        raise DFlashError(f"optimization level {name!r}: choose one of {', '.join(LEVELS)}")
    return levels[name]


def provider_name(provider: str) -> str:
    """ORT's name for a provider, checked against this onnxruntime build."""
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise DFlashError(f"unknown provider {provider!r}: choose one of {', '.join(PROVIDERS)}")
    name = PROVIDERS[provider]
    if name not in ort.get_available_providers():
        hint = {"cuda": "pip install onnxruntime-gpu", "tensorrt": "pip install onnxruntime-gpu (and TensorRT)",
                "dml": "pip install onnxruntime-directml", "openvino": "pip install onnxruntime-openvino",
                "qnn": "pip install onnxruntime-qnn"}.get(provider, "use an onnxruntime build that has it")
        raise DFlashError(f"this onnxruntime ({ort.__version__}) has no {name} (available: "
                          f"{', '.join(ort.get_available_providers())}): {hint}")
    return name


class OrtSession:
    """Runs one ONNX graph on ONNX Runtime (CPU unless other providers are named)."""

    def __init__(self, path: Path, providers: list[str] | None = None, intra_op_threads: int | None = None,
                 allow_spinning: bool = True, optimization_level: str = "all"):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = _ort_level(optimization_level)
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        if not allow_spinning:  # idle pool threads stop spinning: the other session of the pair gets the cores
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._session = ort.InferenceSession(
                str(path), sess_options=options, providers=providers or ["CPUExecutionProvider"]
            )
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
            raise DFlashError(f"ONNX Runtime cannot load {path}: {str(exc).splitlines()[0]}") from None
        self.path = Path(path)
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]

    @classmethod
    def for_directory(cls, path: Path, manifest: Manifest, **overrides) -> "OrtSession":
        """A session on one graph of an export or ORT lowering, with the lowering's recorded options."""
        lowering = manifest.lowering if manifest.lowering.get("target") == "ort" else {}
        settings = dict(lowering.get("session_options", {}))
        if lowering:
            settings["providers"] = [provider_name(lowering["provider"])]
        settings.update({k: v for k, v in overrides.items() if v is not None})
        return cls(path, **settings)

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        names = output_names or self.output_names
        missing = sorted(set(self.input_names) - feeds.keys())
        if missing:
            raise DFlashError(f"{self.path.name}: missing inputs {missing}")
        try:
            values = self._session.run(names, feeds)
        except Exception as exc:
            raise DFlashError(f"{self.path.name} failed on ONNX Runtime: {str(exc).splitlines()[0]}") from None
        return dict(zip(names, values))


def _save_optimized(source: Path, dest: Path, provider: str, level: str) -> None:
    """Let ORT optimize `source` for `provider` at `level` and write the optimized graph to `dest`."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = _ort_level(level)
    options.optimized_model_filepath = str(dest)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{dest.name}.data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        ort.InferenceSession(str(source), sess_options=options, providers=[provider])
    except Exception as exc:
        raise DFlashError(f"ONNX Runtime cannot optimize {source.name}: {str(exc).splitlines()[0]}") from None


def _sample_calls(manifest: Manifest) -> list[tuple[str, dict]]:
    from dflash_onnx.steps import draft_feeds, target_feeds

    return [("target", target_feeds(manifest, 0, 5)), ("target", target_feeds(manifest, 7, manifest.block_size)),
            ("target", target_feeds(manifest, 12, 1)), ("draft", draft_feeds(manifest, 0)),
            ("draft", draft_feeds(manifest, 9))]


def check_lowering(source: Path, lowered: Path, manifest: Manifest, sessions: dict) -> float:
    """Largest output difference of the lowered graphs against the export, relative to the largest |output|;
    refuses the lowering when it exceeds LOWERING_TOLERANCE."""
    reference = {g: OrtSession(Path(source) / getattr(manifest, g).file) for g in ("target", "draft")}
    worst = 0.0
    for graph, feeds in _sample_calls(manifest):
        want, got = reference[graph].run(feeds), sessions[graph].run(feeds)
        for name, value in want.items():
            if value.dtype.kind != "f":
                continue
            scale = max(float(np.abs(value).max()), 1e-6)
            difference = float(np.abs(got[name].astype(np.float64) - value).max()) / scale
            worst = max(worst, difference)
            if difference > LOWERING_TOLERANCE[manifest.dtype]:
                raise DFlashError(f"the ORT lowering changes {graph} output {name} by {difference:.2g} of its scale "
                                  f"(allowed {LOWERING_TOLERANCE[manifest.dtype]:g}): lower with --passes none, "
                                  "or report the graph")
    return worst


def lower_ort(source: Path, out: Path, options: OrtOptions | None = None, overwrite: bool = False,
              progress: bool = True) -> Manifest:
    """Write ORT_DIR: ORT-optimized target and draft graphs, the draft's vocab tensors shared, the manifest."""
    from dflash_onnx.export import check_out_dir, copy_tokenizer_files, share_initializers, staged_directory
    from passes.pipeline import apply_pipeline

    options = options or OrtOptions()
    manifest = load_export(source, "lower")
    provider = provider_name(options.provider)
    _ort_level(options.optimization_level)
    out = Path(out)
    check_out_dir(out, (Path(source),), overwrite)
    with staged_directory(out) as tmp:
        fused_dir, fused = tmp / "fused", manifest
        if options.passes:
            fused, _ = apply_pipeline(Path(source), list(options.passes), fused_dir, progress=progress)
            shutil.move(str(fused_dir / "passes_report.json"), tmp / "passes_report.json")
        origin = fused_dir if options.passes else Path(source)
        for graph in ("target", "draft"):
            if progress:
                print(f"ONNX Runtime optimizes {graph} ({options.optimization_level}, {provider})", file=sys.stderr)
            _save_optimized(origin / getattr(manifest, graph).file, tmp / getattr(manifest, graph).file, provider,
                            options.optimization_level)
        shutil.rmtree(fused_dir, ignore_errors=True)
        shared, unshared = share_initializers(tmp, manifest.draft.file, manifest.target.file, manifest.vocab_size)
        settings = {"intra_op_threads": options.intra_op_threads, "allow_spinning": options.allow_spinning,
                    "optimization_level": options.optimization_level}
        lowered = replace(fused, lowering={
            "target": "ort", "provider": options.provider, "session_options": settings,
            "options": {**asdict(options), "passes": list(options.passes)}, "shared_with_target": shared})
        sessions = {g: OrtSession.for_directory(tmp / getattr(manifest, g).file, lowered) for g in ("target", "draft")}
        lowered.lowering["max_relative_difference"] = check_lowering(Path(source), tmp, manifest, sessions)
        if unshared:
            print(f"warning: draft tensors {unshared} are stored twice (no identical target tensor after ORT's "
                  "optimizations)", file=sys.stderr)
        copy_tokenizer_files(source, tmp)
        lowered.save(tmp)
    return lowered
