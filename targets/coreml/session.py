"""The CoreML Session: a stateful mlprogram package whose K/V live in the model's state object, kept for the
session's life. Prediction needs macOS 15+; elsewhere it says so. numpy and coremltools only."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.feeds import SAMPLED_INPUTS
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.runtime.paths import member
from dflash_onnx.targets.backend import recorded_options
from dflash_onnx.targets.coreml.options import CoremlOptions


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


def target_parts(num_layers: int, layers_per_part: int) -> list[tuple[int, int]]:
    """The target's layer ranges, one per part (0 layers per part: the whole target)."""
    if layers_per_part <= 0 or layers_per_part >= num_layers:
        return [(0, num_layers)]
    return [(start, min(start + layers_per_part, num_layers)) for start in range(0, num_layers, layers_per_part)]


def part_functions(functions: dict) -> dict[int, list[str]]:
    """Call rows -> the functions that compute a call of that size, one per part of the graph, in turn."""
    count = len(functions.get("parts", [None]))
    return {rows: [name] if count == 1 else [f"{name}_{k}" for k in range(count)]
            for name, rows in functions["rows"].items()}


def part_packages(directory: Path, functions: dict | None, file: str) -> list[Path]:
    """The package of each part of a graph: its own in a lowering in parts (`functions["packages"]`), else the
    graph's file; names checked to stay inside `directory`."""
    functions = functions or {}
    names = functions.get("packages") or [file] * len(functions.get("parts", [None]))
    return [member(directory, name, "the manifest's CoreML package") for name in names]


def typed_feeds(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds as the packages declare their inputs: int32 ids and positions, float16 activations, a DSpark chain's
    uniforms and temperature float32 (a draw's precision)."""
    return {name: value.astype(np.int32) if value.dtype.kind == "i" else
            value.astype(np.float32 if name in SAMPLED_INPUTS else np.float16) for name, value in feeds.items()}


def run_parts(parts: list, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`feeds` through a graph's parts in turn (callables on a dict of inputs): each part after the first reads the
    previous one's hidden and tap_sum, and the call's positions."""
    out = parts[0](feeds)
    for part in parts[1:]:
        out = part({"hidden_in": out["hidden"], "position_ids": feeds["position_ids"], "tap_sum_in": out["tap_sum"]})
    return out


class CoremlSession:
    """A stateful CoreML package: K/V live in a state object kept for the session's life. A graph with several
    functions (one per call size) loads each and shares one state object between them; each call runs the
    function whose rows its `functions["input"]` has. A graph in parts has such functions per part, one state
    object per part, and runs its parts in turn."""

    retains_state = True

    def __init__(self, packages: list[Path], compute_units: str = "all", functions: dict | None = None):
        version = macos_version()
        if version is None or version < (15,):
            raise DFlashError(f"CoreML prediction needs macOS 15 or newer (this is {platform.system()} "
                              f"{platform.release()}): copy {Path(packages[0]).parent} to a Mac and run "
                              "'dflash-onnx generate COREML_DIR --backend coreml' there")
        ct = import_coremltools()
        units = {"all": ct.ComputeUnit.ALL, "cpu_and_ne": ct.ComputeUnit.CPU_AND_NE,
                 "cpu_and_gpu": ct.ComputeUnit.CPU_AND_GPU, "cpu_only": ct.ComputeUnit.CPU_ONLY}
        names = part_functions(functions) if functions else {None: [None]}
        self.by = functions["input"] if functions else None
        self.models = {rows: [ct.models.MLModel(str(package), compute_units=units[compute_units], function_name=name)
                              for package, name in zip(packages, parts)] for rows, parts in names.items()}
        first = next(iter(self.models.values()))
        self.states = [model.make_state() for model in first]
        spec = first[0].get_spec().description
        described = {f.name: f for f in spec.functions}
        parts = next(iter(names.values()))
        first_part, last_part = (described[parts[0]], described[parts[-1]]) if described and functions else (spec, spec)
        self.input_names = [i.name for i in first_part.input]
        self.output_names = [o.name for o in last_part.output]

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        models = self.models[feeds[self.by].shape[1] if self.by else None]
        parts = [lambda part_feeds, model=model, state=state: model.predict(typed_feeds(part_feeds), state=state)
                 for model, state in zip(models, self.states)]
        out = run_parts(parts, feeds)
        names = output_names or self.output_names
        return {n: np.asarray(out[n]).astype(np.int64) if n.endswith("_ids") else np.asarray(out[n]) for n in names}


def open_session(directory: Path, manifest: Manifest, graph: str, compute_units: str | None = None) -> CoremlSession:
    """The package of `graph` (its functions, in a multifunction lowering), on the compute units recorded at
    lowering unless others are given."""
    units = compute_units or recorded_options(CoremlOptions, manifest).compute_units
    functions = manifest.lowering.functions.get(graph)
    return CoremlSession(part_packages(Path(directory), functions, getattr(manifest, graph).file), units, functions)
