"""`lower --target coreml` options: the record the lowering writes into the manifest and the session reads."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_onnx.errors import DFlashError

from ..backend import Flag

COMPUTE_UNITS = ("all", "cpu_and_ne", "cpu_and_gpu", "cpu_only")


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


FLAGS = (
    Flag("--ctx-len", "ctx_len", "positions the K/V buffers hold: prompt + new tokens must fit", type=int),
    Flag("--prefill-len", "prefill_len", "prefill chunk, a multiple of the block size", type=int),
    Flag("--compute-units", "compute_units", "where the model may run", choices=COMPUTE_UNITS),
)
