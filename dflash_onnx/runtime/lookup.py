"""A free guess for the padding row: the token that followed the latest earlier occurrence of the last two tokens
(else of the last one) in the prompt and output so far: prompt-lookup decoding's guess, from the latest match
(transformers' `prompt_lookup_num_tokens` takes the earliest).

A batch-invariant lowering pads a one-token target call to its row multiple, so a greedy step already pays for a
second row; carrying this guess there instead of a copy of the last row verifies it for nothing, and a right guess
commits two tokens in one step. The guess is verified like any drafted token, so the tokens stay greedy's."""

from __future__ import annotations

from collections import deque


class NgramLookup:
    """Kept incrementally: a dict per n-gram length from the n tokens to the token that followed them last, O(1)
    per token."""

    def __init__(self, tokens: list[int], longest: int = 2):
        self._longest = longest
        self._follows: list[dict[tuple[int, ...], int]] = [{} for _ in range(longest)]
        self._recent: deque[int] = deque(maxlen=longest + 1)
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._recent.append(int(token))
            recent = tuple(self._recent)
            for n in range(1, min(self._longest, len(recent) - 1) + 1):
                self._follows[n - 1][recent[-n - 1 : -1]] = recent[-1]

    def guess(self) -> int | None:
        """The next token by the longest n-gram seen before; None when even the last token is new."""
        recent = tuple(self._recent)
        for n in range(min(self._longest, len(recent)), 0, -1):
            found = self._follows[n - 1].get(recent[-n:])
            if found is not None:
                return found
        return None
