"""dflash.json: the one description of an exported directory that every later stage reads."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.paths import member

FORMAT_VERSION = 2  # 2: `lowering` is the typed Lowering record (format 1 held a free-form dict)
MANIFEST_NAME = "dflash.json"
KV_LAYOUT = "batch,seq,kv_heads,head_dim"
FORMS = ("concat", "buffer", "retained")


@dataclass
class TensorSpec:
    name: str
    dtype: str
    shape: list[int | str]


@dataclass
class RecurrentSpec:
    """A hybrid target's Gated-DeltaNet layers: the state each carries beside the attention layers' K/V
    (dflash_onnx/exporter/models/linear_attention.py; dflash_onnx/runtime/recurrent.py feeds and commits it; names in
    recurrent.py)."""

    layers: list[int]
    conv_rows: int  # the convolution's kernel - 1: the committed input rows a call reads before its own
    conv_channels: int
    heads: int
    key_dim: int
    value_dim: int
    state_dtype: str = "float32"  # the recurrent state's and pending rows' dtype (conv rows: the manifest's)


@dataclass
class GraphSpec:
    """One graph file, its I/O, and which outputs carry each K/V input's next value (paired by index)."""

    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_inputs: list[str]
    kv_outputs: list[str]
    recurrent: RecurrentSpec | None = None  # a hybrid target's linear-attention state; None: attention only
    # [kv_heads, head_dim] of each K/V pair where layers differ (Gemma 4's full-attention layers); empty: every
    # pair has num_kv_heads and head_dim
    kv_shapes: list[list[int]] = field(default_factory=list)
    # each K/V pair's sliding window (a query sees the keys fewer than this many positions back; 0: all before it);
    # empty: every layer attends to all positions (or an export from before windows were recorded)
    kv_windows: list[int] = field(default_factory=list)

    def pair_shapes(self) -> list[tuple[int, int]]:
        """(kv_heads, head_dim) of each K/V pair, in kv_inputs order (a pair: a key input and its value)."""
        if self.kv_shapes:
            return [(int(heads), int(dim)) for heads, dim in self.kv_shapes]
        return [(self.num_kv_heads, self.head_dim)] * self.num_layers

    def kv_shape(self, name: str) -> tuple[int, int]:
        """(kv_heads, head_dim) of the K/V input or output `name`."""
        names = self.kv_inputs if name in self.kv_inputs else self.kv_outputs
        return self.pair_shapes()[names.index(name) // 2]

    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def kv_dtype(self) -> str:
        """The dtype of its K/V inputs: the precision the decoding loop feeds it (the manifest's `dtype`), or the
        precision an ORT lowering's buffers hold (`lower --target ort --kv-dtype int8`: int8)."""
        return next(t.dtype for t in self.inputs if t.name == self.kv_inputs[0])

    @property
    def kv_numpy_dtype(self) -> np.dtype:
        """The numpy type of its K/V (the buffers a session allocates for them)."""
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16) if self.kv_dtype == "bfloat16" else np.dtype(self.kv_dtype)

    def with_kv_dtype(self, dtype: str) -> GraphSpec:
        """The same graph with its K/V inputs and outputs of `dtype` (a lowering that changes their precision)."""
        kv = {*self.kv_inputs, *self.kv_outputs}

        def retyped(specs: list[TensorSpec]) -> list[TensorSpec]:
            return [replace(t, dtype=dtype) if t.name in kv else t for t in specs]

        return replace(self, inputs=retyped(self.inputs), outputs=retyped(self.outputs))


@dataclass
class CostModel:
    """What one DFlash round costs on a backend, measured where the directory runs (or replayed from a file):
    the target's step for T new tokens, T = 1..block_size, and the draft's step, in milliseconds, at
    `context` tokens of K/V. The verify policy reads it (dflash_onnx/runtime/policy.py)."""

    verify_ms: list[float]
    draft_ms: float
    context: int = 0
    source: str = ""  # what measured it: "lower", "calibrate", or the file it came from
    # the same steps measured at deeper contexts, shallow to deep: [{"context", "verify_ms", "draft_ms"}, ...]; a
    # step's attention reads every cached row, so at 2K-8K tokens t(T) is no longer t(T) at `context`
    deeper: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if not self.verify_ms or min(self.verify_ms) <= 0 or self.draft_ms < 0:
            raise ValueError("a cost model needs positive verify_ms for T = 1.. and a draft_ms of 0 or more")
        contexts = [self.context] + [int(curve["context"]) for curve in self.deeper]
        if any(b <= a for a, b in zip(contexts, contexts[1:])) or any(
                len(curve["verify_ms"]) != len(self.verify_ms) or min(curve["verify_ms"]) <= 0
                or curve["draft_ms"] < 0 for curve in self.deeper):
            raise ValueError("a cost model's deeper curves need contexts rising past its own, and as many positive "
                             "verify_ms as it has")

    def at_depth(self, depth: int) -> CostModel:
        """The curve at `depth` tokens of K/V, one curve again: linear in the context between the contexts measured
        (attention's reads grow with it), along the last two beyond the deepest, the shallowest's below it. A curve
        measured at one context is that curve at any depth."""
        if not self.deeper:
            return self
        points = [(self.context, self.verify_ms, self.draft_ms)] + [
            (int(c["context"]), c["verify_ms"], c["draft_ms"]) for c in self.deeper]
        if depth <= points[0][0]:
            return replace(self, deeper=[])
        index = min(len(points) - 1, next((i for i, p in enumerate(points) if p[0] >= depth), len(points) - 1))
        (low, low_verify, low_draft), (high, high_verify, high_draft) = points[index - 1], points[index]
        share = (depth - low) / (high - low)  # beyond the deepest: above 1, the last segment's slope goes on
        verify = [max(b, a + share * (b - a)) if share > 1 else a + share * (b - a)
                  for a, b in zip(low_verify, high_verify)]
        verify = [float(v) for v in np.maximum.accumulate(verify)]  # a longer verify never costs less
        draft = max(high_draft, low_draft + share * (high_draft - low_draft)) if share > 1 \
            else low_draft + share * (high_draft - low_draft)
        return replace(self, verify_ms=verify, draft_ms=float(draft), context=int(depth), deeper=[])

    def padded_to(self, multiple: int) -> CostModel:
        """The curve as calls padded to `multiple` rows pay it: t(T) becomes t(T rounded up), where measured."""
        last = len(self.verify_ms)
        padded = [self.verify_ms[min(-(-t // multiple) * multiple, last) - 1] for t in range(1, last + 1)]
        return replace(self, verify_ms=padded)

    def shared_by(self, requests: int, multiple: int = 1) -> CostModel:
        """Each request's share of a step that `requests` requests take together, each verifying T tokens padded
        to `multiple` rows: t(requests x T') / requests, where the curve past its last measured row count goes on
        along its last half's slope (a batched call's cost follows its rows). Its draft step stays whole: each
        request drafts for itself."""
        last = len(self.verify_ms)
        half = max(1, last // 2)
        slope = (self.verify_ms[-1] - self.verify_ms[half - 1]) / max(1, last - half)

        def at(rows: int) -> float:
            return self.verify_ms[rows - 1] if rows <= last else self.verify_ms[-1] + slope * (rows - last)

        shared = [at(requests * -(-t // multiple) * multiple) / requests for t in range(1, last + 1)]
        return replace(self, verify_ms=shared)


@dataclass
class Lowering:
    """How a directory was lowered for a backend: written by the backend's lowering, read by its sessions,
    by the runners (graph-form facts) and by `bench` / `steps` (what they measure)."""

    backend: str  # "ort", "ai100", "mlx" or "coreml"
    options: dict  # the backend's options record as written (its own dataclass reads it back)
    provider: str | None = None  # ORT: the execution provider the sessions use
    # the draft's K/V outputs: "concat" (past + new rows) or "rows" (the new rows only; runners.RowsDraft
    # appends them to its own buffers)
    draft_kv: str = "concat"
    # retained forms: rows padded up to a specialization write the "scratch" slot ctx_len - 1 (AI 100), or
    # continue the call's positions ("consecutive", CoreML: the last chunk's slots are then reserved)
    padding: str = "scratch"
    # retained forms with a `comp_ctx_lengths` input: the compiled read lengths; each call feeds the smallest that
    # covers its last position (AI 100's compute-context-length specializations)
    compute_context_lengths: list[int] = field(default_factory=list)
    shared_with_target: dict[str, str] = field(default_factory=dict)  # draft tensor -> the target tensor it reads
    rewrites: dict[str, dict[str, dict]] = field(default_factory=dict)  # pass -> graph -> what it did
    calibration: dict | None = None  # float16 range measured on calibration prompts (AI 100, CoreML)
    max_relative_difference: float | None = None  # lowered vs exported outputs, relative to their scale
    # the target's calls padded to a multiple of this many rows give each row the same result in any call
    # (measured by the ORT lowering; runners.py, Row multiple); 1: no padding needed, or none found
    row_multiple: int = 1
    compiled: bool = False  # the backend's compiler ran (AI 100)
    # multifunction packages (CoreML): per graph, the input whose rows pick the function, and each function's
    # rows ({"input": "input_ids", "rows": {"decode": 1, "verify": 16, "prefill": 64}}); the retained runners
    # pad a call to the smallest; empty: one function with the sizes block_size and prefill_len
    functions: dict[str, dict] = field(default_factory=dict)
    report: dict = field(default_factory=dict)  # other findings of the lowering, by the backend's own keys


@dataclass
class Manifest:
    block_size: int
    trained_block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    stop_token_ids: list[int]
    vocab_size: int
    target_hidden_size: int
    draft_hidden_size: int
    dtype: str
    opset: int
    target: GraphSpec
    draft: GraphSpec
    model_type: str
    tokenizer: bool
    sources: dict[str, dict[str, str]]
    tool_version: str
    kv_layout: str = KV_LAYOUT
    # "concat": past in, past+new out (the export). "retained": fixed ctx_len buffers returned whole
    # (AI 100 and CoreML; the target graph also applies the draft's fc + hidden_norm). "buffer": the ORT
    # lowering's target reads and writes [batch, kv_heads, ctx_len, head_dim] buffers in place
    # (GroupQueryAttention, lengths as inputs); its draft returns only its new context rows when
    # lowering.draft_kv is "rows" (else it stays concat).
    form: str = "concat"
    ctx_len: int | None = None
    prefill_len: int | None = None
    passes: list[dict] = field(default_factory=list)
    lowering: Lowering | None = None
    costs: CostModel | None = None  # recorded by `lower` or `calibrate` on the directory's backend
    source_dirs: dict[str, str] = field(default_factory=dict)
    # per checkpoint fetched by hub name (or read from a Hugging Face cache snapshot): {"repo_id", "revision"}, the
    # revision being the commit (dflash_onnx/artifacts/hub.py); a checkpoint from another directory has none
    hub: dict[str, dict[str, str]] = field(default_factory=dict)
    # a mixture-of-experts target: {"layers": MoE layers, "experts": per layer, "per_token": routed to,
    # "intermediate_size": of one expert, "shared_intermediate_size": of a shared expert every token runs, where
    # there is one}; None for a dense one
    experts: dict | None = None
    # the target's attention adds a learned per-head sink logit to each softmax (gpt-oss)
    attention_sinks: bool = False
    # layers reading an earlier layer's K/V instead of their own (Gemma 4's num_kv_shared_layers): the target graph
    # has K/V inputs for the others only
    kv_shared_layers: int = 0
    logit_softcapping: float | None = None  # the target's logits are tanh(x / c) * c (Gemma), inside its graph
    draft_kind: str = "dflash"  # dflash, dflash2 (its selector in the graph) or dspark (its Markov chain)
    draft_layout: str = "zlab"  # the draft checkpoint's config.json layout: zlab or speculators
    # tokens one draft call proposes: None is block_size - 1; block_size where the anchor's slot proposes too
    # (DSpark's sample_from_anchor), so a verify takes up to block_size + 1 tokens
    draft_proposals: int | None = None
    format_version: int = FORMAT_VERSION

    @property
    def verify_rows(self) -> int:
        """The most tokens one verify call takes: the anchor and every proposal of a draft call."""
        return (self.block_size - 1 if self.draft_proposals is None else self.draft_proposals) + 1

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def numpy_dtype(self) -> type:
        """The numpy type of the graphs' float inputs and K/V."""
        import ml_dtypes
        import numpy as np

        return {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}.get(self.dtype, np.float32)

    def checkpoints(self, target_dir: Path | None = None, draft_dir: Path | None = None,
                    flag: str = "--{kind}") -> tuple[Path, Path]:
        """The target and draft checkpoint directories: those given, else those recorded at export."""
        chosen = {"target": target_dir, "draft": draft_dir}
        for kind, given in chosen.items():
            directory = given or self.source_dirs.get(kind)
            if directory is None:
                raise DFlashError(f"this export does not record its {kind} checkpoint: pass {flag.format(kind=kind)}")
            if not (Path(directory) / "config.json").is_file():
                raise DFlashError(f"the {kind} checkpoint {directory} is gone: pass {flag.format(kind=kind)}")
            chosen[kind] = Path(directory)
        return chosen["target"], chosen["draft"]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def save(self, directory: Path) -> None:
        """Write dflash.json whole (a reader never sees half of it, also when a command updates it in place)."""
        partial = Path(directory) / f".{MANIFEST_NAME}.partial"
        partial.write_text(self.to_json())
        os.replace(partial, Path(directory) / MANIFEST_NAME)

    @property
    def backend(self) -> str | None:
        """The backend this directory was lowered for; None for an export."""
        return self.lowering.backend if self.lowering else None

    @property
    def weight_quantization(self) -> str | None:
        """The weight-only quantization pass the graphs went through last ("int4" or "int8"); None if none."""
        quantized = [p["name"] for p in self.passes if p.get("name") in ("int4", "int8")]
        return quantized[-1] if quantized else None

    @property
    def draft_returns_rows(self) -> bool:
        """The ORT lowering's buffer-form draft: its graph returns only the new context rows' K/V (runners.RowsDraft
        keeps them, or its session does), instead of past + new."""
        return self.form == "buffer" and self.lowering is not None and self.lowering.draft_kv == "rows"

    @classmethod
    def from_dict(cls, raw: dict) -> Manifest:
        data = dict(raw)
        version = data.get("format_version")
        if version == 1 and not data.get("lowering"):  # an export: format 1 and 2 describe it alike
            data.update(format_version=FORMAT_VERSION, lowering=None)
        elif version == 1:
            raise DFlashError("this lowered directory was written by an older dflash-onnx (manifest format 1): "
                              "re-run 'dflash-onnx lower' on its export")
        elif version != FORMAT_VERSION:
            raise DFlashError(f"manifest format_version {version} is not {FORMAT_VERSION}: use the dflash-onnx "
                              "that wrote it, or export again with this one")
        for key in ("target", "draft"):
            graph = dict(data[key])
            graph["inputs"] = [TensorSpec(**t) for t in graph["inputs"]]
            graph["outputs"] = [TensorSpec(**t) for t in graph["outputs"]]
            if graph.get("recurrent") is not None:
                graph["recurrent"] = RecurrentSpec(**graph["recurrent"])
            data[key] = GraphSpec(**graph)
        if data.get("lowering") is not None:
            data["lowering"] = Lowering(**data["lowering"])
        if data.get("costs") is not None:
            data["costs"] = CostModel(**data["costs"])
        if data.get("form", "concat") not in FORMS:
            raise KeyError(f"form {data['form']!r}")
        return cls(**data)


def on_off(value: str | None, default: bool) -> bool:
    """A switch among a pass's options as a manifest records them (1/true/yes/on), `default` where it is not given:
    read by the pass (passes/quantize.py) and by the float reference that rounds a pair as the pass did
    (dflash_onnx/exporter/rounded.py)."""
    return default if value is None else str(value).lower() in ("1", "true", "yes", "on")


def load_export(directory: Path, action: str) -> Manifest:
    """The manifest of a directory `dflash-onnx export` (or `optimize`) wrote; lowered directories are refused,
    whatever their form (an MLX lowering keeps concat-form graphs but not their weights)."""
    manifest = load_manifest(directory)
    if manifest.form != "concat" or manifest.lowering is not None:
        raise DFlashError(f"{directory} is already lowered (for {manifest.backend or manifest.form}): {action} the "
                          "directory 'dflash-onnx export' wrote")
    return manifest


def load_manifest(directory: Path) -> Manifest:
    """Read and validate OUT/dflash.json, with messages that say what to do."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DFlashError(f"{directory} is not a directory: pass the --out directory of 'dflash-onnx export'")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise DFlashError(f"{directory} has no {MANIFEST_NAME}: it is not an exported dflash-onnx directory")
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        manifest = Manifest.from_dict(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, AttributeError, ValueError) as exc:
        raise DFlashError(f"{path} is corrupt ({exc}): re-run the command that wrote it") from None
    for graph in (manifest.target, manifest.draft):
        if not member(directory, graph.file, f"{MANIFEST_NAME}'s graph file").exists():  # a file, or a package
            raise DFlashError(f"{directory} lacks {graph.file}, named in {MANIFEST_NAME}: re-run the export")
    return manifest
