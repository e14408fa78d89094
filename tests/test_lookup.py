"""The padding row's lookup guess: right guesses commit two tokens a step, tokens stay greedy's (stops included),
and it is used only where the padding row is paid anyway."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.lookup import NgramLookup
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.targets import open_decoder


def test_the_guess_is_what_followed_the_longest_ngram_seen_before():
    lookup = NgramLookup([4, 5, 6, 9, 5, 7, 4, 5])
    assert lookup.guess() == 6  # (4, 5) was followed by 6; the unigram 5 last by 7
    lookup.extend([8])
    assert lookup.guess() is None  # 8 is new
    lookup.extend([5])
    assert lookup.guess() == 8  # (8, 5) unseen: 5 was followed last by 8
    assert NgramLookup([]).guess() is None and NgramLookup([3]).guess() is None


def _padded(directory, **manifest_changes) -> Decoder:
    """The lowering with its calls padded to 2 rows (as a CPU lowering measures it; always exact)."""
    opened = open_decoder(directory)
    manifest = replace(opened.manifest, lowering=replace(opened.manifest.lowering, row_multiple=2), **manifest_changes)
    return Decoder(manifest, opened.target, opened.draft)


def test_right_guesses_commit_two_tokens_and_the_tokens_stay_greedys(ort_lowered, decoders):
    decoder = _padded(ort_lowered("agree_b8"))
    assert decoder.guesses(SamplingParams())
    rng = np.random.default_rng(5)
    for _ in range(3):
        prompt = rng.integers(2, 94, size=int(rng.integers(2, 12))).tolist()
        want = decoders("agree_b8").generate(prompt, 40, "greedy", stop_token_ids=[]).tokens
        guessed = decoder.generate(prompt, 40, "greedy", stop_token_ids=[])
        plain = decoder.sharing(guess_padding=False).generate(prompt, 40, "greedy", stop_token_ids=[])
        assert guessed.tokens == plain.tokens == want
        assert set(plain.acceptance_lengths) == {1} and 2 in guessed.acceptance_lengths
        assert len(guessed.acceptance_lengths) < len(plain.acceptance_lengths)
        for stop in sorted(set(want)):  # a stop token first or second in a guessed step ends there, as greedy's
            cut = want[: want.index(stop) + 1]
            assert decoder.generate(prompt, 40, "greedy", stop_token_ids=[stop]).tokens == cut
        assert decoder.generate(prompt, 40, "dflash", stop_token_ids=[]).tokens == want


def test_no_guess_where_the_padding_row_is_not_free(ort_lowered):
    decoder = _padded(ort_lowered("agree_b8"))
    assert not decoder.guesses(SamplingParams(temperature=0.7))  # sampling: a one-hot guess is not drawn here
    unpadded = open_decoder(ort_lowered("agree_b8"), batch_invariant=False)
    assert not unpadded.guesses(SamplingParams())  # no padding row to fill
    experts = _padded(ort_lowered("agree_b8"), experts={"layers": [0], "experts": 4, "per_token": 1})
    assert not experts.guesses(SamplingParams())  # a padding row skips the experts; a guess would pay them
