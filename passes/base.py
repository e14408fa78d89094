"""The pass interface: the one signature every pass has, what it is told, and how it is registered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest


@dataclass(frozen=True)
class PassContext:
    pass_name: str  # the registered name of the pass it is given to
    graph: str  # "target" or "draft"
    manifest: Manifest  # the directory the pipeline reads: sizes, K/V names, block size
    options: dict[str, str]  # this pass's options (--pass-option, or set by a lowering)
    calibration_feeds: list[dict[str, np.ndarray]] | None = None  # recorded inputs of this graph (calibrated passes)

    def option(self, key: str, default: str) -> str:
        return str(self.options.get(key, default))

    def int_option(self, key: str, default: int | None = None) -> int:
        """An integer option; a missing one without a default, or one that is not an integer, is refused."""
        value = self.options.get(key, default)
        try:
            return int(value)
        except (TypeError, ValueError):
            wanted = "an integer" if key in self.options else "an integer (required)"
            raise DFlashError(f"--pass-option {self.pass_name}.{key}={value!r}: give {wanted}") from None


PassFunction = Callable[[ir.Model, PassContext], "tuple[ir.Model, dict]"]


@dataclass(frozen=True)
class GraphPass:
    name: str
    run: PassFunction
    bound: float
    lossy: bool
    help: str
    calibrated: bool = False  # the pipeline records calibration feeds first (context.calibration_feeds)
    loads_weights: bool = False  # built on protobuf tools: reads every weight into memory (loaded_proto)
    lowerings: tuple[str, ...] = ()  # applied only by these backends' lowerings
    # the graphs' bytes after the pass over before it, for a model whose bytes are its matmul weights: what the
    # free-space check expects it to write (docs/passes.md#what-the-pipeline-checks-first)
    written_ratio: float = 1.0
    # options recorded in the manifest even when not given, so a later default change cannot make them ambiguous
    recorded_defaults: dict[str, str] = field(default_factory=dict)


def loaded_proto(model: ir.Model) -> onnx.ModelProto:
    """`model` as a protobuf with every weight in memory, for the protobuf tools some passes build on. The
    weights are read once, straight into the protobuf (the IR model keeps its memory-mapped ones)."""
    proto = ir.to_proto(model)
    base_dirs = {v.const_value.base_dir for v in model.graph.initializers.values()
                 if isinstance(v.const_value, ir.ExternalTensor)}
    if base_dirs:
        onnx.external_data_helper.load_external_data_for_model(proto, str(base_dirs.pop()))
    return proto
