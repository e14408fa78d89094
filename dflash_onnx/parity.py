"""The ONNX Runtime reference run: exported graphs against the PyTorch modules they came from.

Per prompt it compares target logits and tapped features (prefill and verify shapes) and draft
logits (first and later calls), then checks that DFlash on ORT, greedy PyTorch (HF generate) and,
when installed, the reference `dflash_generate` produce the same tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash_onnx.exporter.models.draft import DFlashDraft
from dflash_onnx.exporter.models.hybrid import wrap_target
from dflash_onnx.exporter.models.target import TappedTarget, hf_greedy
from dflash_onnx.exporter.pair import LOGIT_TOLERANCE, load_draft, load_reference_draft, load_target
from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.differences import finite_scale, max_difference
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.feeds import sampling_feeds
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets import open_decoder

# why a hybrid target's parity skips the reference (docs/hybrid-models.md#the-reference-package-is-no-oracle-here;
# tests/test_hybrid.py shows its output leaving HF greedy's on a tiny Qwen3.5 pair)
HYBRID_REFERENCE = ("it rolls a verify back with transformers' DynamicCache.crop, which crops a linear-attention "
                    "layer's conv rows but not its recurrent state, so rejected tokens stay in that state and its "
                    "output leaves greedy; HF greedy generate is the oracle here")


@dataclass
class Check:
    prompt: int
    name: str
    value: float | str
    ok: bool


@dataclass
class ParityReport:
    checks: list[Check] = field(default_factory=list)
    tolerance: float = 0.0
    reference_available: bool = False
    reference_skipped: str = ""  # why the reference package is no oracle for this target, when it is not

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "tolerance": self.tolerance, "reference_available": self.reference_available,
                "reference_skipped": self.reference_skipped,
                "checks": [asdict(c) for c in self.checks]}

    def table(self) -> str:
        lines = [f"{'prompt':>6}  {'check':<34} {'value':>12}  result"]
        for c in self.checks:
            value = f"{c.value:.3e}" if isinstance(c.value, float) else str(c.value)
            lines.append(f"{c.prompt:>6}  {c.name:<34} {value:>12}  {'ok' if c.ok else 'MISMATCH'}")
        if self.reference_skipped:
            lines.append(f"reference package not compared: {self.reference_skipped}")
        lines.append(f"tolerance {self.tolerance:g}; {'all ok' if self.ok else 'MISMATCHES FOUND'}")
        return "\n".join(lines)


def _max_diff(a: np.ndarray, b: torch.Tensor) -> float:
    return max_difference(b.detach().double().numpy(), a)


def _scale(b: torch.Tensor) -> float:
    return finite_scale(b.detach().double().numpy())


def _kv_feeds(names: list[str], tensors) -> dict[str, np.ndarray]:
    return {name: t.detach().numpy() for name, t in zip(names, tensors)}


def _reference_tokens(model, lm, prompt: np.ndarray, max_new_tokens: int, stops: list[int],
                      block_size: int) -> list[int]:
    from dflash.model import dflash_generate

    ids = torch.tensor(prompt)[None]
    out = dflash_generate(model, lm, ids, max_new_tokens, stops or None, block_size=block_size)
    return out[0, len(prompt):].tolist()


def _compare_graphs(prompt_index: int, prompt: np.ndarray, manifest: Manifest, decoder: Decoder,
                    tapped: TappedTarget, draft: DFlashDraft, tol: float, relative: float) -> list[Check]:
    """Graph outputs vs PyTorch; allowed: tol + relative * (largest |reference value|) per check."""
    checks, scales = [], []
    t_in, t_out = tapped.state_names()  # K/V, and a hybrid target's linear-attention state
    n = len(prompt)
    ids = torch.tensor(prompt)[None]
    positions = torch.arange(n)[None]
    with torch.no_grad():
        ref = tapped(ids, positions, *tapped.empty_cache(dtype=tapped.lm.dtype))
    feeds = {"input_ids": ids.numpy(), "position_ids": positions.numpy(),
             **_kv_feeds(t_in, tapped.empty_cache(dtype=tapped.lm.dtype))}
    got = decoder.target.run(feeds)
    checks.append(Check(prompt_index, "target logits (prefill)", _max_diff(got["logits"], ref[0]), False))
    checks.append(Check(prompt_index, "target hidden (prefill)", _max_diff(got["target_hidden"], ref[2]), False))
    scales += [_scale(ref[0]), _scale(ref[2])]

    block = torch.full((1, manifest.block_size), manifest.mask_token_id)
    block[0, 0] = int(ref[1][0, -1])
    verify_pos = torch.arange(n, n + manifest.block_size)[None]
    past = tapped.next_state(ref[3:], n, n)
    with torch.no_grad():
        ref_v = tapped(block, verify_pos, *past)
    got_v = decoder.target.run({"input_ids": block.numpy(), "position_ids": verify_pos.numpy(),
                                **_kv_feeds(t_in, past)})
    checks.append(Check(prompt_index, "target logits (verify)", _max_diff(got_v["logits"], ref_v[0]), False))
    checks.append(Check(prompt_index, "target hidden (verify)", _max_diff(got_v["target_hidden"], ref_v[2]), False))
    checks.append(Check(prompt_index, "present K/V and state (verify)" if manifest.target.recurrent else
                        "present K/V (verify)",
                        max(_max_diff(got_v[o], r) for o, r in zip(t_out, ref_v[3:])), False))
    scales += [_scale(ref_v[0]), _scale(ref_v[2]), max(_scale(r) for r in ref_v[3:])]

    d_in = manifest.draft.kv_inputs
    context = ref[2]
    past = draft.empty_cache(dtype=context.dtype)
    start = 0
    signals, extra = draft.signal_outputs(), len(draft.extra_outputs())
    # a DSpark draft's chain drawn in the graph: the later call draws it from fixed uniforms at a temperature
    # (the draws follow the logits: equal up to a uniform falling on a rounding-sized boundary)
    uniform = np.random.default_rng(prompt_index).random(draft.spec.proposals(manifest.block_size)).astype(np.float32)
    for call in ("first", "later"):
        positions = torch.arange(start, start + context.shape[1] + manifest.block_size)[None]
        temperature = 0.7 if call == "later" and draft.extra_inputs() else 0.0
        sampling = (torch.from_numpy(uniform)[None], torch.tensor([temperature])) if draft.extra_inputs() else ()
        with torch.no_grad():
            ref_d = draft(block, context, positions, *past, *sampling)
        got_d = decoder.draft.run({"input_ids": block.numpy(), "target_hidden": context.numpy(),
                                   "position_ids": positions.numpy(), **_kv_feeds(d_in, past),
                                   **sampling_feeds(manifest.draft, uniform, temperature)})
        drawn = " (its chain drawn)" if temperature else ""
        checks.append(Check(prompt_index, f"draft logits ({call} call){drawn}", _max_diff(got_d["logits"], ref_d[0]),
                            False))
        checks.append(Check(prompt_index, f"draft confidence ({call} call){drawn}",
                            _max_diff(got_d["draft_confidence"], ref_d[2]), False))
        for index, name in enumerate(signals):  # a confidence head's draft: the argmax probability beside it
            checks.append(Check(prompt_index, f"draft {name.removeprefix('draft_').replace('_', ' ')} ({call} call)"
                                f"{drawn}", _max_diff(got_d[name], ref_d[3 + index]), False))
        scales += [_scale(ref_d[0]), 1.0, *([1.0] * len(signals))]
        start += context.shape[1]
        past = ref_d[3 + len(signals) + extra:]
        context = ref_v[2][:, :2]
    for check, scale in zip(checks, scales):
        check.ok = bool(check.value <= tol + relative * scale)
    return checks


def run_parity(out_dir: Path, target_dir: Path | None = None, draft_dir: Path | None = None, num_prompts: int = 4,
               max_new_tokens: int = 32, seed: int = 0, decoder: Decoder | None = None) -> ParityReport:
    """Compare the exported graphs in `out_dir` with the PyTorch pair they were exported from."""
    decoder = decoder or open_decoder(Path(out_dir))
    manifest = decoder.manifest
    if manifest.backend is not None or manifest.form != "concat":
        raise DFlashError(f"{out_dir} is lowered (for {manifest.backend}, {manifest.form} form): run parity on the "
                          "export it came from, and compare 'dflash-onnx generate' on both")
    target_dir, draft_dir = manifest.checkpoints(target_dir, draft_dir)
    lm = load_target(target_dir, manifest.dtype)
    draft = load_draft(draft_dir, lm, manifest.dtype)
    tapped = wrap_target(lm, manifest.target_layer_ids)
    report = ParityReport(tolerance=LOGIT_TOLERANCE[manifest.dtype])
    lossy = [p for p in manifest.passes if p.get("lossy")]
    relative = max((float(p["bound"]) for p in lossy), default=0.0)  # graph passes state their own bounds
    reference_model = None if manifest.target.recurrent else load_reference_draft(draft_dir, manifest.dtype)
    if manifest.target.recurrent:
        report.reference_skipped = HYBRID_REFERENCE
    report.reference_available = reference_model is not None
    rng = np.random.default_rng(seed)
    stops = list(manifest.stop_token_ids)
    for index in range(num_prompts):
        prompt = rng.integers(0, manifest.vocab_size, size=int(rng.integers(1, 24)))
        report.checks += _compare_graphs(index, prompt, manifest, decoder, tapped, draft, report.tolerance, relative)
        ours = decoder.generate(prompt, max_new_tokens, "dflash").tokens
        if lossy:  # a transformed target is another model: lossless means equal to its own greedy output
            greedy = decoder.generate(prompt, max_new_tokens, "greedy").tokens
            report.checks.append(Check(index, "tokens: dflash-ort == ort greedy", f"{len(ours)} tok", ours == greedy))
            continue
        hf = hf_greedy(lm, prompt.tolist(), max_new_tokens, stops)
        report.checks.append(Check(index, "tokens: dflash-ort == hf greedy", f"{len(ours)} tok", ours == hf))
        if reference_model is not None:
            reference = _reference_tokens(reference_model, lm, prompt, max_new_tokens, stops, manifest.block_size)
            report.checks.append(Check(index, "tokens: dflash-ort == reference", f"{len(reference)} tok",
                                       ours == reference))
    return report
