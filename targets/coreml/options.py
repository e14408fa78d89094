"""`lower --target coreml` options: the record the lowering writes into the manifest and the session reads."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.targets.backend import Flag

COMPUTE_UNITS = ("all", "cpu_and_ne", "cpu_and_gpu", "cpu_only")
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # as --target mlx takes them (one --group-size flag)


@dataclass(frozen=True)
class CoremlOptions:
    ctx_len: int = 4096
    prefill_len: int = 64
    compute_units: str = "all"
    bits: int | None = None  # block-wise weight quantization after conversion (coremltools.optimize), None: float16
    group_size: int = 32  # the quantization block (input channels per scale)
    dry_run: bool = False  # estimate the package and state sizes from the checkpoints; convert nothing
    layers_per_part: int = 0  # target layers per function part (0: the whole target in each function)

    def validate(self, block_size: int) -> None:
        if self.compute_units not in COMPUTE_UNITS:
            raise DFlashError(f"--compute-units {self.compute_units}: choose from {', '.join(COMPUTE_UNITS)}")
        if self.prefill_len < block_size or self.prefill_len % block_size:
            raise DFlashError(f"--prefill-len {self.prefill_len} must be a multiple of the block size {block_size}")
        if self.bits is not None and self.bits not in BITS:
            raise DFlashError(f"--bits {self.bits}: CoreML quantizes weights to {' or '.join(map(str, BITS))} bits")
        if self.group_size not in GROUP_SIZES:
            raise DFlashError(f"--group-size {self.group_size}: choose {', '.join(map(str, GROUP_SIZES))}")
        if self.layers_per_part < 0:
            raise DFlashError(f"--layers-per-part {self.layers_per_part} must be 0 (the whole target) or more")
        if self.ctx_len < 2 * self.prefill_len:
            raise DFlashError(f"--ctx-len {self.ctx_len} must hold at least two prefill chunks "
                              f"({2 * self.prefill_len})")


FLAGS = (
    Flag("--ctx-len", "ctx_len", "positions the K/V buffers hold: prompt + new tokens must fit", type=int),
    Flag("--prefill-len", "prefill_len", "prefill chunk, a multiple of the block size", type=int),
    Flag("--compute-units", "compute_units", "where the model may run: all (CoreML chooses among CPU, GPU and the "
         "Neural Engine), cpu_and_ne (no GPU), cpu_and_gpu (no Neural Engine), cpu_only; recorded, and "
         "overridable when a session opens", choices=COMPUTE_UNITS),
    Flag("--bits", "bits", "block-wise int4 or int8 weights (coremltools.optimize, iOS 18 / macOS 15 "
         "constexpr_blockwise_shift_scale); default float16", type=int, choices=BITS),
    Flag("--group-size", "group_size", "input channels per quantization scale (with --bits)", type=int,
         choices=GROUP_SIZES),
    Flag("--layers-per-part", "layers_per_part", "split the target into parts of this many layers, each converted "
         "alone (memory stays near one part's weights, the pair is read from the checkpoints as needed) and run in "
         "turn with its own K/V state; smaller programs also suit the Neural Engine. 0: one part", type=int),
    Flag("--dry-run", "dry_run", "estimate the package and K/V state sizes from the checkpoints' headers and write "
         "only the manifest (nothing converted: for sizes beyond this machine)", switch=True),
)
