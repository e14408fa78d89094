"""`lower --target ai100` options: the record the lowering writes into the manifest."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_onnx.errors import DFlashError

from ..backend import Flag

DEFAULT_OPSET = 18  # AI 100 takes 17 or 18; torch's dynamo exporter emits 18 and newer
KV_DTYPES = ("float16", "mxint8")


@dataclass(frozen=True)
class Ai100Options:
    ctx_len: int = 4096
    prefill_len: int = 128
    num_cores: int = 16
    mxfp6_matmul: bool = False
    kv_dtype: str = "float16"
    opset: int = DEFAULT_OPSET
    dry_run: bool = False  # write compile.sh without compiling

    def validate(self, block_size: int) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise DFlashError(f"--kv-dtype {self.kv_dtype} is not one of {', '.join(KV_DTYPES)}")
        if self.opset != 18:
            raise DFlashError(f"AI 100 graphs use opset 18 here (17 is not reachable from torch's exporter), "
                              f"not {self.opset}")
        if self.prefill_len % block_size or self.prefill_len == block_size:
            raise DFlashError(f"--prefill-len {self.prefill_len} must be a multiple of the block size {block_size} "
                              "and larger than it")
        if self.ctx_len <= self.prefill_len:
            raise DFlashError(f"--ctx-len {self.ctx_len} must exceed --prefill-len {self.prefill_len}")
        if not 1 <= self.num_cores <= 16:
            raise DFlashError(f"--num-cores {self.num_cores} must be in 1..16")


FLAGS = (
    Flag("--ctx-len", "ctx_len", "positions the K/V buffers hold: prompt + new tokens must fit", type=int),
    Flag("--prefill-len", "prefill_len", "prefill chunk, a multiple of the block size", type=int),
    Flag("--num-cores", "num_cores", "AI 100 cores to compile for (1..16)", type=int),
    Flag("--mxfp6-matmul", "mxfp6_matmul", "compile MatMul weights to MXFP6", switch=True),
    Flag("--kv-dtype", "kv_dtype", "precision of the retained K/V", choices=KV_DTYPES),
    Flag("--opset", "opset", "ONNX opset (AI 100 accepts 17-18; torch's exporter emits 18)", type=int, choices=(18,)),
    Flag("--dry-run", "dry_run", "write compile.sh instead of compiling", switch=True),
)
