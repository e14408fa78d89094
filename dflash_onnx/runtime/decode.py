"""The decoding loop, numpy only: greedy baseline and DFlash speculative decoding on any backend.

It talks to two Sessions (target, draft) through the manifest's input/output names and never imports
torch or a backend (`dflash_onnx.targets.open_decoder` opens one on a directory). One DFlash step: block = [last
token, mask x (B-1)]; the draft proposes positions 1..B-1 (DSpark's anchor slot too: B proposals); the target
verifies [last token, proposals] in one call;
the longest agreeing prefix plus the target's bonus token is committed (truncated at a stop token);
KV rollback is a length change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dflash_onnx.runtime.costs import curve_disagreement
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.lookup import NgramLookup
from dflash_onnx.runtime.manifest import CostModel, Manifest
from dflash_onnx.runtime.policy import Calibration, Measured, VerifyPolicy
from dflash_onnx.runtime.runners import open_runners, open_target_runner
from dflash_onnx.runtime.sampling import (
    SamplingParams,
    rejection_sample,
    sample_rows,
    sample_selector_chain,
    sampling_probs,
)
from dflash_onnx.runtime.session import Session

MODES = ("dflash", "greedy")


@dataclass
class GenerationResult:
    """Generated ids (a stop token included when one ended generation) and the reference's metrics."""

    tokens: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)  # drafted tokens each step verified (0: no draft call)
    step_ms: list[float] = field(default_factory=list)  # each step's target call (costs.curve_disagreement)
    guessed: int = 0  # steps whose padding row carried a lookup guess (lookup.py)
    guessed_right: int = 0  # of them, those whose guess the target agreed with
    sampled: bool = False  # sampled decoding: its target calls also return logits, which the curve does not time
    prompt_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    stopped: bool = False

    @property
    def tau(self) -> float:
        """Mean tokens committed per target verify step (the reference's acceptance length)."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Output tokens over decode time, the reference's definition (prefill excluded)."""
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def end_to_end_tokens_per_second(self) -> float:
        total = self.ttft_s + self.decode_s
        return len(self.tokens) / total if total > 0 else 0.0

    def acceptance_histogram(self, block_size: int) -> list[int]:
        """Counts of steps that committed 1..block_size tokens."""
        counts = np.bincount(np.asarray(self.acceptance_lengths, dtype=np.int64), minlength=block_size + 1)
        return counts[1 : block_size + 1].tolist()


def _agreeing_prefix(drafted: list[int], posterior: list[int]) -> int:
    """How many drafted tokens equal the target's greedy tokens before the first disagreement (plain
    Python: on a 16-token block numpy's per-call cost is larger than the work)."""
    for index, (proposed, verified) in enumerate(zip(drafted, posterior)):
        if proposed != verified:
            return index
    return len(drafted)


def check_max_new_tokens(max_new_tokens: int) -> None:
    """Refused by `generate`, and by the CLI before it opens the sessions."""
    if max_new_tokens < 1:
        raise DFlashError(f"max_new_tokens must be at least 1, got {max_new_tokens}")


class Decoder:
    """Greedy and DFlash decoding over a target and a draft Session described by one manifest."""

    def __init__(self, manifest: Manifest, target: Session, draft: Session | None, prefill_chunk: int = 256,
                 costs: CostModel | None = None, batch_invariant: bool = True, guess_padding: bool = True):
        """`costs`: the backend's cost curve the `auto` verify policy weighs (default: the manifest's).
        `batch_invariant`: pad the target's calls to the lowering's row multiple, so that a token's logits do not
        depend on how many rows its call had and greedy and DFlash give identical tokens (runners.py).
        `guess_padding`: a greedy step that verifies only its last token carries a prompt-lookup guess in the
        padding row the call pays for anyway (lookup.py)."""
        if prefill_chunk < 1:
            raise DFlashError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        for role, session in (("target", target), ("draft", draft)):
            if session is not None and not isinstance(session, Session):
                raise DFlashError(f"the {role} session {type(session).__name__} does not implement the Session "
                                  "protocol (input_names, output_names, retains_state, run)")
        self.manifest = manifest
        self.target = target
        self.draft = draft
        self.prefill_chunk = prefill_chunk
        self.stop_token_ids = list(manifest.stop_token_ids)
        self.costs = costs or manifest.costs
        self.batch_invariant = batch_invariant
        self.guess_padding = guess_padding
        # how often the target accepts the draft's proposals at each confidence, learnt by the `auto` policy: a
        # property of the pair (greedy and sampled acceptance apart), so kept across requests rather than learnt
        # anew by each, whose first steps would otherwise draft on the prior's word
        self.calibrations: dict[bool, list[Calibration]] = {}
        # what its greedy steps have cost in this process (target calls against the curve, the rest of a step with
        # and without a draft call, what drafted steps delivered), kept likewise: the `auto` policy weighs them
        # (dflash_onnx/runtime/policy.py). Off where the curve is given for the run (a replayed curve is the point of
        # it).
        self.measured = Measured()
        self.measure_steps = True
        # decoding beside other requests (dflash_onnx/runtime/batching.py): how many share each step, so that the `auto`
        # policy weighs this request's share of a batched step (CostModel.shared_by) rather than a call alone
        self.batch_width: Callable[[], int] | None = None
        # and whether the batch drafts this step (its SpeculationSwitch measures which mode commits faster)
        self.batch_drafts: Callable[[], bool] | None = None

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

    def curve_check(self, *results: GenerationResult) -> str | None:
        """One line when the target steps of `results` disagree in shape with the cost curve this decoder weighs
        (as its padded calls pay it); None otherwise (costs.curve_disagreement)."""
        costs = self.costs.padded_to(self.row_multiple) if self.costs and self.row_multiple > 1 else self.costs
        timed = [r for r in results if not r.sampled]
        return curve_disagreement(costs, [n for r in timed for n in r.verified],
                                  [ms for r in timed for ms in r.step_ms])

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
    ) -> Iterator[list[int]]:
        """An iterator over each step's committed tokens, whose return value (StopIteration.value) is the
        GenerationResult. The arguments are checked here, before anything runs. `verify`: how many drafted
        tokens each step verifies: auto (from the draft's confidence and the cost curve; full without a
        curve), full (the whole block, as the reference does) or a count."""
        prompt = self.check(prompt_ids, max_new_tokens, mode, sampling)
        target, draft = open_runners(self.manifest, self.target, self.draft, self.prefill_chunk,
                                     self.row_multiple)
        stops = frozenset(self.stop_token_ids if stop_token_ids is None else stop_token_ids)
        most_rows = self.manifest.verify_rows if mode == "dflash" else 1
        costs = self.costs.padded_to(self.row_multiple) if self.costs and self.row_multiple > 1 else self.costs
        sampling = sampling or SamplingParams()
        # measured step times steer only greedy requests, whose tokens no verified length can change: a seeded
        # sampled request draws the same tokens on every run (how many rows a step verifies decides which draws
        # it makes). A batched request's steps wait on the others': its share is priced by the curve alone.
        measured = self.measured \
            if self.measure_steps and sampling.greedy and self.batch_width is None and most_rows > 1 else None
        policy = VerifyPolicy(verify, costs, self.manifest.verify_rows,
                              self.calibrations.setdefault(not sampling.greedy, []), measured)
        return self._steps(target, draft, prompt, max_new_tokens, most_rows, sampling, stops, policy,
                           self.guesses(sampling))

    def _steps(self, target, draft, prompt: np.ndarray, max_new_tokens: int, most_rows: int,
               sampling: SamplingParams, stops: frozenset[int], policy: VerifyPolicy,
               guesses: bool) -> Iterator[list[int]]:
        """The decoding itself: prefill, then one draft + verify round per step. `most_rows`: the most tokens a
        verify takes (the anchor and every proposal; 1 for greedy). `guesses`: a step verifying only its anchor
        verifies a lookup guess in its padding row."""
        rng = np.random.default_rng(sampling.seed)
        mask_id = self.manifest.mask_token_id
        result = GenerationResult(prompt_tokens=int(prompt.size), sampled=not sampling.greedy)

        started = time.perf_counter()
        out = target.forward(prompt, logits_rows=0 if sampling.greedy else 1)
        target.commit(len(prompt))
        if sampling.greedy:
            first = int(out.greedy_ids[-1])
        else:
            first = int(sample_rows(sampling_probs(out.logits[-1], sampling), rng))
        result.tokens.append(first)
        result.ttft_s = time.perf_counter() - started
        yield [first]

        decode_started = time.perf_counter()
        consumer_s = 0.0  # time the caller spends between steps (printing a stream) is not decode time
        start = len(prompt)
        max_length = len(prompt) + max_new_tokens
        stopped = first in stops
        greedy = sampling.greedy
        # refilled each step, read only while a step runs: the draft's block [anchor, mask...] and the verified
        # tokens [anchor, proposals...]
        block = np.empty(self.manifest.block_size, dtype=np.int64)
        chain = np.empty(max(most_rows, 2), dtype=np.int64)
        lookup = NgramLookup([*prompt.tolist(), first]) if guesses else None
        # a DSpark draft draws its chain in the graph (one uniform per proposal) from softmax(logits / T)
        sampled_chain = next((int(t.shape[1]) for t in self.manifest.draft.inputs if t.name == "sample_uniform"), 0)
        chain_sampling = SamplingParams(temperature=sampling.temperature) if not greedy else None
        # the target's features of committed tokens the draft has not seen yet, joined only when the draft is called
        # (steps without a draft, a greedy request's all, would otherwise copy the whole backlog every step)
        pending = [out.context]
        priced, shares, drafted_before = 1, {}, False
        while start + 1 < max_length and not stopped:
            step_started = time.perf_counter()
            if self.batch_width is not None and self.costs is not None and (width := self.batch_width()) != priced:
                if width not in shares:
                    shares[width] = self.costs.shared_by(width, self.row_multiple)
                policy.reprice(shares[width])
                priced = width
            # drafted tokens a step could keep: up to a draft call's proposals, and no more than the tokens still
            # wanted besides the target's bonus token
            most = min(most_rows, max_length - start - 1) - 1
            block.fill(mask_id)
            block[0] = chain[0] = result.tokens[-1]
            drafted, confidence, ingested = 0, None, 0
            guess = lookup.guess() if lookup is not None else None
            policy.guessing = guess is not None and start + 2 < max_length  # a step without drafts would guess
            if policy.wants_draft(most if self.batch_drafts is None or self.batch_drafts() else 0):
                chained = None if greedy or not sampled_chain else (rng.random(sampled_chain), sampling.temperature)
                context = pending[0] if len(pending) == 1 else np.concatenate(pending)
                ingested = len(context)
                proposal = draft.propose(block, context, want_logits=not greedy, sample=chained)
                pending = []
                if greedy:
                    proposed, confidence = proposal.ids[:most], proposal.signals()
                elif chained is not None:  # DSpark: drawn in the graph, each bias after the draw before it; every
                    # confidence along that chain follows the draws before it, and a verified length chosen from
                    # them would make whether a draw is verified depend on the draw: the full block is verified
                    proposed, confidence = proposal.ids[:most], None
                    draft_probs = sampling_probs(proposal.logits[:most], chain_sampling)
                elif proposal.candidate_scores is not None:  # DFlash2: along its selector, each draw the next row
                    proposed, draft_probs = sample_selector_chain(proposal.candidates[:most],
                                                                  proposal.candidate_scores[:most],
                                                                  self.manifest.vocab_size, sampling, rng)
                    confidence = proposal.confidence  # the greedy chain's: the policy never reads the draws
                else:  # the policy reads the distributions, never the draws: rejection sampling stays exact
                    draft_probs = sampling_probs(proposal.logits[:most], sampling)
                    proposed, confidence = sample_rows(draft_probs, rng), draft_probs.max(axis=-1)
                drafted = policy.choose(confidence, most)
                chain[1 : drafted + 1] = proposed[:drafted]
            chosen = drafted  # the policy's choice: a lookup guess is not the draft's, and never calibrates it
            if policy.guessing and drafted == 0:
                chain[1], drafted = guess, 1
                result.guessed += 1
            verify = drafted + 1
            called = time.perf_counter()
            out = target.forward(chain[:verify], logits_rows=0 if greedy else verify)
            result.step_ms.append(1000 * (time.perf_counter() - called))
            if greedy:
                posterior = out.greedy_ids.tolist()
                accepted = _agreeing_prefix(chain[1:verify].tolist(), posterior) if drafted else 0
                bonus = posterior[accepted]
            else:
                target_probs = sampling_probs(out.logits, sampling)
                if drafted:
                    accepted, bonus = rejection_sample(chain[1:verify], target_probs, draft_probs[:drafted], rng)
                else:
                    accepted, bonus = 0, int(sample_rows(target_probs[-1], rng))
            if confidence is not None:
                policy.observe(chosen, min(accepted, chosen))
            if lookup is not None:  # whether or not it was verified: the policy weighs the steps that would guess
                policy.observe_guess(guess == (chain[1] if accepted else bonus))
                result.guessed_right += int(drafted > chosen and accepted > 0)
            new = [*chain[1 : accepted + 1].tolist(), bonus] if accepted else [bonus]
            for index, token in enumerate(new):
                if token in stops:
                    new, stopped = new[: index + 1], True
                    break
            start += len(new)
            target.commit(start)
            rows = out.context[: len(new)]
            pending.append(rows.copy())  # a session may hand out views of buffers its next call rewrites
            result.tokens.extend(new)
            if lookup is not None:
                lookup.extend(new)
            result.acceptance_lengths.append(len(new))
            result.verified.append(chosen)
            paused = time.perf_counter()
            if drafted_before or not ingested:  # a first draft call ingests the prompt: a request's cost, not a step's
                policy.observe_time(ingested, verify, result.step_ms[-1], 1000 * (paused - step_started), len(new))
            drafted_before = drafted_before or ingested > 0
            yield new
            consumer_s += time.perf_counter() - paused
        result.decode_s = time.perf_counter() - decode_started - consumer_s
        result.stopped = stopped
        return result

    def generate(
        self, prompt_ids: list[int] | np.ndarray, max_new_tokens: int = 64, mode: str = "dflash",
        sampling: SamplingParams | None = None, stop_token_ids: list[int] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None, verify: str | int = "auto",
    ) -> GenerationResult:
        """Run to the end; `on_tokens` sees each step's committed tokens as they are committed."""
        steps = self.stream(prompt_ids, max_new_tokens, mode, sampling, stop_token_ids, verify)
        while True:
            try:
                chunk = next(steps)
            except StopIteration as done:
                return done.value
            if on_tokens is not None:
                on_tokens(chunk)
