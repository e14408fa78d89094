"""`lower --target ort` options: the record the lowering writes into the manifest and the sessions read."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.targets.backend import Flag
from dflash_onnx.targets.ort.spinning import CHOICES

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider",
             "dml": "DmlExecutionProvider", "openvino": "OpenVINOExecutionProvider",
             "coreml": "CoreMLExecutionProvider", "qnn": "QNNExecutionProvider"}
LEVELS = ("disabled", "basic", "extended", "all")
DEFAULT_PASSES = ("rope-fusion", "ort-fusions")
ATTENTIONS = ("gqa", "ragged")  # the kv-buffer pass's attention option (passes/kv_buffer.py)
# the target's K/V buffers: auto (the export's dtype), the export's dtype named, or int8 (ONNX Runtime's quantized
# GroupQueryAttention cache, per-channel scales calibrated at lowering: passes/kv_buffer.py, docs/ort.md#int8-kv)
KV_DTYPES = ("auto", "float32", "float16", "int8")


@dataclass(frozen=True)
class OrtOptions:
    provider: str = "cpu"
    passes: tuple[str, ...] = DEFAULT_PASSES
    optimization_level: str = "extended"  # saved into the model files; "all" adds hardware-specific layouts
    intra_op_threads: int = 0  # 0: ORT's default (one per physical core)
    draft_threads: int = 0  # the draft session's intra-op threads (0: as intra_op_threads)
    allow_spinning: bool = True  # lowerings before `spinning` existed; `spinning` decides for newer ones
    spinning: str = "auto"  # on | calls | off (targets/ort/spinning.py); auto: measured at lowering
    kv_buffer: bool = True  # the target's attention as GroupQueryAttention over preallocated K/V (passes/kv_buffer.py)
    ctx_len: int = 4096  # rows of each K/V buffer: prompt + new tokens must fit
    # the buffer form's attention: gqa (com.microsoft GroupQueryAttention, one request a call) or ragged
    # (TensorScatter + ONNX Attention, opset 24: requests batched in one call, passes/kv_ragged.py)
    kv_attention: str = "gqa"
    kv_dtype: str = "auto"  # KV_DTYPES; auto (and older lowerings): the export's dtype

    def spinning_mode(self) -> str:
        """The sessions' spinning mode (an older lowering's allow_spinning where none was chosen)."""
        return self.spinning if self.spinning != "auto" else "on" if self.allow_spinning else "off"

    def validate(self, block_size: int) -> None:
        if self.provider not in PROVIDERS:
            raise DFlashError(f"--provider {self.provider}: choose one of {', '.join(PROVIDERS)}")
        if self.spinning not in CHOICES:
            raise DFlashError(f"--spinning {self.spinning}: choose one of {', '.join(CHOICES)}")
        if self.optimization_level not in LEVELS:
            raise DFlashError(f"--optimization-level {self.optimization_level}: choose one of {', '.join(LEVELS)}")
        if min(self.intra_op_threads, self.draft_threads) < 0:
            raise DFlashError("--threads and --draft-threads take 0 (ONNX Runtime's default) or a positive count")
        if self.kv_buffer and "ort-fusions" not in self.passes:
            raise DFlashError("the buffer form rewrites the attention the ort-fusions pass fuses: keep ort-fusions "
                              "in --passes, or lower with --kv-buffer off")
        if self.kv_attention not in ATTENTIONS:
            raise DFlashError(f"--kv-attention {self.kv_attention}: choose one of {', '.join(ATTENTIONS)}")
        if self.kv_attention != "gqa" and not self.kv_buffer:
            raise DFlashError(f"--kv-attention {self.kv_attention} is the buffer form's attention: drop "
                              "--kv-buffer off")
        if self.kv_dtype not in KV_DTYPES:
            raise DFlashError(f"--kv-dtype {self.kv_dtype}: choose one of {', '.join(KV_DTYPES)}")
        if self.kv_dtype == "int8" and not self.kv_buffer:
            raise DFlashError("--kv-dtype int8 quantizes the buffer form's K/V buffers: drop --kv-buffer off")
        if self.kv_dtype == "int8" and self.kv_attention != "gqa":
            raise DFlashError(f"--kv-dtype int8: ONNX Attention (--kv-attention {self.kv_attention}) takes no "
                              "quantized cache: use --kv-attention gqa")
        if self.kv_dtype == "int8" and self.provider != "cpu":
            raise DFlashError(f"--kv-dtype int8 is measured on ONNX Runtime's CPU GroupQueryAttention only, not "
                              f"--provider {self.provider}: lower with --provider cpu, or drop --kv-dtype int8")
        if self.kv_buffer and self.ctx_len < 2 * block_size:
            raise DFlashError(f"--ctx-len {self.ctx_len} is below two blocks ({2 * block_size})")


def _pass_list(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip() and p.strip() != "none")


def _on(value: str) -> bool:
    return value == "on"


FLAGS = (
    Flag("--provider", "provider", f"execution provider ({', '.join(PROVIDERS)}); must exist in the installed "
         "onnxruntime"),
    Flag("--passes", "passes", "passes applied first, comma-separated, or 'none'", parse=_pass_list),
    Flag("--optimization-level", "optimization_level", "graph optimizations ORT saves into the model files",
         choices=LEVELS),
    Flag("--threads", "intra_op_threads", "intra-op threads (0: ORT's default)", type=int),
    Flag("--draft-threads", "draft_threads", "the draft session's intra-op threads (0: as --threads); 1 suits "
         "drafts of a few MB, whose calls are too short to split", type=int),
    Flag("--spinning", "spinning", "how idle intra-op threads wait: on (spin between calls), calls (spin within a "
         "call only), off, or auto (each timed quiet and beside one busy process at lowering; the best of both "
         "kept)", choices=CHOICES),
    Flag("--kv-buffer", "kv_buffer", "target attention as GroupQueryAttention over preallocated --ctx-len K/V "
         "buffers updated in place; off keeps the concat form", choices=("on", "off"), parse=_on),
    Flag("--kv-attention", "kv_attention", "the buffer form's attention: gqa (GroupQueryAttention, fastest for one "
         "request at a time) or ragged (TensorScatter + ONNX Attention: `serve --max-batch` runs several requests "
         "in one call)", choices=ATTENTIONS),
    Flag("--kv-dtype", "kv_dtype", "the buffer form's K/V: auto (the export's dtype), float32 or float16 (the "
         "export's, named), or int8 (ONNX Runtime CPU's quantized GroupQueryAttention cache, per-channel scales "
         "calibrated at lowering: one-row steps faster at depth, verify calls slower; docs/ort.md#int8-kv)",
         choices=KV_DTYPES),
    Flag("--ctx-len", "ctx_len", "positions the K/V buffers hold: prompt + new tokens must fit", type=int),
)
