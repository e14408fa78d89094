"""The directory's checkpoints as GGUF, at the directory's precision: converted with llama.cpp's own converter (the
draft with `--target-model-dir`), then quantized by llama-quantize to the format that matches ours, cached per
checkpoint, precision and llama.cpp build."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_onnx.artifacts.model_dirs import checkpoint_stamp
from dflash_onnx.llama_cpp.build import LlamaCpp, failure_line
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest

FLOAT_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# llama-quantize's quantized types that `bench --llama-cpp-type` may name instead of the one matching ours
NAMED_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m",
               "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")
MIXED = "mixed"  # a named type's output head and token embedding: llama-quantize's own choice for that type


@dataclass(frozen=True)
class Precision:
    """What llama.cpp's files hold against ours: the weights' type, and the two tensors each side may keep apart."""

    weights: str  # llama-quantize's type (q4_0, q4_1, q8_0) or the converter's float type (f32, f16, bf16)
    output: str  # the output head (lm_head)
    embedding: str  # token_embd
    base: str  # the converter's float type, the directory's dtype: what llama-quantize starts from
    note: str  # said beside the figures: where the formats differ

    @property
    def quantized(self) -> bool:
        return self.weights not in FLOAT_TYPES.values()


@dataclass(frozen=True)
class _Ours:
    """What a directory's weights are, as the GGUF choice and its note read them."""

    float_type: str  # the converter's float type for the directory's dtype
    mlx: tuple[int, object] | None  # an MLX lowering's (bits, group size)
    quantization: str | None  # the last int4/int8 pass
    block: int = 32
    symmetric: bool = True
    head: bool = False  # the lm_head quantized too


def _ours(manifest: Manifest) -> _Ours:
    float_type = FLOAT_TYPES[manifest.dtype if manifest.backend != "coreml" else "float32"]
    bits = (manifest.lowering.options or {}).get("bits") if manifest.backend == "mlx" else None
    if bits:
        return _Ours(float_type, (int(bits), manifest.lowering.options.get("group_size")), None)
    quantized = [p for p in manifest.passes if p.get("name") in ("int4", "int8")]
    if not quantized:
        return _Ours(float_type, None, None)
    options = quantized[-1].get("options", {})
    return _Ours(float_type, None, quantized[-1]["name"], int(options.get("block_size", 32)),
                 str(options.get("symmetric", True)).lower() not in ("false", "0", "no"),
                 str(options.get("lm_head", False)).lower() in ("true", "1", "yes"))


def precision_for(manifest: Manifest, tied: bool = False) -> Precision:
    """int4 in symmetric blocks of 32 -> Q4_0 (asymmetric -> Q4_1), int8 -> Q8_0, float -> the same float; an MLX
    lowering's affine groups of --bits 4 -> Q4_1, 8 -> Q8_0. Ours keeps the token embedding in float (a Gather)
    and the lm_head in float unless int4/int8 ran with lm_head=true; the GGUF keeps the same tensors in float;
    norms stay float on both sides. `tied`: the target ties its head to the embedding, so the GGUF has one tensor
    for both (token_embd), which takes the head's type."""
    ours = _ours(manifest)
    float_type = ours.float_type
    if ours.mlx:
        bits, group = ours.mlx
        weights = {4: "q4_1", 8: "q8_0"}.get(bits)
        if weights is None:
            raise DFlashError(f"llama.cpp has no quantization that matches this MLX lowering's {bits}-bit groups")
        return Precision(weights, float_type, float_type, float_type,
                         f"{weights.upper()} (blocks of 32) against ours MLX {bits}-bit affine groups of {group}; "
                         f"lm_head and token embedding {float_type.upper()} on both; norms float on both")
    if ours.quantization is None:
        return Precision(float_type, float_type, float_type, float_type, f"{float_type.upper()} throughout, as ours")
    block, symmetric = ours.block, ours.symmetric
    if ours.quantization == "int8":
        weights, blocks = "q8_0", 32
    else:
        weights, blocks = ("q4_0" if symmetric else "q4_1"), 32
    output = weights if ours.head else float_type
    embedding = output if tied else float_type
    kept = (f"token embedding {float_type.upper()} on both" if not tied or embedding == float_type else
            f"token embedding {embedding.upper()} in llama.cpp (tied: its one tensor is also the head) against "
            f"{float_type.upper()} in ours")
    note = (f"{weights.upper()} (blocks of {blocks}) against ours {ours.quantization} in blocks of {block}"
            f"{'' if symmetric else ' with zero points'}; lm_head {output.upper()} on both; {kept}; norms float "
            "on both")
    if block != blocks:
        note += f" (llama.cpp has no {weights.upper()} with blocks of {block}: the formats differ in block size)"
    return Precision(weights, output, embedding, float_type, note)


def named_precision(manifest: Manifest, llama_type: str) -> Precision:
    """A type the user names (`bench --llama-cpp-type`, e.g. q4_k_m, llama.cpp's recommended 4-bit mix) instead of the
    one matching ours: llama-quantize then picks each tensor's type itself (output head and embedding included), as
    a user running it would, and the note says the formats differ."""
    kind = llama_type.lower()
    if kind not in NAMED_TYPES:
        raise DFlashError(f"--llama-cpp-type {llama_type}: choose one of {', '.join(NAMED_TYPES)} (llama-quantize's "
                          "types; leave it out to match this directory's precision)")
    ours = _ours(manifest)
    if ours.mlx:
        described = f"MLX {ours.mlx[0]}-bit affine groups of {ours.mlx[1]}"
    elif ours.quantization:
        described = (f"{ours.quantization} in blocks of {ours.block}, lm_head "
                     f"{ours.quantization if ours.head else manifest.dtype}")
    else:
        described = f"{manifest.dtype} throughout"
    return Precision(kind, MIXED, MIXED, ours.float_type, f"{kind.upper()} as llama-quantize mixes it (its own type "
                     f"for each tensor, output head and embedding included) against ours {described}: the formats "
                     "differ")


def ggufs(llama: LlamaCpp, target_dir: Path, draft_dir: Path | None, precision: Precision, cache: Path,
          progress: bool = True) -> tuple[Path, Path | None]:
    """The target and draft GGUF files at `precision` (made once, cached; each written whole or not at all); no
    draft file where `draft_dir` is None."""
    folder = cache / "llama.cpp" / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    version = llama.version()
    made = []
    for kind, checkpoint in (("target", target_dir), ("draft", draft_dir)):
        if checkpoint is None:
            made.append(None)
            continue
        digest = hashlib.sha256(f"{version}:{kind}".encode())
        for directory in (checkpoint, target_dir) if kind == "draft" else (checkpoint,):
            checkpoint_stamp(digest, directory)
        key = digest.hexdigest()[:12]
        plain = folder / f"{kind}-{key}-{precision.base}.gguf"
        if not plain.is_file():
            _say(progress, f"llama.cpp: converting the {kind} {checkpoint} to GGUF ({precision.base}) ...")
            _convert(llama, checkpoint, plain, precision.base, target_dir if kind == "draft" else None)
        if not precision.quantized:
            made.append(plain)
            continue
        quantized = folder / f"{kind}-{key}-{precision.weights}-out-{precision.output}-embd-{precision.embedding}.gguf"
        if not quantized.is_file():
            _say(progress, f"llama.cpp: quantizing the {kind} to {precision.weights.upper()} ...")
            _quantize(llama, plain, quantized, precision)
        made.append(quantized)
    return made[0], made[1]


def _convert(llama: LlamaCpp, checkpoint: Path, out: Path, outtype: str, target_dir: Path | None) -> None:
    partial = out.with_suffix(".partial")
    command = [sys.executable, "-m", "dflash_onnx.llama_cpp.converter", str(llama.source), str(checkpoint),
               "--outfile", str(partial), "--outtype", outtype]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    _run(command, f"llama.cpp's converter cannot convert {checkpoint}", partial)
    os.replace(partial, out)


def _quantize(llama: LlamaCpp, source: Path, out: Path, precision: Precision) -> None:
    partial = out.with_suffix(".partial")
    command = [str(llama.tool("llama-quantize"))]
    if precision.output != MIXED:  # every tensor at the type matching ours, head and embedding as ours keeps them
        command += ["--pure", "--output-tensor-type", precision.output, "--token-embedding-type", precision.embedding]
    command += [str(source), str(partial), precision.weights]
    _run(command, f"llama-quantize cannot make {precision.weights.upper()} from {source.name}", partial)
    os.replace(partial, out)


def _run(command: list[str], failure: str, partial: Path) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise DFlashError(f"{failure}: {failure_line(done.stderr + done.stdout)}")


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
