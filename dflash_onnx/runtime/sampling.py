"""Numpy sampling: temperature / top-k / top-p distributions and DFlash's rejection sampling.

Follows the reference `dflash` package (its _sampling_probs and _rejection_sample), so that sampled
DFlash output has exactly the target's distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dflash_onnx.runtime.errors import DFlashError


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each token; the defaults decode greedily.

    Args:
        temperature: 0 decodes greedily (the target's argmax); above 0 samples from softmax(logits / temperature).
        top_p: keep the most likely tokens whose probabilities add up to top_p (1: all).
        top_k: keep the k most likely tokens (0: all).
        seed: the random generator's seed; the same seed draws the same tokens on every run.

    Raises:
        DFlashError: a negative or non-finite temperature, top_p outside (0, 1], a negative top_k.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DFlashError(f"--temperature must be 0 (greedy) or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise DFlashError(f"--top-p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DFlashError(f"--top-k must be 0 (no top-k) or more, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """Whether these settings decode greedily."""
        return self.temperature <= 0


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities over the vocab (last axis) after temperature, top-k, then top-p."""
    scores = logits.astype(np.float64) / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:  # exactly k survivors, ties included, as torch.topk keeps
        top = np.argpartition(-scores, params.top_k - 1, axis=-1)[..., : params.top_k]
        kept = np.full_like(scores, -np.inf)
        np.put_along_axis(kept, top, np.take_along_axis(scores, top, axis=-1), axis=-1)
        scores = kept
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        keep = np.cumsum(sorted_probs, axis=-1) - sorted_probs < params.top_p
        kept = np.zeros_like(probs)
        np.put_along_axis(kept, order, sorted_probs * keep, axis=-1)
        probs = kept / kept.sum(axis=-1, keepdims=True)
    return probs


def sample_rows(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of `probs` [..., vocab] by inverse CDF."""
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = np.cumsum(flat, axis=-1)
    u = rng.random(flat.shape[0]) * cdf[:, -1]
    picks = np.minimum((cdf < u[:, None]).sum(axis=-1), flat.shape[-1] - 1)
    return picks.reshape(probs.shape[:-1])


def sample_selector_chain(candidates: np.ndarray, scores: np.ndarray, vocab: int, params: SamplingParams,
                          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """DFlash2's proposals sampled along its selector: position j's distribution is over its candidates
    [P, k], scored after the candidate sampled at j - 1 (`scores` [P, k, k]: row i follows candidate i of the
    position before; position 0's rows all follow the anchor), through temperature, top-k and top-p. Returns the
    tokens [P] and each position's distribution over the vocabulary [P, V] (zero outside its candidates), which
    rejection sampling needs."""
    tokens, rows, row = [], [], 0
    for position in range(len(candidates)):
        logits = np.full(vocab, -np.inf)
        logits[candidates[position]] = scores[position, row]
        probs = sampling_probs(logits, params)
        token = int(sample_rows(probs, rng))
        row = int(np.flatnonzero(candidates[position] == token)[0])
        tokens.append(token)
        rows.append(probs)
    return np.asarray(tokens, np.int64), np.asarray(rows)


def rejection_sample(
    draft_tokens: np.ndarray, target_probs: np.ndarray, draft_probs: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """Accept a prefix of `draft_tokens` [g] against target_probs [g+1, V] and draft_probs [g, V].

    Returns (accepted, next_token): the bonus from the target after a full acceptance, else a
    resample from the residual max(0, p - q) at the first rejection.
    """
    gamma = len(draft_tokens)
    rows = np.arange(gamma)
    p = target_probs[rows, draft_tokens]
    q = draft_probs[rows, draft_tokens]
    accept = rng.random(gamma) * q < p
    accepted = int(np.cumprod(accept).sum())
    if accepted == gamma:
        return accepted, int(sample_rows(target_probs[gamma], rng))
    residual = np.clip(target_probs[accepted] - draft_probs[accepted], 0.0, None)
    total = residual.sum()
    residual = residual / total if total > 0 else target_probs[accepted]
    return accepted, int(sample_rows(residual, rng))
