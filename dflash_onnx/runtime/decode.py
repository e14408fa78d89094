"""The decoding loop, numpy only: greedy baseline and DFlash speculative decoding on any backend.

It talks to two Sessions (target, draft) through the manifest's input/output names and never imports
torch or a backend (`dflash_onnx.targets.open_decoder` opens one on a directory). One DFlash step: block = [last
token, mask x (B-1)]; the draft proposes positions 1..B-1 (DSpark's anchor slot too: B proposals); the target
verifies [last token, proposals] in one call; the longest agreeing prefix plus the target's bonus token is committed
(truncated at a stop token); KV rollback is a length change.

In layers, as mlx-lm's generate_step / stream_generate / generate: `Decoder.generate` runs `stream` to its end;
`stream` checks a request and makes its RequestDecoding (request.py) with a proposer for its draft kind
(proposers.py) and a policy for its verify mode (policy.py); `_steps` times that request's prefill and steps.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dflash_onnx.runtime.costs import curve_disagreement
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import CostModel, Manifest
from dflash_onnx.runtime.policy import Calibration, Measured, verify_policy
from dflash_onnx.runtime.proposers import proposer_for
from dflash_onnx.runtime.request import BatchShare, RequestDecoding, StepPricing
from dflash_onnx.runtime.results import GenerationResult
from dflash_onnx.runtime.runners import open_runners, open_target_runner
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.runtime.session import Session

__all__ = ["MODES", "BatchShare", "Decoder", "GenerationResult", "Learnt", "check_max_new_tokens"]

MODES = ("dflash", "greedy")


def check_max_new_tokens(max_new_tokens: int) -> None:
    """Refused by `generate`, and by the CLI before it opens the sessions."""
    if max_new_tokens < 1:
        raise DFlashError(f"max_new_tokens must be at least 1, got {max_new_tokens}")


@dataclass
class Learnt:
    """What a decoder learns as it runs, kept across its requests and shared with the decoders made from it (a
    batch's slots, a benchmark's variants): how often the target accepts the draft's proposals at each confidence
    (a property of the pair, greedy and sampled acceptance apart, so a request's first steps need not draft on the
    prior's word), and what its greedy steps have cost in this process (target calls against the curve, the rest of a
    step with and without a draft call, what drafted steps delivered), which the `auto` policy weighs."""

    calibrations: dict[bool, list[Calibration]] = field(default_factory=dict)
    measured: Measured = field(default_factory=Measured)


class Decoder:
    """Greedy and DFlash decoding over a target and a draft Session described by one manifest.

    A decoder is configured when it is made; `sharing` makes another over other sessions or settings that learns
    with it, and `for_slot` one for a request decoding in a batch."""

    def __init__(self, manifest: Manifest, target: Session, draft: Session | None, prefill_chunk: int = 256, *,
                 costs: CostModel | None = None, measure_steps: bool = True, batch_invariant: bool = True,
                 guess_padding: bool = True, batch: BatchShare | None = None, learnt: Learnt | None = None):
        """Args:
            manifest: the directory's dflash.json (`dflash_onnx.runtime.manifest.load_manifest`).
            target, draft: the two graphs' sessions (any objects implementing `Session`); draft None decodes
                greedily only.
            prefill_chunk: the most prompt tokens one prefill call takes (a long prompt never materialises
                [prompt, vocab] logits).
            costs: the backend's cost curve the `auto` verify policy weighs (default: the manifest's).
            measure_steps: correct the curve by what this process's steps measure as they run; off where the curve
                is given for the run (a replayed curve is the point of it).
            batch_invariant: pad the target's calls to the lowering's row multiple, so that a token's logits do not
                depend on how many rows its call had and greedy and DFlash give identical tokens (runners.py).
            guess_padding: a greedy step that verifies only its last token carries a prompt-lookup guess in the
                padding row the call pays for anyway (lookup.py).
            batch: the batch this decoder's requests share their steps with (`for_slot` sets it).
            learnt: what another decoder has learnt, to learn on with it (`sharing` passes it).

        Raises:
            DFlashError: a prefill_chunk below 1, or a session that does not implement the Session protocol.
        """
        if prefill_chunk < 1:
            raise DFlashError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        for role, session in (("target", target), ("draft", draft)):
            if session is not None and not isinstance(session, Session):
                raise DFlashError(f"the {role} session {type(session).__name__} does not implement the Session "
                                  "protocol (input_names, output_names, retains_state, run)")
        self.manifest, self.target, self.draft = manifest, target, draft
        self.prefill_chunk = prefill_chunk
        self.stop_token_ids = list(manifest.stop_token_ids)
        self.costs = costs or manifest.costs
        self.measure_steps = measure_steps
        self.batch_invariant, self.guess_padding = batch_invariant, guess_padding
        self.batch = batch
        self.learnt = learnt or Learnt()
        self._made = True

    def __setattr__(self, name: str, value) -> None:
        if getattr(self, "_made", False):
            raise AttributeError(f"a Decoder is configured when it is made: use decoder.sharing({name}=...) for one "
                                 "that differs")
        super().__setattr__(name, value)

    def sharing(self, **changes) -> Decoder:
        """Another decoder on this one's manifest that learns with it (the `Learnt` is shared), with `changes` to
        its constructor's arguments (target, draft, prefill_chunk, costs, measure_steps, batch_invariant,
        guess_padding, batch)."""
        arguments = dict(target=self.target, draft=self.draft, prefill_chunk=self.prefill_chunk, costs=self.costs,
                         measure_steps=self.measure_steps, batch_invariant=self.batch_invariant,
                         guess_padding=self.guess_padding, batch=self.batch)
        unknown = sorted(set(changes) - set(arguments))
        if unknown:
            raise TypeError(f"Decoder.sharing() takes no {', '.join(unknown)}")
        return Decoder(self.manifest, **{**arguments, **changes}, learnt=self.learnt)

    def branched(self) -> Decoder:
        """A decoder on the same sessions and settings that starts from what this one has learnt so far and learns
        apart from it from now on (a benchmark's rounds, each starting from the same state)."""
        return Decoder(self.manifest, self.target, self.draft, self.prefill_chunk, costs=self.costs,
                       measure_steps=self.measure_steps, batch_invariant=self.batch_invariant,
                       guess_padding=self.guess_padding, batch=self.batch, learnt=copy.deepcopy(self.learnt))

    def for_slot(self, target: Session, draft: Session | None, batch: BatchShare) -> Decoder:
        """The decoder of one request in `batch`: its slot's sessions, this decoder's settings and what it has
        learnt (the pair's acceptance), its policy weighing the request's share of each batched step."""
        return self.sharing(target=target, draft=draft, batch=batch)

    @property
    def row_multiple(self) -> int:
        """The row multiple the target's calls are padded to (1: none)."""
        lowering = self.manifest.lowering
        return lowering.row_multiple if self.batch_invariant and lowering is not None else 1

    def guesses(self, sampling: SamplingParams) -> bool:
        """Whether a step verifying only its last token fills the padding row with a lookup guess: greedy decoding
        on a padded lowering, except a mixture-of-experts target, whose padding rows skip the experts (a guess
        would pay them)."""
        return self.guess_padding and self.row_multiple == 2 and sampling.greedy and not self.manifest.experts

    def _padded_costs(self, depth: int = 0) -> CostModel | None:
        """The cost curve as this decoder's padded calls pay it, after `depth` tokens of context."""
        costs = self.costs.at_depth(depth) if self.costs else None
        return costs.padded_to(self.row_multiple) if costs and self.row_multiple > 1 else costs

    def curve_check(self, *results: GenerationResult) -> str | None:
        """One line when the target steps of `results` disagree in shape with the cost curve this decoder weighs
        (as its padded calls pay it, at the steps' median depth); None otherwise (costs.curve_disagreement)."""
        timed = [r for r in results if not r.sampled]
        depths = [r.prompt_tokens + len(r.tokens) // 2 for r in timed]
        return curve_disagreement(self._padded_costs(int(np.median(depths)) if depths else 0),
                                  [n for r in timed for n in r.verified], [ms for r in timed for ms in r.step_ms])

    @property
    def capacity(self) -> int | None:
        """The most positions (prompt + new tokens) a request may take on these sessions; None: no bound."""
        return open_target_runner(self.manifest, self.target, self.prefill_chunk, self.row_multiple).capacity

    def check(self, prompt_ids: list[int] | np.ndarray, max_new_tokens: int, mode: str = "dflash",
              sampling: SamplingParams | None = None) -> np.ndarray:
        """The prompt as ids, or DFlashError for a request `stream` refuses: checked before anything runs (a
        server checks a request before it queues it)."""
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise DFlashError("the prompt is empty: give at least one token")
        check_max_new_tokens(max_new_tokens)
        if mode not in MODES:
            raise DFlashError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if prompt.min() < 0 or prompt.max() >= self.manifest.vocab_size:
            raise DFlashError(f"prompt ids must lie in 0..{self.manifest.vocab_size - 1}")
        if mode == "dflash" and self.draft is None:
            raise DFlashError("dflash mode needs a draft session")
        if sampling is not None and not sampling.greedy and "logits" not in self.manifest.target.output_names():
            raise DFlashError("this lowering's graphs return token ids only (greedy decoding): sampling needs their "
                              "logits, so lower again with --logits")
        if self.capacity is not None and len(prompt) + max_new_tokens > self.capacity:
            padding = f" ({self.row_multiple - 1} kept for padding calls)" if self.row_multiple > 1 and \
                self.manifest.form != "retained" else ""
            raise DFlashError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceed the "
                              f"{self.capacity} positions this lowering holds{padding}: lower with a larger "
                              "--ctx-len")
        return prompt

    def stream(
        self, prompt_ids: list[int] | np.ndarray, max_new_tokens: int = 64, mode: str = "dflash",
        sampling: SamplingParams | None = None, stop_token_ids: list[int] | None = None, verify: str | int = "auto",
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[list[int]]:
        """Each step's committed tokens as they are committed; the iterator's return value (StopIteration.value) is
        the GenerationResult. The arguments are checked here, before anything runs.

        Args:
            prompt_ids: the prompt's token ids.
            max_new_tokens: the most tokens to generate (at least 1).
            mode: "dflash" (draft and verify) or "greedy" (the target alone).
            sampling: temperature, top-p, top-k and seed; None or temperature 0 decodes greedily.
            stop_token_ids: tokens that end generation (default: the manifest's).
            verify: how many drafted tokens each step verifies: "auto" (from the draft's confidence and the cost
                curve; full without a curve), "full" (the whole block, as the reference does) or a count.
            cancelled: asked between a long prompt's prefill chunks (the caller stops the iteration between steps).

        Raises:
            DFlashError: a request these sessions cannot run (empty or out-of-vocabulary prompt, too long for the
                lowering, sampling on a greedy-only lowering, an unknown mode or verify).
            Cancelled: from the iteration, when `cancelled` said so between prefill chunks.
        """
        prompt = self.check(prompt_ids, max_new_tokens, mode, sampling)
        return self._steps(self._request(prompt, max_new_tokens, mode, sampling or SamplingParams(),
                                         stop_token_ids, verify), cancelled)

    def _request(self, prompt: np.ndarray, max_new_tokens: int, mode: str, sampling: SamplingParams,
                 stop_token_ids: list[int] | None, verify: str | int) -> RequestDecoding:
        """A checked request's decoding state: its runners, proposer and verify policy."""
        target, draft = open_runners(self.manifest, self.target, self.draft, self.prefill_chunk, self.row_multiple)
        most_rows = self.manifest.verify_rows if mode == "dflash" else 1
        # measured step times steer only greedy requests, whose tokens no verified length can change: a seeded
        # sampled request draws the same tokens on every run (how many rows a step verifies decides which draws
        # it makes). A batched request's steps wait on the others': its share is priced by the curve alone.
        measured = self.learnt.measured \
            if self.measure_steps and sampling.greedy and self.batch is None and most_rows > 1 else None
        policy = verify_policy(verify, self._padded_costs(len(prompt)), self.manifest.verify_rows,
                               self.learnt.calibrations.setdefault(not sampling.greedy, []), measured)
        pricing = StepPricing(self.costs, self.row_multiple, self.batch) \
            if self.costs is not None and (self.batch is not None or self.costs.deeper) else None
        stops = frozenset(self.stop_token_ids if stop_token_ids is None else stop_token_ids)
        proposer = proposer_for(self.manifest, sampling, np.random.default_rng(sampling.seed))
        return RequestDecoding(target, draft, prompt, max_new_tokens, self.manifest.block_size,
                               self.manifest.mask_token_id, most_rows, proposer, policy, stops,
                               self.guesses(sampling), self.batch, pricing)

    @staticmethod
    def _steps(request: RequestDecoding, cancelled: Callable[[], bool] | None = None) -> Iterator[list[int]]:
        """The request's prefill, then its steps, each timed: the target call against the whole step, which the
        policy weighs, and the decode time, which excludes what the caller spends between steps (printing a
        stream)."""
        started = time.perf_counter()
        first = request.prefill(cancelled)
        request.result.ttft_s = time.perf_counter() - started
        yield [first]
        decode_started = time.perf_counter()
        consumer_s, drafted_before = 0.0, False
        while request.unfinished:
            step_started = time.perf_counter()
            new = request.step()
            paused = time.perf_counter()
            if drafted_before or not request.ingested:  # a first draft call ingests the prompt: a request's cost
                request.policy.observe_time(request.ingested, request.rows, request.result.step_ms[-1],
                                            1000 * (paused - step_started), len(new))
            drafted_before = drafted_before or request.ingested > 0
            yield new
            consumer_s += time.perf_counter() - paused
        request.result.decode_s = time.perf_counter() - decode_started - consumer_s
        request.result.stopped = request.stopped
        return request.result

    def generate(
        self, prompt_ids: list[int] | np.ndarray, max_new_tokens: int = 64, mode: str = "dflash",
        sampling: SamplingParams | None = None, stop_token_ids: list[int] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None, verify: str | int = "auto",
    ) -> GenerationResult:
        """Decode to the end (the arguments as `stream`'s); `on_tokens` sees each step's committed tokens as they are
        committed.

        Returns:
            GenerationResult: the tokens and the reference's metrics (tau, tokens_per_second, ttft_s, ...).
        """
        steps = self.stream(prompt_ids, max_new_tokens, mode, sampling, stop_token_ids, verify)
        while True:
            try:
                chunk = next(steps)
            except StopIteration as done:
                return done.value
            if on_tokens is not None:
                on_tokens(chunk)
