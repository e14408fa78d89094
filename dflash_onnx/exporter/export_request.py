"""The export's checks that need neither torch nor transformers (whose imports take seconds): the CLI runs them
before it imports the exporter, so that a wrong path, an unsafe or damaged checkpoint or a bad flag fails at
once; `export_pair` runs them too, for API callers."""

from __future__ import annotations

from pathlib import Path

from dflash_onnx.artifacts.model_dirs import read_config, weight_files
from dflash_onnx.artifacts.publish import check_out_dir
from dflash_onnx.runtime.errors import DFlashError

DEFAULT_OPSET = 18
OPSETS = range(18, 24)  # torch's exporter emits 18 and newer


def refuse_small_block(size: int) -> None:
    if size < 2:
        raise DFlashError(f"block size {size} is too small: DFlash needs at least 2 (use --mode greedy for 1)")


def check_export_request(target_dir: Path, draft_dir: Path, out: Path, opset: int, overwrite: bool,
                         block_size: int | None = None) -> None:
    """Refuse the --out, the opset, a block size below 2, or a checkpoint directory that is missing, ships code,
    holds only pickle weights, or has damaged safetensors; the architecture checks need transformers and come
    later."""
    check_out_dir(Path(out), (Path(target_dir), Path(draft_dir)), overwrite)
    if opset not in OPSETS:
        raise DFlashError(f"opset {opset} is not supported: choose {OPSETS.start}..{OPSETS.stop - 1} "
                          "(torch's exporter emits 18 and newer)")
    if block_size is not None:
        refuse_small_block(int(block_size))
    for directory, kind in ((target_dir, "target"), (draft_dir, "draft")):
        read_config(Path(directory), kind)
        weight_files(Path(directory), kind)
