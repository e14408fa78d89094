"""The CoreML Session: a stateful mlprogram package whose K/V live in the model's state object, kept for the
session's life. Prediction needs macOS 15+; elsewhere it says so. numpy and coremltools only."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import Manifest

from ..backend import recorded_options
from .options import CoremlOptions


def import_coremltools():
    try:
        import coremltools as ct
    except ImportError as exc:
        raise DFlashError(f"the coreml backend needs coremltools: pip install 'coremltools>=9,<10' ({exc})") from None
    return ct


def macos_version() -> tuple[int, ...] | None:
    if platform.system() != "Darwin":
        return None
    return tuple(int(p) for p in platform.mac_ver()[0].split(".") if p.isdigit())


class CoremlSession:
    """A stateful CoreML package: K/V live in a state object kept for the session's life. A graph with several
    functions (one per call size) loads each and shares one state object between them; each call runs the
    function whose rows its `functions["input"]` has."""

    retains_state = True

    def __init__(self, package: Path, compute_units: str = "all", functions: dict | None = None):
        version = macos_version()
        if version is None or version < (15,):
            raise DFlashError(f"CoreML prediction needs macOS 15 or newer (this is {platform.system()} "
                              f"{platform.release()}): copy {Path(package).parent} to a Mac and run "
                              "'dflash-onnx generate COREML_DIR --backend coreml' there")
        ct = import_coremltools()
        units = {"all": ct.ComputeUnit.ALL, "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE,
                 "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU, "cpu_only": ct.ComputeUnit.CPU_ONLY}
        names = functions["rows"] if functions else {None: None}
        self.by = functions["input"] if functions else None
        self.models = {rows: ct.models.MLModel(str(package), compute_units=units[compute_units], function_name=name)
                       for name, rows in names.items()}
        first = next(iter(self.models.values()))
        self.state = first.make_state()
        spec = first.get_spec().description
        described = {f.name: f for f in spec.functions}
        description = described[next(iter(names))] if described and functions else spec
        self.input_names = [i.name for i in description.input]
        self.output_names = [o.name for o in description.output]

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        inputs = {name: value.astype(np.int32) if value.dtype.kind == "i" else value.astype(np.float16)
                  for name, value in feeds.items()}
        model = self.models[feeds[self.by].shape[1] if self.by else None]
        out = model.predict(inputs, state=self.state)
        names = output_names or self.output_names
        return {n: np.asarray(out[n]).astype(np.int64) if n.endswith("_ids") else np.asarray(out[n]) for n in names}


def open_session(directory: Path, manifest: Manifest, graph: str, compute_units: str | None = None) -> CoremlSession:
    """The package of `graph` (its functions, in a multifunction lowering), on the compute units recorded at
    lowering unless others are given."""
    units = compute_units or recorded_options(CoremlOptions, manifest).compute_units
    return CoremlSession(Path(directory) / getattr(manifest, graph).file, units,
                         manifest.lowering.functions.get(graph))
