"""`lower --target ai100` options: the record the lowering writes into the manifest.

Placement rule: every program placed on a device takes its core count there (a tensor-sliced target takes
--target-cores on each of its devices), and the programs on one device must fit its --cores-per-device
(16 on Cloud AI 100 Standard/Pro). Both programs stay active for the whole decode, so the defaults split one
card 8 + 8, as QEfficient's DFlash example does; a target too big for one card goes tensor-sliced over
--target-devices. Precision defaults are QEfficient's DFlash recipe: MXFP6 MatMul weights, MXINT8 K/V,
-mos 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.targets.backend import Flag

DEFAULT_OPSET = 18  # AI 100 takes 17 or 18; torch's dynamo exporter emits 18 and newer
KV_DTYPES = ("mxint8", "float16")
HW_VERSIONS = ("auto", "ai100", "ai200")
CORES_PER_DEVICE = 16
CCL_FLOOR = 1024  # compute-context lengths start here and double (QEfficient rounds CCLs to multiples of 1024)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise DFlashError(f"{flag} {text!r}: give comma-separated integers, like 0,1") from None
    if not values:
        raise DFlashError(f"{flag} is empty: give comma-separated integers, like 0,1")
    return values


@dataclass(frozen=True)
class Ai100Options:
    ctx_len: int = 4096
    prefill_len: int = 128
    ccl: str = "auto"  # compute-context lengths, comma-separated, or "auto"
    target_cores: int = 8
    draft_cores: int = 8
    target_devices: str = "0"
    draft_devices: str = "0"
    cores_per_device: int = CORES_PER_DEVICE
    mxfp6_matmul: str = "on"
    kv_dtype: str = "mxint8"
    mos: int = 1  # 0: not passed
    hw_version: str = "auto"
    logits: bool = False  # graphs also emit logits (sampling); greedy-only graphs emit ids
    opset: int = DEFAULT_OPSET
    dry_run: bool = False  # write compile.sh without compiling
    no_stream: bool = False  # load the pair whole instead of reading each weight from its checkpoint when needed

    @property
    def target_device_ids(self) -> list[int]:
        return _ints(self.target_devices, "--target-devices")

    @property
    def draft_device_ids(self) -> list[int]:
        return _ints(self.draft_devices, "--draft-devices")

    def compute_context_lengths(self) -> list[int]:
        """The CCL specializations: the given list, or doubling from 1024 below ctx_len, then ctx_len itself."""
        if self.ccl != "auto":
            return sorted(set(_ints(self.ccl, "--ccl")))
        lengths, length = [], CCL_FLOOR
        while length < self.ctx_len:
            lengths.append(length)
            length *= 2
        return [*lengths, self.ctx_len]

    def validate(self, block_size: int) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise DFlashError(f"--kv-dtype {self.kv_dtype} is not one of {', '.join(KV_DTYPES)}")
        if self.mxfp6_matmul not in ("on", "off"):
            raise DFlashError(f"--mxfp6-matmul {self.mxfp6_matmul}: choose on or off")
        if self.hw_version not in HW_VERSIONS:
            raise DFlashError(f"--hw-version {self.hw_version}: choose one of {', '.join(HW_VERSIONS)}")
        if self.opset != 18:
            raise DFlashError(f"AI 100 graphs use opset 18 here (17 is not reachable from torch's exporter), "
                              f"not {self.opset}")
        if self.prefill_len % block_size or self.prefill_len == block_size:
            raise DFlashError(f"--prefill-len {self.prefill_len} must be a multiple of the block size {block_size} "
                              "and larger than it")
        if self.ctx_len <= self.prefill_len:
            raise DFlashError(f"--ctx-len {self.ctx_len} must exceed --prefill-len {self.prefill_len}")
        if self.mos < 0:
            raise DFlashError(f"--mos {self.mos} must be 0 (not passed) or more")
        lengths = self.compute_context_lengths()
        if lengths[0] < 1 or lengths[-1] != self.ctx_len:
            example = ",".join(map(str, Ai100Options(ctx_len=self.ctx_len).compute_context_lengths()))
            raise DFlashError(f"--ccl {self.ccl}: the compute-context lengths must be positive and end at --ctx-len "
                              f"{self.ctx_len}, e.g. {example}")
        self.validate_placement()

    def validate_placement(self) -> None:
        """Per-graph core counts, and the programs on each device within its cores."""
        if not 1 <= self.cores_per_device <= 64:
            raise DFlashError(f"--cores-per-device {self.cores_per_device} must be in 1..64")
        for flag, cores in (("--target-cores", self.target_cores), ("--draft-cores", self.draft_cores)):
            if not 1 <= cores <= self.cores_per_device:
                raise DFlashError(f"{flag} {cores} must be in 1..{self.cores_per_device}")
        target, draft = self.target_device_ids, self.draft_device_ids
        for flag, ids in (("--target-devices", target), ("--draft-devices", draft)):
            if len(set(ids)) != len(ids) or min(ids) < 0:
                raise DFlashError(f"{flag} {','.join(map(str, ids))}: device ids must be distinct and >= 0")
        if len(draft) > 1:
            raise DFlashError("--draft-devices: the draft runs on one device (it is small; tensor slicing it only adds "
                              "transfers)")
        for device in sorted(set(target) | set(draft)):
            used = self.target_cores * (device in target) + self.draft_cores * (device in draft)
            if used > self.cores_per_device:
                raise DFlashError(
                    f"device {device} would hold {used} cores (target {self.target_cores if device in target else 0}"
                    f" + draft {self.draft_cores if device in draft else 0}) but has {self.cores_per_device}: both "
                    "programs stay active, so lower --target-cores/--draft-cores or put the draft on another device "
                    "(--draft-devices)")


FLAGS = (
    Flag("--ctx-len", "ctx_len", "positions the K/V buffers hold: prompt + new tokens must fit", type=int),
    Flag("--prefill-len", "prefill_len", "prefill chunk, a multiple of the block size", type=int),
    Flag("--ccl", "ccl", "compute-context lengths (attention reads the smallest that covers the context), "
         "comma-separated, or auto: doubling from 1024, then --ctx-len"),
    Flag("--target-cores", "target_cores", "AI 100 cores of the target program, on each of its devices", type=int),
    Flag("--draft-cores", "draft_cores", "AI 100 cores of the draft program", type=int),
    Flag("--target-devices", "target_devices", "device ids of the target; several: tensor-sliced (multi-device "
         "partition config)"),
    Flag("--draft-devices", "draft_devices", "device id of the draft"),
    Flag("--cores-per-device", "cores_per_device", "cores of one card, the budget of the programs placed on it",
         type=int),
    Flag("--mxfp6-matmul", "mxfp6_matmul", "compile MatMul weights to MXFP6", choices=("on", "off")),
    Flag("--kv-dtype", "kv_dtype", "precision of the retained K/V", choices=KV_DTYPES),
    Flag("--mos", "mos", "the compiler's -mos (0: not passed)", type=int),
    Flag("--hw-version", "hw_version", "-aic-hw-version; auto asks qaic-util at compile time", choices=HW_VERSIONS),
    Flag("--logits", "logits", "graphs also return logits, which sampled decoding needs (greedy graphs return "
         "token ids only)", switch=True),
    Flag("--opset", "opset", "ONNX opset (AI 100 accepts 17-18; torch's exporter emits 18)", type=int, choices=(18,)),
    Flag("--dry-run", "dry_run", "write compile.sh instead of compiling", switch=True),
    Flag("--no-stream", "no_stream", "load the pair whole (the default reads each weight from its checkpoint when "
         "the calibration or the graph writer needs it; memory then stays near one tensor's at any model size)",
         switch=True),
)
