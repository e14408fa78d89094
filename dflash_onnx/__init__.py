"""dflash-onnx: DFlash speculative decoding, exported once to ONNX, run on any backend.

The one import name the project installs. The public API is importable from here:

    from dflash_onnx import open_decoder, SamplingParams

    decoder = open_decoder("q4b-ort")
    result = decoder.generate([11, 22, 33], max_new_tokens=64)

Beneath it, one folder per layer (docs/architecture.md): runtime (numpy: the decoding loop), artifacts, exporter
and training (torch), passes, targets (the backends' registry), serving, and the commands beside cli.py. The names
below load on first use, so that `import dflash_onnx.runtime` stays numpy-only and a command starts fast."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dflash_onnx.runtime import __version__

if TYPE_CHECKING:  # what an IDE and a type checker follow; at run time __getattr__ loads them
    from dflash_onnx.runtime.decode import Decoder, Learnt
    from dflash_onnx.runtime.errors import DFlashError
    from dflash_onnx.runtime.manifest import CostModel, Manifest, load_manifest
    from dflash_onnx.runtime.results import GenerationResult
    from dflash_onnx.runtime.sampling import SamplingParams
    from dflash_onnx.runtime.session import Session
    from dflash_onnx.targets import open_decoder, open_session

# public name -> the module that defines it
_PUBLIC = {
    "open_decoder": "dflash_onnx.targets",
    "open_session": "dflash_onnx.targets",
    "Decoder": "dflash_onnx.runtime.decode",
    "Learnt": "dflash_onnx.runtime.decode",
    "GenerationResult": "dflash_onnx.runtime.results",
    "SamplingParams": "dflash_onnx.runtime.sampling",
    "DFlashError": "dflash_onnx.runtime.errors",
    "Session": "dflash_onnx.runtime.session",
    "Manifest": "dflash_onnx.runtime.manifest",
    "CostModel": "dflash_onnx.runtime.manifest",
    "load_manifest": "dflash_onnx.runtime.manifest",
}

__all__ = ["CostModel", "DFlashError", "Decoder", "GenerationResult", "Learnt", "Manifest", "SamplingParams", "Session",
           "__version__", "load_manifest", "open_decoder", "open_session"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dflash_onnx' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
