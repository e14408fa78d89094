"""How many rows a session's K/V buffers hold: the buffer form's graphs leave the row count open, so the ORT
and MLX sessions size the buffers to the context in use and grow them as it does, up to the lowering's ctx_len
(at the Qwen3-4B shape, 4096 rows of float16 K/V are 0.6 GB whatever the prompt). No runtime imports."""

from __future__ import annotations

from runtime.errors import DFlashError

FIRST_ROWS = 256  # rows a buffer starts with; it doubles when a call needs more (one copy each time)


def rows_to_hold(needed: int, held: int, capacity: int, name: str) -> int:
    """The rows to grow a buffer of `held` rows to so that it holds `needed` (doubling, at most `capacity`)."""
    if needed > capacity:
        raise DFlashError(f"{name}: a context of {needed} rows exceeds the {capacity} rows this lowering holds: "
                          "lower again with a larger --ctx-len")
    return min(capacity, max(needed, 2 * held, FIRST_ROWS))
