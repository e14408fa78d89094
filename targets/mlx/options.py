"""`lower --target mlx` options: the record the lowering writes into the manifest and the session reads."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_onnx.errors import DFlashError

from ..backend import Flag

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class MlxOptions:
    bits: int | None = None  # quantize MatMul weights with mx.quantize (None: float)
    group_size: int = 64

    def validate(self, block_size: int) -> None:
        if self.bits is not None and self.bits not in BITS:
            raise DFlashError(f"--bits {self.bits}: MLX quantizes to {' or '.join(map(str, BITS))} bits")
        if self.group_size not in GROUP_SIZES:
            raise DFlashError(f"--group-size {self.group_size}: MLX supports 32, 64 or 128")


FLAGS = (
    Flag("--bits", "bits", "quantize MatMul weights (mx.quantize)", type=int, choices=BITS),
    Flag("--group-size", "group_size", "quantization group", type=int, choices=GROUP_SIZES),
)
