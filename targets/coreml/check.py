"""The CoreML lowering's output check, runnable anywhere: the packages written, evaluated in numpy from their
spec (mil_eval.py), against the PyTorch modules that were converted (float32), on the same call sequence
through the retained runners (prefill, verify with a partial commit, decode; draft proposals as the context
grows), with the same state semantics; with --bits, the modules' weights rounded as the packages hold them
(rounded_weights.py). Refuses packages whose logits leave float16's tolerance, or whose greedy ids differ where
the reference's top two logits are clearly apart."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from dflash_onnx.runtime.differences import finite_scale, scaled_difference
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.runtime.runners import open_runners
from dflash_onnx.targets.coreml.mil_eval import MilProgram, read_spec, weight_reader
from dflash_onnx.targets.coreml.rounded_weights import rounded_weights
from dflash_onnx.targets.coreml.session import part_functions, part_packages, run_parts, typed_feeds

# Largest logit difference to the float32 modules (their weights rounded as the packages' are), relative to their
# largest |logit|: float16 compute's, with margin (docs/coreml.md#the-check-without-a-mac)
TOLERANCE = 2e-2
# a greedy id may differ only where the reference's top two logits are this close (relative to the scale)
TIE = 2e-2


PART_OUTPUTS = ["hidden", "tap_sum"]  # what every target part but the last returns


class TorchStatefulSession:
    """A module coremltools converts (or the parts of one, run in turn), in PyTorch with its state buffers: the
    reference, and the stand-in for CoreML where none runs. `weights(module)`: a context that gives a part's
    module its weights while it runs (parts converted from checkpoints read as needed)."""

    retains_state = True

    def __init__(self, modules: torch.nn.Module | list[torch.nn.Module], output_names: list[str],
                 weights: Callable[[torch.nn.Module], AbstractContextManager] | None = None):
        self.modules = modules if isinstance(modules, list) else [modules]
        self.output_names, self.weights = output_names, weights or (lambda module: nullcontext())
        self.input_names: list[str] = []

    def _part(self, module: torch.nn.Module, names: list[str]) -> Callable[[dict], dict]:
        def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            with torch.no_grad(), self.weights(module):
                values = module(*(torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values()))
            return {name: value.numpy() for name, value in zip(names, values)}
        return run

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        last = len(self.modules) - 1
        out = run_parts([self._part(m, self.output_names if k == last else PART_OUTPUTS)
                         for k, m in enumerate(self.modules)], feeds)
        return {n: out[n].astype(np.int64) if n.endswith("_ids") else out[n]
                for n in (output_names or self.output_names)}


class MilSession:
    """A graph's functions of a package evaluated in numpy, sharing their states between calls (the CoreML
    session's contract): each call runs the function whose rows its `functions["input"]` has (in a graph in
    parts, that function of each part in turn, each part with its own states)."""

    retains_state = True

    def __init__(self, packages: list[Path], functions: dict):
        specs = {package: read_spec(package) for package in set(packages)}
        readers = {package: weight_reader(package) for package in specs}
        self.by = functions["input"]
        self.programs = {size: [MilProgram(package, name, specs[package], readers[package])
                                for package, name in zip(packages, names)]
                         for size, names in part_functions(functions).items()}
        first = next(iter(self.programs.values()))
        self.states = [program.initial_states() for program in first]
        self.input_names, self.output_names = first[0].input_names, first[-1].outputs

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        inputs = typed_feeds(feeds)
        programs = self.programs[feeds[self.by].shape[1]]
        out = run_parts([lambda part_feeds, program=program, states=states: program.run(part_feeds, states)
                         for program, states in zip(programs, self.states)], inputs)
        return {n: out[n].astype(np.int64) if n.endswith("_ids") else out[n] for n in output_names or self.output_names}


def _sequence(manifest: Manifest, target, draft) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(greedy ids, logits) per call: a prefill of 20, a verify of a block keeping 2, a decode; then draft
    proposals on the target's features as its context grows by those calls' kept rows."""
    target_runner, draft_runner = open_runners(manifest, target, draft, int(manifest.prefill_len))
    rng = np.random.default_rng(0)
    outputs, length = {}, 0
    for step, (count, keep) in enumerate(((20, 20), (manifest.block_size, 2), (1, 1))):
        ids = rng.integers(2, manifest.vocab_size - 1, size=count)
        out = target_runner.forward(ids, count)
        outputs[f"target logits (step {step})"] = (out.greedy_ids, out.logits)
        length += keep
        target_runner.commit(length)
        block = np.full(manifest.block_size, manifest.mask_token_id)
        block[0] = ids[keep - 1]
        proposal = draft_runner.propose(block, out.context[:keep], True)
        outputs[f"draft logits (proposal {step})"] = (proposal.ids, proposal.logits)
    return outputs


def _reference_weights(weights: Callable[[torch.nn.Module], AbstractContextManager] | None, bits: int | None,
                       group_size: int) -> Callable[[torch.nn.Module], AbstractContextManager]:
    """A module's weights for the reference: given by `weights` (or its own), rounded as a `bits` package's."""
    @contextmanager
    def given(module: torch.nn.Module):
        with ExitStack() as stack:
            stack.enter_context(weights(module) if weights else nullcontext())
            if bits:
                stack.enter_context(rounded_weights(module, bits, group_size))
            yield
    return given


def check_packages(directory: Path, manifest: Manifest, target_module, draft_module, bits: int | None,
                   group_size: int = 32,
                   weights: Callable[[torch.nn.Module], AbstractContextManager] | None = None) -> float:
    """Largest logit difference of the packages in `directory` to the converted modules (the target's parts, in a
    list, when it was converted in parts; `weights`: see TorchStatefulSession) with their weights rounded to `bits`
    in blocks of `group_size` as the packages' are, relative to the largest |logit|; refused beyond TOLERANCE, or
    when a greedy id differs away from a near tie."""
    given = _reference_weights(weights, bits, group_size)
    reference = _sequence(manifest,
                          TorchStatefulSession(target_module, ["greedy_ids", "logits", "context_hidden"], given),
                          TorchStatefulSession(draft_module, draft_module.output_names(), given))
    functions = manifest.lowering.functions
    got = _sequence(manifest, *(MilSession(part_packages(Path(directory), functions[graph],
                                                         getattr(manifest, graph).file), functions[graph])
                                for graph in ("target", "draft")))
    allowed, worst = TOLERANCE, 0.0
    for name, (want_ids, want) in reference.items():
        ids, logits = got[name]
        scale = max(finite_scale(want), 1e-6)
        difference = scaled_difference(want, logits)
        worst = max(worst, difference)
        top2 = np.sort(want, axis=-1)[..., -2:]
        clear = (top2[..., 1] - top2[..., 0]) / scale > TIE
        if difference > allowed or np.any((ids != want_ids) & clear):
            raise DFlashError(f"the CoreML packages change {name} by {difference:.2g} of its scale (allowed "
                              f"{allowed:g}; greedy ids {ids.tolist()} vs {want_ids.tolist()}), evaluated in numpy "
                              "from their spec: report the model")
    return worst
