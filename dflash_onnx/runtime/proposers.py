"""What a step drafts and how the target's verdict on it is read, one class per draft kind and sampling, chosen once
per request (`proposer_for`): greedy decoding reads the draft's greedy chain and keeps the longest agreeing prefix;
sampled decoding draws proposals from the draft's distributions (DFlash), along its candidate selector (DFlash2) or
in the graph (DSpark's chains) and keeps them by rejection sampling, so the output stays exactly the target's
distribution. numpy only."""

from __future__ import annotations

import numpy as np

from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.runtime.runners import SELECTOR_OUTPUTS, DraftRunner, TargetStep
from dflash_onnx.runtime.sampling import (
    SamplingParams,
    rejection_sample,
    sample_rows,
    sample_selector_chain,
    sampling_probs,
)


def agreeing_prefix(drafted: list[int], posterior: list[int]) -> int:
    """How many drafted tokens equal the target's greedy tokens before the first disagreement (plain Python: on a
    16-token block numpy's per-call cost is larger than the work)."""
    for index, (proposed, verified) in enumerate(zip(drafted, posterior)):
        if proposed != verified:
            return index
    return len(drafted)


class GreedyProposer:
    """Greedy decoding, every draft kind: the draft's greedy chain, its confidences for the verify policy (one or
    two signals), and the longest prefix the target's greedy ids agree with."""

    greedy = True

    def logits_rows(self, rows: int) -> int:
        """How many of a call's last rows the target returns logits for (greedy ids suffice here)."""
        return 0

    def first(self, out: TargetStep) -> int:
        """The token after the prompt."""
        return int(out.greedy_ids[-1])

    def propose(self, draft: DraftRunner, block: np.ndarray, context: np.ndarray,
                most: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The draft's first `most` proposals after taking in `context`, and what the policy may read of them (None:
        nothing, so the step verifies them all)."""
        proposal = draft.propose(block, context, want_logits=False)
        return proposal.ids[:most], proposal.signals()

    def judge(self, chain: np.ndarray, drafted: int, out: TargetStep) -> tuple[int, int]:
        """How many of the `drafted` tokens in chain[1:] the target keeps, and the token it adds after them."""
        posterior = out.greedy_ids.tolist()
        accepted = agreeing_prefix(chain[1 : drafted + 1].tolist(), posterior) if drafted else 0
        return accepted, posterior[accepted]


class SampledProposer:
    """Sampled decoding with a DFlash draft: proposals drawn from the draft's distributions (the policy reads the
    distributions' peaks, never the draws, so rejection sampling stays exact)."""

    greedy = False

    def __init__(self, sampling: SamplingParams, rng: np.random.Generator, vocab_size: int):
        self.sampling, self.rng, self.vocab_size = sampling, rng, vocab_size
        self.probs: np.ndarray | None = None  # the distributions the last proposals were drawn from

    def logits_rows(self, rows: int) -> int:
        return rows

    def first(self, out: TargetStep) -> int:
        return int(sample_rows(sampling_probs(out.logits[-1], self.sampling), self.rng))

    def propose(self, draft: DraftRunner, block: np.ndarray, context: np.ndarray,
                most: int) -> tuple[np.ndarray, np.ndarray | None]:
        proposal = draft.propose(block, context, want_logits=True)
        self.probs = sampling_probs(proposal.logits[:most], self.sampling)
        return sample_rows(self.probs, self.rng), self.probs.max(axis=-1)

    def judge(self, chain: np.ndarray, drafted: int, out: TargetStep) -> tuple[int, int]:
        target_probs = sampling_probs(out.logits, self.sampling)
        if not drafted:
            return 0, int(sample_rows(target_probs[-1], self.rng))
        return rejection_sample(chain[1 : drafted + 1], target_probs, self.probs[:drafted], self.rng)


class SelectorProposer(SampledProposer):
    """Sampled decoding with a DFlash2 draft: each draw made along its candidate selector, after the draw before it;
    the policy reads the greedy chain's confidences, never the draws."""

    def propose(self, draft: DraftRunner, block: np.ndarray, context: np.ndarray,
                most: int) -> tuple[np.ndarray, np.ndarray | None]:
        proposal = draft.propose(block, context, want_logits=True)
        proposed, self.probs = sample_selector_chain(proposal.candidates[:most], proposal.candidate_scores[:most],
                                                     self.vocab_size, self.sampling, self.rng)
        return proposed, proposal.confidence


class ChainProposer(SampledProposer):
    """Sampled decoding with a DSpark draft: its chain drawn in the graph (one uniform per proposal, each bias after
    the draw before it) from softmax(logits / T). Every confidence along that chain follows the draws before it, and
    a verified length chosen from them would make whether a draw is verified depend on the draw: the policy reads
    none, and the step verifies the full block."""

    def __init__(self, sampling: SamplingParams, rng: np.random.Generator, vocab_size: int, uniforms: int):
        super().__init__(sampling, rng, vocab_size)
        self.uniforms = uniforms
        self.chain_sampling = SamplingParams(temperature=sampling.temperature)

    def propose(self, draft: DraftRunner, block: np.ndarray, context: np.ndarray,
                most: int) -> tuple[np.ndarray, np.ndarray | None]:
        chained = (self.rng.random(self.uniforms), self.sampling.temperature)
        proposal = draft.propose(block, context, want_logits=True, sample=chained)
        self.probs = sampling_probs(proposal.logits[:most], self.chain_sampling)
        return proposal.ids[:most], None


Proposer = GreedyProposer | SampledProposer


def proposer_for(manifest: Manifest, sampling: SamplingParams, rng: np.random.Generator) -> Proposer:
    """The proposer for a request: greedy for greedy decoding, else by what the draft graph draws with."""
    if sampling.greedy:
        return GreedyProposer()
    uniforms = next((int(t.shape[1]) for t in manifest.draft.inputs if t.name == "sample_uniform"), 0)
    if uniforms:
        return ChainProposer(sampling, rng, manifest.vocab_size, uniforms)
    if SELECTOR_OUTPUTS[-1] in manifest.draft.output_names():
        return SelectorProposer(sampling, rng, manifest.vocab_size)
    return SampledProposer(sampling, rng, manifest.vocab_size)
