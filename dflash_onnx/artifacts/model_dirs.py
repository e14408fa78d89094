"""Model directories are data, never code: configs are read as JSON, weights only from safetensors.

A target config with `auto_map` asks transformers to import Python files shipped in the directory; pickle
weights (`pytorch_model.bin`, `*.pt`) run code when they are loaded. dflash-onnx refuses both up front, before
any library sees the directory, and checks each safetensors file's header against its size so a truncated
download is named instead of failing deep inside a loader. A draft's `auto_map` (published DFlash, DFlash2 and
DSpark drafts carry one) is ignored: a draft's config is only ever read here, as data, and its directory is
never handed to an auto class. torch-free.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from dflash_onnx.runtime.errors import DFlashError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONVERT = ("convert it once where you trust its origin (load it with transformers and call "
           "save_pretrained(..., safe_serialization=True)), then point dflash-onnx at the result")


def read_config(directory: Path, kind: str) -> dict:
    """config.json of a `kind` ("target" or "draft") directory as a dict; refuses custom code."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DFlashError(f"{kind} directory {directory} does not exist")
    path = directory / "config.json"
    if not path.is_file():
        raise DFlashError(f"{kind} directory {directory} has no config.json")
    try:
        config = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashError(f"{kind} {path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise DFlashError(f"{kind} {path} is not a JSON object")
    for key in ("auto_map", "custom_pipelines") if kind == "target" else ():  # a draft's is read as data
        if key in config or key in config.get("text_config", {}):
            raise DFlashError(f"{kind} {path} has '{key}': the model needs Python code shipped in its directory, "
                              "and dflash-onnx never runs a model directory's code (use a transformers architecture)")
    return config


def _header(path: Path) -> tuple[int, dict] | None:
    """(header length, header) of a safetensors file; None when it has no readable header."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return None
        length = struct.unpack("<Q", head)[0]
        if length > path.stat().st_size:
            return None
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
    return (length, header) if isinstance(header, dict) else None


def _tensors(header: dict) -> list[dict]:
    return [entry for name, entry in header.items() if name != "__metadata__" and isinstance(entry, dict)]


def weight_files(directory: Path, kind: str) -> list[Path]:
    """The directory's *.safetensors files, each whole; pickle-only weights are refused with what to do."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise DFlashError(f"{kind} directory {directory} has only pickle weights ({', '.join(pickles[:3])}), "
                              f"which can run code when loaded, so dflash-onnx reads safetensors only: {CONVERT}")
        raise DFlashError(f"{kind} directory {directory} has no weights (*.safetensors)")
    for file in files:
        found, size = _header(file), file.stat().st_size
        needed = None if found is None else 8 + found[0] + max(
            (t["data_offsets"][1] for t in _tensors(found[1]) if "data_offsets" in t), default=0)
        if needed != size:
            described = "no readable header" if needed is None else f"the header describes {needed}"
            raise DFlashError(f"{kind} weights {file} are damaged or truncated ({size} bytes, {described}): "
                              "download or copy them again")
    return files


def file_tensor_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape of one safetensors file, from its header (nothing else read)."""
    found = _header(file)
    return {name: list(entry.get("shape", [])) for name, entry in (found[1].items() if found else [])
            if name != "__metadata__" and isinstance(entry, dict)}


def tensor_shapes(directory: Path) -> dict[str, list[int]]:
    """Every tensor's shape in the directory's safetensors files (read from the headers, nothing loaded)."""
    return {name: shape for file in sorted(Path(directory).glob("*.safetensors"))
            for name, shape in file_tensor_shapes(file).items()}


def _tensor_elements(directories: list[Path]) -> list[int]:
    return [math.prod(shape) for directory in directories for shape in tensor_shapes(directory).values()]


def export_bytes(directories: list[Path], itemsize: int) -> int:
    """Bytes the weights of these directories take at `itemsize` bytes per element (from the headers)."""
    return sum(_tensor_elements(directories)) * itemsize


def largest_tensor_bytes(directories: list[Path], itemsize: int) -> int:
    """Bytes of the largest tensor of these directories at `itemsize` bytes per element (from the headers)."""
    return max(_tensor_elements(directories), default=0) * itemsize


def checkpoint_stamp(digest, directory: Path):
    """`digest` updated with a checkpoint's identity, cheap for multi-GB weights: its resolved path, and the name,
    size and modification time of its weights and JSON files (a rewritten checkpoint is a new one)."""
    digest.update(str(Path(directory).resolve()).encode())
    for file in sorted(Path(directory).glob("*.safetensors")) + sorted(Path(directory).glob("*.json")):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest
