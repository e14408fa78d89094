"""Qualcomm Cloud AI 100: retained-state graphs and the compiler's inputs (lower.py, compiler.py), compiled
QPCs run through qaicrt (session.py). The same graphs run on ONNX Runtime without the hardware."""

from __future__ import annotations

from pathlib import Path

from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.ai100.options import FLAGS, Ai100Options
from dflash_onnx.targets.ai100.session import open_session
from dflash_onnx.targets.backend import (
    Backend,
    LowerRequest,
    own_lowerings_only,
    recorded_options,
    validate_before_import,
)


def _lower(source: Path, out: Path, options: Ai100Options, request: LowerRequest) -> Manifest:
    validate_before_import(source, options)
    from dflash_onnx.targets.ai100.lower import lower_ai100

    return lower_ai100(source, out, options, request)


def _summary(manifest: Manifest, out: Path) -> str:
    options, lowering = recorded_options(Ai100Options, manifest), manifest.lowering
    calibration, report = lowering.calibration, lowering.report
    compiled = "compiled: qpc/" if lowering.compiled else \
        f"not compiled: run {out}/compile.sh where the Cloud AI 100 SDK is installed"
    lines = [f"lowered to {out} for AI 100 (ctx_len {options.ctx_len}, prefill {options.prefill_len}, block "
             f"{manifest.block_size}, CCL {','.join(map(str, lowering.compute_context_lengths))}); target "
             f"{options.target_cores} cores on device(s) {options.target_devices}, draft {options.draft_cores} on "
             f"{options.draft_devices}",
             f"float16 plan: fc scale {calibration['fc_scale']:g}, largest activation "
             f"{calibration['largest_activation']:.3g} at {calibration['largest_activation_at']}, RMSNorm nodes kept "
             f"float32: {report['precision_plan']['fp32_nodes']}"]
    emulation = report.get("fp16_emulation", {})
    if "curves" in emulation:
        worst = {graph: max(max(p["k"], p["v"]) for p in curve) for graph, curve in emulation["curves"].items()}
        decode = emulation["decode"]
        lines.append(f"float16 emulation: worst K/V error {', '.join(f'{g} {e:.2g}' for g, e in worst.items())} up "
                     f"to position {emulation['curves']['target'][-1]['position']}; decodes identical to float32 "
                     f"greedy: greedy {decode['greedy_identical']}/{decode['prompts']}, DFlash "
                     f"{decode['dflash_identical']}/{decode['prompts']}")
    return "\n".join([*lines, compiled])


BACKEND = Backend(name="ai100", title="Cloud AI 100", options_type=Ai100Options, flags=FLAGS, reexports=True,
                  lower=_lower, summary=_summary, can_open=own_lowerings_only("ai100", "Cloud AI 100"),
                  open_session=open_session,
                  session_options=("target_devices", "draft_devices"))
