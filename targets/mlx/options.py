"""`lower --target mlx` options: the record the lowering writes into the manifest and the session reads."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.targets.backend import Flag

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class MlxOptions:
    bits: int | None = None  # quantize MatMul weights with mx.quantize (None: float)
    group_size: int = 64
    # the fused buffer form (the ORT lowering's rewrites): K/V in preallocated buffers, MLX's fast kernels
    # (sessions read the form from the manifest: lowerings recorded before it run the concat form)
    kv_buffer: bool = True
    ctx_len: int = 4096  # rows of each K/V buffer: prompt + new tokens must fit

    def validate(self, block_size: int) -> None:
        if self.bits is not None and self.bits not in BITS:
            raise DFlashError(f"--bits {self.bits}: MLX quantizes to {' or '.join(map(str, BITS))} bits")
        if self.group_size not in GROUP_SIZES:
            raise DFlashError(f"--group-size {self.group_size}: MLX supports 32, 64 or 128")
        if self.kv_buffer and self.ctx_len < 2 * block_size:
            raise DFlashError(f"--ctx-len {self.ctx_len} is below two blocks ({2 * block_size})")


def _on(value: str) -> bool:
    return value == "on"


FLAGS = (
    Flag("--bits", "bits", "quantize MatMul weights (mx.quantize)", type=int, choices=BITS),
    Flag("--group-size", "group_size", "quantization group", type=int, choices=GROUP_SIZES),
    Flag("--kv-buffer", "kv_buffer", "the fused graph (RMSNorm, RoPE and attention on MLX's fast kernels) with K/V "
         "in preallocated --ctx-len buffers written in place (default on); off keeps the exported graph op by op",
         choices=("on", "off"), parse=_on),
    Flag("--ctx-len", "ctx_len", "positions the K/V buffers hold: prompt + new tokens must fit", type=int),
)
