"""The ONNX Runtime reference run: exported graphs against the PyTorch modules they came from.

Per prompt it compares target logits and tapped features (prefill and verify shapes) and draft
logits (first and later calls), then checks that DFlash on ORT, greedy PyTorch (HF generate) and,
when installed, the reference `dflash_generate` produce the same tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from dflash_onnx.artifacts.hub import checkpoints
from dflash_onnx.exporter.as_graphs import NEXT_TOKEN, TorchGraphs
from dflash_onnx.exporter.models.hybrid import wrap_target
from dflash_onnx.exporter.models.target import hf_greedy
from dflash_onnx.exporter.pair import LOGIT_TOLERANCE, load_draft, load_reference_draft, load_target
from dflash_onnx.exporter.rounded import ROUNDING_PASSES, rounded
from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.differences import max_difference
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.feeds import sampling_feeds
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets import open_decoder

# A rounded export may leave the float pair by this many times what the same rounding, made by rounded.py's own
# quantizer, moves the PyTorch pair on the same feeds (the most over the prompts, per check). Measured on three tiny
# pairs (dense, windowed draft, MoE) x int4 / int8 / fp16, 4 prompts: the graphs moved at most 2.3x what the reference
# moved on logits, features and K/V, 4.1x on a draft confidence near 1 (6.8x at int4 accuracy_level 0); int4 bytes
# under an int8 record move them ~16x (tests/test_passes.py refuses that)
ROUNDING_SLACK = 8.0

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
    allowed: float | None = None  # the largest difference this check accepts (None: an equality)


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
        lines = [f"{'prompt':>6}  {'check':<34} {'value':>12} {'allowed':>10}  result"]
        for c in self.checks:
            value = f"{c.value:.3e}" if isinstance(c.value, float) else str(c.value)
            allowed = "" if c.allowed is None else f"{c.allowed:.3e}"
            lines.append(f"{c.prompt:>6}  {c.name:<34} {value:>12} {allowed:>10}  {'ok' if c.ok else 'MISMATCH'}")
        if self.reference_skipped:
            lines.append(f"reference package not compared: {self.reference_skipped}")
        lines.append(f"tolerance {self.tolerance:g}; {'all ok' if self.ok else 'MISMATCHES FOUND'}")
        return "\n".join(lines)


def _reference_tokens(model, lm, prompt: np.ndarray, max_new_tokens: int, stops: list[int],
                      block_size: int) -> list[int]:
    from dflash.model import dflash_generate

    ids = torch.tensor(prompt)[None]
    out = dflash_generate(model, lm, ids, max_new_tokens, stops or None, block_size=block_size)
    return out[0, len(prompt):].tolist()


@dataclass
class _Call:
    """One call of the walk: its feeds (from the float pair's outputs) and, per check, the outputs compared with
    what the float pair returned for them."""

    graph: str
    feeds: dict[str, np.ndarray]
    checks: list[tuple[str, list[str]]]
    expected: dict[str, np.ndarray]


def _at(manifest: Manifest, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hidden states and K/V at the graphs' precision (a float16 export takes float16); ids and the draft's sampling
    inputs as they are."""
    dtype = np.dtype(manifest.dtype)
    return {name: value.astype(dtype) if value.dtype.kind == "f" and value.ndim > 2 else value
            for name, value in feeds.items()}


def _walk(prompt_index: int, prompt: np.ndarray, manifest: Manifest, pair: TorchGraphs) -> list[_Call]:
    """The calls parity compares: the target's prefill and a verify after it, the draft's first and a later call;
    each fed what the float pair gave the call before it."""
    calls = []
    state_in, state_out = pair.tapped.state_names()  # K/V, and a hybrid target's linear-attention state
    n = len(prompt)
    empty = {name: t.numpy() for name, t in zip(state_in, pair.tapped.empty_cache(dtype=torch.float32))}
    feeds = _at(manifest, {"input_ids": prompt[None], "position_ids": np.arange(n)[None], **empty})
    prefill = pair.target.run(feeds)
    calls.append(_Call("target", feeds, [("target logits (prefill)", ["logits"]),
                                         ("target hidden (prefill)", ["target_hidden"])], prefill))
    block = np.full((1, manifest.block_size), manifest.mask_token_id)
    block[0, 0] = int(prefill[NEXT_TOKEN][0, -1])
    feeds = _at(manifest, {"input_ids": block, "position_ids": np.arange(n, n + manifest.block_size)[None],
                           **pair.next_state(prefill, n, n)})
    verify = pair.target.run(feeds)
    state = "present K/V and state (verify)" if manifest.target.recurrent else "present K/V (verify)"
    calls.append(_Call("target", feeds, [("target logits (verify)", ["logits"]),
                                         ("target hidden (verify)", ["target_hidden"]), (state, state_out)], verify))
    context, start = prefill["target_hidden"], 0
    past = {name: np.zeros((1, 0, *manifest.draft.kv_shape(name)), np.float32) for name in manifest.draft.kv_inputs}
    signals = pair.draft_module.signal_outputs()
    # a DSpark draft's chain drawn in the graph: the later call draws it from fixed uniforms at a temperature
    # (the draws follow the logits: equal up to a uniform falling on a rounding-sized boundary)
    draws = pair.draft_module.spec.proposals(manifest.block_size)
    uniform = np.random.default_rng(prompt_index).random(draws).astype(np.float32)
    for call in ("first", "later"):
        temperature = 0.7 if call == "later" and pair.draft_module.extra_inputs() else 0.0
        positions = np.arange(start, start + context.shape[1] + manifest.block_size)[None]
        feeds = _at(manifest, {"input_ids": block, "target_hidden": context, "position_ids": positions, **past,
                               **sampling_feeds(manifest.draft, uniform, temperature)})
        out = pair.draft.run(feeds)
        drawn = " (its chain drawn)" if temperature else ""
        checks = [(f"draft logits ({call} call){drawn}", ["logits"]),
                  (f"draft confidence ({call} call){drawn}", ["draft_confidence"])]
        # a confidence head's draft: the argmax probability beside it
        checks += [(f"draft {name.removeprefix('draft_').replace('_', ' ')} ({call} call){drawn}", [name])
                   for name in signals]
        calls.append(_Call("draft", feeds, checks, out))
        start += context.shape[1]
        past = {name: out[present] for name, present in zip(manifest.draft.kv_inputs, manifest.draft.kv_outputs)}
        context = verify["target_hidden"][:, :2]
    return calls


def _differences(calls: list[_Call], graphs) -> list[tuple[str, float]]:
    """(check, largest difference of `graphs`' outputs from the float pair's) per check."""
    found = []
    for call in calls:
        got = getattr(graphs, call.graph).run(call.feeds)
        for check, names in call.checks:
            found.append((check, max(max_difference(call.expected[name].astype(np.float64), got[name])
                                     for name in names)))
    return found


def _compare_graphs(prompt_index: int, prompt: np.ndarray, manifest: Manifest, decoder: Decoder,
                    pair: TorchGraphs, rounding) -> list[tuple[Check, float]]:
    """Each check's largest difference of the graphs from the PyTorch pair, beside what the rounding a lossy pass
    makes (dflash_onnx/exporter/rounded.py) moves the pair on the same feeds (0 where no pass rounds)."""
    calls = _walk(prompt_index, prompt, manifest, pair)
    found = _differences(calls, decoder)
    moved = [0.0] * len(found)
    with rounding() as rounds:
        if rounds:
            moved = [difference for _, difference in _differences(calls, pair)]
    return [(Check(prompt_index, check, difference, False), shift) for (check, difference), shift in zip(found, moved)]


def _judge(measured: list[tuple[Check, float]], tol: float) -> None:
    """Allowed per check: `tol` plus ROUNDING_SLACK times the most the rounding moved that check over all prompts
    (one prompt's largest logit difference is a noisy statistic; over the prompts it settles)."""
    worst: dict[str, float] = {}
    for check, moved in measured:
        worst[check.name] = max(worst.get(check.name, 0.0), moved)
    for check, _ in measured:
        check.allowed = tol + ROUNDING_SLACK * worst[check.name]
        check.ok = bool(check.value <= check.allowed)


def run_parity(out_dir: Path, target_dir: Path | None = None, draft_dir: Path | None = None, num_prompts: int = 4,
               max_new_tokens: int = 32, seed: int = 0, decoder: Decoder | None = None) -> ParityReport:
    """Compare the exported graphs in `out_dir` with the PyTorch pair they were exported from."""
    decoder = decoder or open_decoder(Path(out_dir))
    manifest = decoder.manifest
    if manifest.backend is not None or manifest.form != "concat":
        raise DFlashError(f"{out_dir} is lowered (for {manifest.backend}, {manifest.form} form): run parity on the "
                          "export it came from, and compare 'dflash-onnx generate' on both")
    target_dir, draft_dir = checkpoints(manifest, target_dir, draft_dir)
    lm = load_target(target_dir, manifest.dtype)
    draft = load_draft(draft_dir, lm, manifest.dtype)
    tapped = wrap_target(lm, manifest.target_layer_ids)
    report = ParityReport(tolerance=LOGIT_TOLERANCE[manifest.dtype])
    lossy = [p for p in manifest.passes if p.get("lossy")]
    unknown = [p["name"] for p in lossy if p["name"] not in ROUNDING_PASSES]
    if unknown:
        raise DFlashError(f"parity has no reference for the lossy pass {', '.join(unknown)} (it knows "
                          f"{', '.join(ROUNDING_PASSES)}): compare 'dflash-onnx generate' on the export before it")
    pair = TorchGraphs(manifest, tapped, draft)
    rounding = partial(rounded, {"target": lm, "draft": draft}, manifest.passes, manifest.vocab_size, lm.config)
    reference_model = None if manifest.target.recurrent else load_reference_draft(draft_dir, manifest.dtype)
    if manifest.target.recurrent:
        report.reference_skipped = HYBRID_REFERENCE
    report.reference_available = reference_model is not None
    rng = np.random.default_rng(seed)
    stops = list(manifest.stop_token_ids)
    measured = []
    for index in range(num_prompts):
        prompt = rng.integers(0, manifest.vocab_size, size=int(rng.integers(1, 24)))
        found = _compare_graphs(index, prompt, manifest, decoder, pair, rounding)
        measured += found
        report.checks += [check for check, _ in found]
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
    _judge(measured, report.tolerance)
    return report
