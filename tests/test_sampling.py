"""Sampling is lossless in distribution: rejection sampling and DFlash-ORT sampling vs the target."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import dflash_model  # skips the module when the oracle is missing
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.sampling import (
    SamplingParams,
    rejection_sample,
    sample_rows,
    sample_selector_chain,
    sampling_probs,
)


def _chi_square_p(samples: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square p-value with bins of small expectation merged into one."""
    counts = np.bincount(samples, minlength=len(expected_probs)).astype(float)
    expected = expected_probs * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.8, 0.8, 10)])
def test_sampling_probs_match_reference(temperature, top_p, top_k):
    logits = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32) * 3
    ours = sampling_probs(logits, SamplingParams(temperature, top_p, top_k))
    want = dflash_model._sampling_probs(torch.tensor(logits), temperature, top_p, top_k).numpy()
    np.testing.assert_allclose(ours, want, atol=1e-6)


def test_top_k_keeps_exactly_k_tokens_when_scores_tie():
    logits = np.array([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]], dtype=np.float32)
    ours = sampling_probs(logits, SamplingParams(1.0, 1.0, 2))
    assert np.count_nonzero(ours) == 2
    want = dflash_model._sampling_probs(torch.tensor(logits), 1.0, 1.0, 2).numpy()
    np.testing.assert_allclose(np.sort(ours[0]), np.sort(want[0]), atol=1e-6)


def test_rejection_sampling_output_follows_target_distribution():
    rng = np.random.default_rng(1)
    vocab = 6
    target = rng.dirichlet(np.ones(vocab), size=3)
    draft = rng.dirichlet(np.ones(vocab), size=2)
    firsts, accepted_counts = [], []
    for _ in range(20000):
        proposal = sample_rows(draft, rng)
        accepted, bonus = rejection_sample(proposal, target, draft, rng)
        firsts.append(proposal[0] if accepted >= 1 else bonus)
        accepted_counts.append(accepted)
    assert _chi_square_p(np.array(firsts), target[0]) > 1e-3
    assert 0 < np.mean(accepted_counts) < 2  # both acceptance and rejection paths ran


def test_dflash2_selector_chain_samples_each_position_after_the_drawn_one():
    """Position 1's distribution is the lattice row of the candidate drawn at position 0 (z-lab's selector
    sampling), zero outside its candidates; the pairs drawn follow the chained distribution, and the second
    token through rejection sampling still has the target's distribution."""
    rng = np.random.default_rng(4)
    vocab, params = 8, SamplingParams(temperature=0.9)
    candidates = np.array([[1, 4, 6], [2, 4, 7]])
    scores = rng.normal(size=(2, 3, 3)) * 1.5
    scores[0] = scores[0, 0]  # position 0's rows all follow the anchor
    first = sampling_probs(np.where(np.isin(np.arange(vocab), candidates[0]), 0.0, -np.inf) +
                           np.bincount(candidates[0], scores[0, 0], vocab), params)
    pairs, seconds = [], []
    target = rng.dirichlet(np.ones(vocab), size=3)
    for _ in range(6000):
        tokens, probs = sample_selector_chain(candidates, scores, vocab, params, rng)
        row = int(np.flatnonzero(candidates[0] == tokens[0])[0])
        want = np.zeros(vocab)
        want[candidates[1]] = np.exp(scores[1, row] / 0.9) / np.exp(scores[1, row] / 0.9).sum()
        np.testing.assert_allclose(probs[1], want, atol=1e-12)
        np.testing.assert_allclose(probs[0], first, atol=1e-12)
        pairs.append(3 * row + int(np.flatnonzero(candidates[1] == tokens[1])[0]))
        accepted, bonus = rejection_sample(tokens, target, probs, rng)
        if accepted >= 1:
            seconds.append(tokens[1] if accepted >= 2 else bonus)
    chained = np.concatenate([first[candidates[0][i]] * np.exp(scores[1, i] / 0.9) / np.exp(scores[1, i] / 0.9).sum()
                              for i in range(3)])
    assert _chi_square_p(np.array(pairs), chained) > 1e-3
    assert _chi_square_p(np.array(seconds), target[1]) > 1e-3


def test_dflash_ort_sampling_matches_target_distribution(exported, decoders):
    """The second generated token (drafted, then accepted or resampled) has the target's marginal."""
    pair, decoder = exported("agree_b8"), decoders("agree_b8")
    prompt = [11, 12, 13]
    params = SamplingParams(temperature=1.0, seed=123)
    target = AutoModelForCausalLM.from_pretrained(str(pair.target_dir)).eval()
    vocab = pair.spec.vocab_size
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
        batch = torch.cat([torch.tensor([prompt] * vocab), torch.arange(vocab)[:, None]], dim=1)
        second = torch.softmax(target(batch).logits[:, -1].double(), -1)
    marginal = (first[:, None] * second).sum(0).numpy()
    seconds = []
    accepted = 0
    for _ in range(2500):
        result = decoder.generate(prompt, 2, "dflash", params, stop_token_ids=[])
        seconds.append(result.tokens[1])
        params = SamplingParams(temperature=1.0, seed=params.seed + 1)
    assert _chi_square_p(np.array(seconds), marginal / marginal.sum()) > 1e-3
    for seed in range(50):  # the draft is accepted sometimes, so both paths of the sampler ran
        run = decoder.generate([11, 12, 13], 8, "dflash", SamplingParams(1.0, seed=seed), stop_token_ids=[])
        accepted += sum(length > 1 for length in run.acceptance_lengths)
    assert accepted > 0


def test_invalid_sampling_parameters():
    with pytest.raises(DFlashError):
        SamplingParams(temperature=-1)
    with pytest.raises(DFlashError):
        SamplingParams(temperature=1, top_p=0)
