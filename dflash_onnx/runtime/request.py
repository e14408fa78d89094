"""One request's decoding, step by step: the state a request carries between steps (its runners, the tokens so
far, the target features the draft has not taken in yet, the verify policy) and one DFlash step over it: draft,
verify, commit. The Decoder (decode.py) makes one per request and times its steps. numpy only."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from dflash_onnx.runtime.errors import Cancelled
from dflash_onnx.runtime.lookup import NgramLookup
from dflash_onnx.runtime.manifest import CostModel
from dflash_onnx.runtime.policy import VerifyPolicy
from dflash_onnx.runtime.proposers import Proposer
from dflash_onnx.runtime.results import GenerationResult
from dflash_onnx.runtime.runners import DraftRunner, TargetRunner, TargetStep


class BatchShare(Protocol):
    """The batch a request decodes in beside others (runtime/batching.py's StepBatcher): how many requests share each
    step, so that the `auto` policy weighs this request's share of a batched step (CostModel.shared_by) rather than a
    call alone, and whether the batch drafts this step (its SpeculationSwitch measures which mode commits faster)."""

    @property
    def active(self) -> int: ...

    @property
    def drafting(self) -> bool: ...


def _stop_if(cancelled: Callable[[], bool]) -> None:
    if cancelled():
        raise Cancelled("the request was cancelled during its prefill")


DEPTH_STEPS = 4  # a request's curve is repriced each time its context grows by a quarter of an octave (19 %)


class StepPricing:
    """A request's verify policy repriced as the request goes: at its context's depth, where the curve was measured
    at several (CostModel.at_depth: a step's attention reads every cached row, so t(T) at 4K is not t(T) at 256),
    and, batched, at its share of each step as the batch widens and narrows (CostModel.shared_by). Each (width,
    depth step) is priced once; a depth step is priced at its shallow end."""

    def __init__(self, costs: CostModel, row_multiple: int, batch: BatchShare | None = None):
        self.costs, self.row_multiple, self.batch = costs, row_multiple, batch
        self.priced: tuple[int, int] | None = None
        self.curves: dict[tuple[int, int], CostModel] = {}

    def _depth_step(self, depth: int) -> int:
        return int(DEPTH_STEPS * math.log2(max(depth, 1))) if self.costs.deeper else 0  # per step: no numpy scalar

    def update(self, policy: VerifyPolicy, depth: int) -> None:
        """Reprice `policy` for a step after `depth` tokens of context, if its width or depth step changed."""
        key = (self.batch.active if self.batch is not None else 1, self._depth_step(depth))
        if key == self.priced:
            return
        if key not in self.curves:
            width, step = key
            curve = self.costs.at_depth(int(2 ** (step / DEPTH_STEPS))) if self.costs.deeper else self.costs
            self.curves[key] = curve.shared_by(width, self.row_multiple) if width > 1 \
                else curve.padded_to(self.row_multiple) if self.row_multiple > 1 else curve
        policy.reprice(self.curves[key])
        self.priced = key


class RequestDecoding:
    """A request between its steps. `most_rows`: the most tokens a verify takes (the anchor and every proposal; 1
    for greedy). `guesses`: a step verifying only its anchor verifies a prompt-lookup guess in its padding row."""

    def __init__(self, target: TargetRunner, draft: DraftRunner | None, prompt: np.ndarray, max_new_tokens: int,
                 block_size: int, mask_id: int, most_rows: int, proposer: Proposer, policy: VerifyPolicy,
                 stops: frozenset[int], guesses: bool, batch: BatchShare | None = None,
                 pricing: StepPricing | None = None):
        self.target, self.draft, self.prompt = target, draft, prompt
        self.proposer, self.policy, self.stops = proposer, policy, stops
        self.most_rows, self.mask_id, self.guesses = most_rows, mask_id, guesses
        self.batch, self.pricing = batch, pricing
        self.start, self.max_length = len(prompt), len(prompt) + max_new_tokens
        self.result = GenerationResult(prompt_tokens=int(prompt.size), sampled=not proposer.greedy)
        self.stopped = False
        # refilled each step, read only while a step runs: the draft's block [anchor, mask...] and the verified
        # tokens [anchor, proposals...]
        self.block = np.empty(block_size, dtype=np.int64)
        self.chain = np.empty(max(most_rows, 2), dtype=np.int64)
        # the target's features of committed tokens the draft has not seen yet, joined only when the draft is called
        # (steps without a draft, a greedy request's all, would otherwise copy the whole backlog every step)
        self.pending: list[np.ndarray] = []
        self.lookup: NgramLookup | None = None
        self.rows = self.ingested = 0  # the last step's verify rows and the context rows its draft call took in

    @property
    def unfinished(self) -> bool:
        """Whether another step is wanted: tokens left to generate and no stop token yet."""
        return self.start + 1 < self.max_length and not self.stopped

    def prefill(self, cancelled: Callable[[], bool] | None = None) -> int:
        """The prompt into the target's cache; the first new token. `cancelled`: asked between a long prompt's
        chunks; when it says so, Cancelled is raised there."""
        out = self.target.forward(self.prompt, logits_rows=self.proposer.logits_rows(1),
                                  between_chunks=None if cancelled is None else lambda: _stop_if(cancelled))
        self.target.commit(self.start)
        first = self.proposer.first(out)
        self.result.tokens.append(first)
        self.stopped = first in self.stops
        self.pending.append(out.context)
        if self.guesses:
            self.lookup = NgramLookup([*self.prompt.tolist(), first])
        return first

    def step(self) -> list[int]:
        """One draft + verify round; the tokens it commits (the verify call timed into the result's step_ms)."""
        if self.pricing is not None:
            self.pricing.update(self.policy, self.start)
        # drafted tokens a step could keep: up to a draft call's proposals, and no more than the tokens still wanted
        # besides the target's bonus token
        most = min(self.most_rows, self.max_length - self.start - 1) - 1
        self.block.fill(self.mask_id)
        self.block[0] = self.chain[0] = self.result.tokens[-1]
        guess = self.lookup.guess() if self.lookup is not None else None
        self.policy.guessing = guess is not None and self.start + 2 < self.max_length  # a step without drafts guesses
        chosen, confidence = self._draft(most)
        drafted = chosen  # the policy's choice: a lookup guess is not the draft's, and never calibrates it
        if self.policy.guessing and drafted == 0:
            self.chain[1], drafted = guess, 1
            self.result.guessed += 1
        self.rows = drafted + 1
        called = time.perf_counter()
        out = self.target.forward(self.chain[: self.rows], logits_rows=self.proposer.logits_rows(self.rows))
        self.result.step_ms.append(1000 * (time.perf_counter() - called))
        accepted, bonus = self.proposer.judge(self.chain, drafted, out)
        if confidence is not None:
            self.policy.observe(chosen, min(accepted, chosen))
        if self.lookup is not None:  # whether or not it was verified: the policy weighs the steps that would guess
            self.policy.observe_guess(guess == (self.chain[1] if accepted else bonus))
            self.result.guessed_right += int(drafted > chosen and accepted > 0)
        return self._commit(accepted, bonus, chosen, out)

    def _draft(self, most: int) -> tuple[int, np.ndarray | None]:
        """Call the draft where the policy wants it; how many of its proposals the step verifies (placed in the
        chain) and the confidences the choice read."""
        self.ingested = 0
        drafts = self.batch is None or self.batch.drafting
        if not self.policy.wants_draft(most if drafts else 0):
            return 0, None
        context = self.pending[0] if len(self.pending) == 1 else np.concatenate(self.pending)
        self.ingested, self.pending = len(context), []
        proposed, confidence = self.proposer.propose(self.draft, self.block, context, most)
        chosen = self.policy.choose(confidence, most)
        self.chain[1 : chosen + 1] = proposed[:chosen]
        return chosen, confidence

    def _commit(self, accepted: int, bonus: int, chosen: int, out: TargetStep) -> list[int]:
        """The accepted proposals and the bonus token, cut at a stop token, into the caches and the result."""
        new = [*self.chain[1 : accepted + 1].tolist(), bonus] if accepted else [bonus]
        for index, token in enumerate(new):
            if token in self.stops:
                new, self.stopped = new[: index + 1], True
                break
        self.start += len(new)
        self.target.commit(self.start)
        self.pending.append(out.context[: len(new)].copy())  # a session may hand out views its next call rewrites
        self.result.tokens.extend(new)
        if self.lookup is not None:
            self.lookup.extend(new)
        self.result.acceptance_lengths.append(len(new))
        self.result.verified.append(chosen)
        return new
