"""CoreML (macOS 15+ / iOS 18): stateful mlprogram packages converted from the PyTorch pair (lower.py), run
with the model's own K/V state (session.py)."""

from __future__ import annotations

from pathlib import Path

from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.backend import (
    Backend,
    LowerRequest,
    own_lowerings_only,
    recorded_options,
    validate_before_import,
)
from dflash_onnx.targets.coreml.options import FLAGS, CoremlOptions
from dflash_onnx.targets.coreml.session import open_session


def _lower(source: Path, out: Path, options: CoremlOptions, request: LowerRequest) -> Manifest:
    validate_before_import(source, options)
    from dflash_onnx.targets.coreml.lower import lower_coreml

    return lower_coreml(source, out, options, request)


def _summary(manifest: Manifest, out: Path) -> str:
    options = recorded_options(CoremlOptions, manifest)
    if options.dry_run:
        from dflash_onnx.targets.coreml.sizes import describe

        return f"dry run, nothing converted: {describe(manifest.lowering.report['estimate'])}; in {out}/estimate.json"
    weights = f"int{options.bits} weights (blocks of {options.group_size})" if options.bits else "float16"
    functions = "; ".join(f"{graph}: " + ", ".join(f"{name} ({rows})" for name, rows in spec["rows"].items())
                          + (f", each in {len(spec['parts'])} parts" if "parts" in spec else "")
                          for graph, spec in manifest.lowering.functions.items())
    return (f"lowered to {out} for CoreML (stateful multifunction mlprogram, {weights}, ctx_len {options.ctx_len}; "
            f"{functions}; checked in numpy: {manifest.lowering.max_relative_difference:.2g} of the logit scale); "
            "run it on macOS 15+ with --backend coreml")


BACKEND = Backend(name="coreml", title="CoreML", options_type=CoremlOptions, flags=FLAGS, reexports=True,
                  lower=_lower, summary=_summary, can_open=own_lowerings_only("coreml", "CoreML"),
                  open_session=open_session,
                  session_options=("compute_units",))
