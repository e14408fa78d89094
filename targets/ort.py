"""ONNX Runtime: the `lower --target ort` lowering and the Session every ORT run goes through.

The lowering applies the passes that pay off on ORT (default: rope-fusion then ort-fusions), rewrites
the target's attention to the buffer form and the draft's attention, RoPE and K/V outputs
(targets/ort_*.py), lets ORT run its graph optimizations once and saves the result (so sessions start
from the optimized graph), stores the draft's embedding / lm_head once again (ORT's save writes one
data file per graph), checks the lowered graphs against the export on sample inputs, and records the
provider and session options in the manifest; `generate`, `bench` and `steps` on the lowered directory open sessions with them.
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
    draft_threads: int = 0  # the draft session's intra-op threads (0: as intra_op_threads)
    allow_spinning: bool = True
    kv_buffer: bool = True  # the target's attention as GroupQueryAttention over preallocated K/V (targets/ort_kv_buffer.py)
    ctx_len: int = 4096  # rows of each K/V buffer: prompt + new tokens must fit


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
                 allow_spinning: bool = True, optimization_level: str = "all", stop_spinning_after_run: bool = False):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 4  # failures reach the user as one DFlashError line, not ORT's log
        options.graph_optimization_level = _ort_level(optimization_level)
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        if not allow_spinning:  # idle pool threads stop spinning: the other session of the pair gets the cores
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if stop_spinning_after_run:  # spin within a call, not after it: the next call is the other session's
            options.add_session_config_entry("session.force_spinning_stop", "1")
        try:
            self._session = ort.InferenceSession(
                str(path), sess_options=options, providers=providers or ["CPUExecutionProvider"]
            )
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
            raise DFlashError(f"ONNX Runtime cannot load {path}: {str(exc).splitlines()[0]}") from None
        self.path = Path(path)
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]

    @staticmethod
    def for_directory(directory: Path, manifest: Manifest, graph: str, **overrides) -> "OrtSession":
        """A session on one graph of an export or ORT lowering, with the lowering's recorded options."""
        lowering = manifest.lowering if manifest.lowering.get("target") == "ort" else {}
        settings = dict(lowering.get("session_options", {}))
        draft_threads = settings.pop("draft_threads", 0)
        if graph == "draft" and draft_threads:
            settings["intra_op_threads"] = draft_threads
        if lowering:
            settings["providers"] = [provider_name(lowering["provider"])]
        settings.update({k: v for k, v in overrides.items() if v is not None})
        path = Path(directory) / getattr(manifest, graph).file
        if manifest.form == "buffer" and graph == "target":
            return OrtBufferSession(path, manifest, **settings)
        # the draft's calls alternate with the target's: its threads spinning on after each call take the
        # cores the target's verify needs (measured on the demo pair: DFlash 948 -> 1262 tok/s side by side)
        return OrtSession(path, stop_spinning_after_run=graph == "draft", **settings)

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


class OrtBufferSession(OrtSession):
    """The buffer-form target: K/V live in preallocated arrays bound (IOBinding) as both the input and
    the output of every GroupQueryAttention, so ORT updates them in place and no call copies the cache.
    The other outputs are bound to arrays kept per row count, so a run of same-sized calls (decode steps,
    verify steps) binds nothing but its small inputs."""

    retains_state = True

    def __init__(self, path: Path, manifest: Manifest, **settings):
        import onnxruntime as ort

        super().__init__(path, **settings)
        self._ort = ort
        graph = manifest.target
        shape = (1, graph.num_kv_heads, int(manifest.ctx_len), graph.head_dim)
        self.buffers = {name: np.zeros(shape, manifest.numpy_dtype) for name in graph.kv_inputs}
        self._values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in self.buffers.items()}
        self._pairs = list(zip(graph.kv_inputs, graph.kv_outputs))
        self._specs = {t.name: t for t in graph.outputs if t.name not in set(graph.kv_outputs)}
        self._binding = self._session.io_binding()
        for past, _ in self._pairs:
            self._binding.bind_ortvalue_input(past, self._values[past])
        self._outputs: dict[tuple[str, int], tuple[np.ndarray, object]] = {}
        self._bound: tuple | None = None
        self._inputs: dict[str, tuple[np.ndarray, object]] = {}  # per input: the array bound last, refilled

    def _output(self, name: str, rows: int) -> tuple[np.ndarray, object]:
        """The array (and its OrtValue) that output `name` of a `rows`-token call is written into."""
        if (name, rows) not in self._outputs:
            spec = self._specs[name]
            shape = [1 if dim == "batch" else rows if isinstance(dim, str) else dim for dim in spec.shape]
            array = np.empty(shape, np.dtype(spec.dtype))
            self._outputs[(name, rows)] = (array, self._ort.OrtValue.ortvalue_from_numpy(array))
        return self._outputs[(name, rows)]

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        names = tuple(n for n in (output_names or self.output_names) if n in self._specs)
        rows = int(feeds["input_ids"].shape[1])
        binding = self._binding
        for name, value in feeds.items():  # same shape as last call (every decode or verify step): copy, no bind
            kept = self._inputs.get(name)
            if kept is None or kept[0].shape != value.shape or kept[0].dtype != value.dtype:
                array = np.empty(value.shape, value.dtype)
                kept = self._inputs[name] = (array, self._ort.OrtValue.ortvalue_from_numpy(array))
                binding.bind_ortvalue_input(name, kept[1])
            np.copyto(kept[0], value)
        if self._bound != (names, rows):  # only outputs asked for are bound: ORT keeps the rest internal
            binding.clear_binding_outputs()
            for name in names:
                binding.bind_ortvalue_output(name, self._output(name, rows)[1])
            for past, present in self._pairs:
                binding.bind_ortvalue_output(present, self._values[past])
            self._bound = (names, rows)
        try:
            self._session.run_with_iobinding(binding)
        except Exception as exc:
            raise DFlashError(f"{self.path.name} failed on ONNX Runtime: {str(exc).splitlines()[0]}") from None
        return {name: self._output(name, rows)[0].copy() for name in names}


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


def _sample_calls(manifest: Manifest, target: bool) -> list[tuple[str, dict]]:
    from dflash_onnx.steps import draft_feeds, target_feeds

    calls = [("draft", draft_feeds(manifest, 0)), ("draft", draft_feeds(manifest, 9))]
    if target:
        calls += [("target", target_feeds(manifest, 0, 5)), ("target", target_feeds(manifest, 7, manifest.block_size)),
                  ("target", target_feeds(manifest, 12, 1))]
    return calls


def _target_sequence(manifest: Manifest, session) -> dict[str, np.ndarray]:
    """A prefill, a verify, a partial commit, another verify and a decode through the manifest's runner (the
    buffer form's rollback included): (name, output) per call, the same ids for every graph form."""
    from dflash_onnx.runners import open_runners

    runner, _ = open_runners(manifest, session, None, 256)
    rng = np.random.default_rng(0)
    outputs, length = {}, 0
    for step, (count, keep) in enumerate(((20, 20), (manifest.block_size, 2), (3, 3), (1, 1))):
        out = runner.forward(rng.integers(0, manifest.vocab_size, size=count), True)
        outputs.update({f"target logits (step {step})": out.logits, f"target_hidden (step {step})": out.context})
        length += keep
        runner.commit(length)
    return outputs


def _draft_sequence(manifest: Manifest, sessions: dict) -> dict[str, np.ndarray]:
    """Draft logits over four proposals through the manifest's draft runner, its context cache growing by
    20, a block, 3 and 1 rows (the same features and ids for every form)."""
    from dflash_onnx.runners import open_runners

    _, runner = open_runners(manifest, sessions["target"], sessions["draft"], 256)
    rng = np.random.default_rng(1)
    outputs = {}
    for step, rows in enumerate((20, manifest.block_size, 3, 1)):
        features = rng.standard_normal((rows, manifest.num_taps * manifest.target_hidden_size))
        context = features.astype(manifest.numpy_dtype)
        block = rng.integers(0, manifest.vocab_size, size=manifest.block_size)
        outputs[f"draft logits (proposal {step})"] = runner.propose(block, context, True)[1]
    return outputs


def _check_outputs(manifest: Manifest, sessions: dict, calls: list[tuple[str, dict]],
                   sequence: bool) -> dict[str, np.ndarray]:
    """The float outputs of the sample calls (of the draft's K/V, the call's new rows: all a rows-form draft
    returns), then of the target and draft call sequences when `sequence`, by name."""
    outputs = {}
    for index, (graph, feeds) in enumerate(calls):
        for name, value in sessions[graph].run(feeds).items():
            if value.dtype.kind == "f":
                if graph == "draft" and name in manifest.draft.kv_outputs:
                    value = value[:, value.shape[1] - feeds["target_hidden"].shape[1]:]
                outputs[f"{graph} output {name} (call {index})"] = value
    if sequence:
        outputs.update({**_target_sequence(manifest, sessions["target"]), **_draft_sequence(manifest, sessions)})
    return outputs


def check_lowering(source: Path, exported: Manifest, directory: Path, manifest: Manifest) -> float:
    """Largest output difference of the lowered graphs in `directory` (`manifest`) against the export at
    `source` (`exported`), relative to the largest |output|; refuses the lowering beyond LOWERING_TOLERANCE
    (x100 for a quantized export). The export's outputs are computed and its sessions closed before the
    lowered sessions open, so the check holds one model's sessions at a time."""
    calls, sequence = _sample_calls(exported, target=manifest.form == "concat"), manifest.form == "buffer"
    reference = {g: OrtSession(Path(source) / getattr(exported, g).file) for g in ("target", "draft")}
    wanted = _check_outputs(exported, reference, calls, sequence)
    del reference
    lowered = {g: OrtSession.for_directory(directory, manifest, g) for g in ("target", "draft")}
    got = _check_outputs(manifest, lowered, calls, sequence)
    del lowered
    # a quantized export (MatMulNBits with int8 activations) re-rounds its activations, so float reordering
    # in the fused graph moves its outputs more than it moves a float graph's
    allowed = LOWERING_TOLERANCE[manifest.dtype] * (100 if any(p.get("lossy") for p in exported.passes) else 1)
    worst = 0.0
    for name, want in wanted.items():
        value = got[name]
        scale = max(float(np.abs(want).max()), 1e-6)
        difference = float(np.abs(value.astype(np.float64) - want).max()) / scale
        worst = max(worst, difference)
        if difference > allowed:
            buffered = manifest.form == "buffer" and name.startswith("target")
            hint = "--kv-buffer off (a sliding-window target needs its mask)" if buffered else "--passes none"
            raise DFlashError(f"the ORT lowering changes {name} by {difference:.2g} of its scale (allowed "
                              f"{allowed:g}): lower with {hint}, or report the graph")
    return worst


def _rewrite_to_buffer_form(fused_dir: Path, manifest: Manifest, ctx_len: int) -> None:
    """Rewrite fused_dir's target graph in place to the buffer form; only the graph structure is loaded
    (its weights stay in the data file beside it), so this costs no model-sized memory."""
    import onnx

    from .ort_kv_buffer import to_kv_buffer

    if ctx_len < 2 * manifest.block_size:
        raise DFlashError(f"--ctx-len {ctx_len} is below two blocks ({2 * manifest.block_size})")
    path = fused_dir / manifest.target.file
    model = onnx.load(str(path), load_external_data=False)
    onnx.save_model(to_kv_buffer(model, manifest.target, ctx_len, str(fused_dir)), str(path))


def _rewrite_draft(fused_dir: Path, manifest: Manifest, rewrite) -> int:
    """Apply `rewrite` (model -> (model, count)) to fused_dir's draft graph in place, weights left in their
    data file; returns how many places it rewrote."""
    import onnx

    path = fused_dir / manifest.draft.file
    model, count = rewrite(onnx.load(str(path), load_external_data=False))
    if count:
        onnx.save_model(model, str(path))
    return count


def _rewrite_draft_attention(fused_dir: Path, manifest: Manifest) -> int:
    """The draft's attention as one ONNX Attention per layer (targets/ort_draft_attention.py)."""
    from .ort_draft_attention import to_onnx_attention

    return _rewrite_draft(fused_dir, manifest, to_onnx_attention)


def _rewrite_draft_rows(fused_dir: Path, manifest: Manifest) -> bool:
    """The draft's K/V outputs as the new rows only (targets/ort_draft_rows.py); False leaves it as it was."""
    from .ort_draft_rows import to_new_rows

    return _rewrite_draft(fused_dir, manifest, lambda model: to_new_rows(model, manifest.draft)) > 0


def _rewrite_draft_rope(fused_dir: Path, manifest: Manifest, rows: int) -> int:
    """The draft's rotations over a `rows`-row cos/sin cache (targets/ort_rope_cache.py)."""
    from .ort_rope_cache import to_rope_cache

    return _rewrite_draft(fused_dir, manifest, lambda model: to_rope_cache(model, rows))


def lower_ort(source: Path, out: Path, options: OrtOptions | None = None, overwrite: bool = False,
              progress: bool = True) -> Manifest:
    """Write ORT_DIR: ORT-optimized target and draft graphs, the draft's vocab tensors shared, the manifest."""
    from dflash_onnx.export import check_out_dir, copy_tokenizer_files, share_initializers, staged_directory
    from passes.pipeline import apply_pipeline

    options = options or OrtOptions()
    if min(options.intra_op_threads, options.draft_threads) < 0:
        raise DFlashError("--threads and --draft-threads take 0 (ONNX Runtime's default) or a positive count")
    if options.kv_buffer and "ort-fusions" not in options.passes:
        raise DFlashError("the buffer form rewrites the attention the ort-fusions pass fuses: keep ort-fusions in "
                          "--passes, or lower with --kv-buffer off")
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
        draft_attentions = _rewrite_draft_attention(fused_dir, manifest) if "ort-fusions" in options.passes else 0
        draft_kv = "concat"
        # a cos/sin cache needs a bound on positions: the buffer form's capacity (a draft block runs past it)
        draft_rotations = _rewrite_draft_rope(fused_dir, manifest, options.ctx_len + manifest.block_size) \
            if options.kv_buffer and "rope-fusion" in options.passes else 0
        if options.kv_buffer:
            from .ort_kv_buffer import buffer_spec

            if progress:
                print(f"target attention -> GroupQueryAttention over {options.ctx_len}-row K/V buffers",
                      file=sys.stderr)
            _rewrite_to_buffer_form(fused_dir, manifest, options.ctx_len)
            fused = replace(fused, form="buffer", ctx_len=options.ctx_len, kv_layout="batch,kv_heads,seq,head_dim",
                            target=buffer_spec(fused.target, options.ctx_len))
            if _rewrite_draft_rows(fused_dir, manifest):  # the runner then keeps the draft's cache in a buffer
                from .ort_draft_rows import rows_spec

                draft_kv, fused = "rows", replace(fused, draft=rows_spec(fused.draft))
        for graph in ("target", "draft"):
            if progress:
                print(f"ONNX Runtime optimizes {graph} ({options.optimization_level}, {provider})", file=sys.stderr)
            _save_optimized(origin / getattr(manifest, graph).file, tmp / getattr(manifest, graph).file, provider,
                            options.optimization_level)
        shutil.rmtree(fused_dir, ignore_errors=True)
        shared, unshared = share_initializers(tmp, manifest.draft.file, manifest.target.file, manifest.vocab_size)
        settings = {"intra_op_threads": options.intra_op_threads, "draft_threads": options.draft_threads,
                    "allow_spinning": options.allow_spinning,
                    "optimization_level": options.optimization_level}
        lowered = replace(fused, lowering={
            "target": "ort", "provider": options.provider, "session_options": settings,
            "options": {**asdict(options), "passes": list(options.passes)}, "shared_with_target": shared,
            "draft_onnx_attention": draft_attentions, "draft_rope_cache": draft_rotations, "draft_kv": draft_kv})
        lowered.lowering["max_relative_difference"] = check_lowering(Path(source), manifest, tmp, lowered)
        if unshared:
            print(f"warning: draft tensors {unshared} are stored twice (no identical target tensor after ORT's "
                  "optimizations)", file=sys.stderr)
        copy_tokenizer_files(source, tmp)
        lowered.save(tmp)
    return lowered
