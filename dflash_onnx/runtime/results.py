"""What a request's decoding returns: its tokens and the reference's metrics. numpy only."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationResult:
    """Generated ids (a stop token included when one ended generation) and the reference's metrics.

    Attributes:
        tokens: the new token ids, the first one (from the prefill) included.
        acceptance_lengths: tokens committed by each verify step (the first token apart).
        verified: drafted tokens each step verified (0: no draft call).
        step_ms: each step's target call, in milliseconds (costs.curve_disagreement compares them with the curve).
        guessed, guessed_right: steps whose padding row carried a lookup guess (lookup.py), and those whose guess
            the target agreed with.
        sampled: sampled decoding (its target calls also return logits, which the cost curve does not time).
        prompt_tokens: the prompt's length.
        ttft_s: the prefill and first token, in seconds.
        decode_s: the steps after it, in seconds (time the caller spent between steps excluded).
        stopped: a stop token ended generation.
    """

    tokens: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    guessed: int = 0
    guessed_right: int = 0
    sampled: bool = False
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
        """Output tokens over prefill and decode time together."""
        total = self.ttft_s + self.decode_s
        return len(self.tokens) / total if total > 0 else 0.0

    def acceptance_histogram(self, block_size: int) -> list[int]:
        """Counts of steps that committed 1..block_size tokens."""
        counts = np.bincount(np.asarray(self.acceptance_lengths, dtype=np.int64), minlength=block_size + 1)
        return counts[1 : block_size + 1].tolist()


def run_summary(result: GenerationResult, mode: str) -> str:
    """The line after a run, honest about short ones: a rate needs two tokens (the first one's time is the
    time to first token, not decoding), and tau means something only where DFlash verified a draft."""
    count = len(result.tokens)
    parts = [f"{count} token{'s' if count != 1 else ''}"]
    if mode == "dflash":
        parts.append(f"tau {result.tau:.2f}" if result.acceptance_lengths else "tau - (no DFlash step ran)")
    parts.append(f"{result.tokens_per_second:.1f} tok/s" if count >= 2 and result.decode_s > 0 else
                 "tok/s - (too few tokens to time decoding)")
    parts.append(f"ttft {result.ttft_s * 1000:.1f} ms")
    return ", ".join(parts)
