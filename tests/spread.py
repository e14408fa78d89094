"""How much a pair's greedy output depends on its prompt: an equality test whose expected outputs are the same for
every prompt, or unchanged when the prompt is cut to its last token, would pass with requests' K/V mixed, positions
wrong or a window too wide. `assert_discriminating` makes such a test fail loudly instead."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dflash_onnx.runtime.decode import Decoder


@dataclass
class Spread:
    prompts: int
    distinct: int  # different outputs among the prompts'
    top_share: float  # the most common token's share of all output tokens
    cut_unchanged: int  # prompts whose output stays the same when the prompt is cut to its last token

    def row(self) -> str:
        return (f"{self.distinct}/{self.prompts} distinct, top token {self.top_share:.0%}, "
                f"unchanged when cut {self.cut_unchanged}/{self.prompts}")


def varied_prompts(vocab: int, count: int, seed: int, shortest: int = 4, longest: int = 40) -> list[list[int]]:
    """Random prompts over the vocabulary but its two special ids at each end (pad/eos and the mask)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab - 1, int(rng.integers(shortest, longest))).tolist() for _ in range(count)]


def spread(outputs: Sequence[list[int]], cut_outputs: Sequence[list[int]] | None = None) -> Spread:
    tokens = Counter(t for output in outputs for t in output)
    cut = sum(a == b for a, b in zip(outputs, cut_outputs)) if cut_outputs is not None else 0
    return Spread(len(outputs), len({tuple(o) for o in outputs}), max(tokens.values()) / sum(tokens.values()), cut)


def assert_discriminating(prompts: Sequence[list[int]], outputs: Sequence[list[int]],
                          greedy: Callable[[list[int]], list[int]] | None = None) -> Spread:
    """The expected outputs of an equality test tell its prompts apart: they differ across prompts (no two prompts
    in three alike) and, where `greedy` decodes a prompt, change for most prompts when the prompt is cut to its last
    token. Returns the spread it measured."""
    cut = [greedy(p[-1:]) for p in prompts] if greedy is not None else None
    measured = spread(outputs, cut)
    assert measured.distinct >= max(2, (2 * len(prompts) + 2) // 3), \
        f"the expected outputs hardly differ across prompts ({measured.row()}): this test cannot tell requests apart"
    assert measured.cut_unchanged <= len(prompts) // 4, \
        f"cutting the prompts leaves the expected outputs unchanged ({measured.row()}): context is not tested"
    return measured


def varied_prompt_file(path, decoder, count: int = 3, seed: int = 8, new_tokens: int = 16) -> list[list[int]]:
    """`count` varied prompts written to `path` as the JSONL `bench --prompts` reads ({"ids": [...]}) for a peer's
    equality test, checked first to tell the prompts apart under `decoder`'s greedy decoding (bench runs on
    without stopping, so the check does too)."""
    import json

    prompts = varied_prompts(decoder.manifest.vocab_size, count, seed=seed, shortest=6, longest=24)

    def greedy(prompt: list[int]) -> list[int]:
        return decoder.generate(prompt, new_tokens, "greedy", stop_token_ids=[]).tokens

    assert_discriminating(prompts, [greedy(p) for p in prompts], greedy)
    path.write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    return prompts


def discriminating_outputs(prompts: Sequence[list[int]], greedy: Callable[[list[int]], list[int]]) -> list[list[int]]:
    """`greedy`'s outputs for `prompts`, an equality test's expected outputs, checked first to tell the prompts
    apart (assert_discriminating)."""
    outputs = [greedy(prompt) for prompt in prompts]
    assert_discriminating(prompts, outputs, greedy)
    return outputs


def greedy_tokens(decoder: Decoder, new_tokens: int) -> Callable[[list[int]], list[int]]:
    """prompt -> `decoder`'s greedy tokens, `new_tokens` of them (no stop token ends them early)."""
    return lambda prompt: decoder.generate(prompt, new_tokens, "greedy", stop_token_ids=[]).tokens


def assert_accepted_in_part(acceptance_lengths: Sequence[int], block_size: int) -> float:
    """A DFlash equality test's drafts are right at some positions and wrong at others: a draft never accepted
    (every step commits one token) or always accepted whole would leave the partial commit and its rollback
    untested. Returns tau, the mean committed per step."""
    assert any(length > 1 for length in acceptance_lengths), \
        f"no drafted token was ever accepted ({acceptance_lengths}): the rollback of a partial block is not tested"
    assert any(length < block_size for length in acceptance_lengths), \
        f"every block was accepted whole ({acceptance_lengths}): rejection is not tested"
    return sum(acceptance_lengths) / len(acceptance_lengths)


def assert_decodes(decoder: Decoder, prompts: Sequence[list[int]], outputs: Sequence[list[int]],
                   new_tokens: int) -> float:
    """`decoder`'s greedy and DFlash tokens (every drafted token verified) are `outputs` for `prompts`, its drafts
    accepted in part (assert_accepted_in_part); returns tau."""
    accepted = []
    for prompt, want in zip(prompts, outputs):
        assert decoder.generate(prompt, new_tokens, "greedy", stop_token_ids=[]).tokens == want, prompt
        result = decoder.generate(prompt, new_tokens, "dflash", stop_token_ids=[], verify="full")
        assert result.tokens == want, prompt
        accepted += result.acceptance_lengths
    return assert_accepted_in_part(accepted, decoder.manifest.block_size)
