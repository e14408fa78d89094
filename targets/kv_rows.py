"""How many rows a session's K/V buffers hold: the buffer form's graphs leave the row count open, so the ORT
and MLX sessions size the buffers to the context in use and grow them as it does, up to the lowering's ctx_len
(at the Qwen3-4B shape, 4096 rows of float16 K/V are 0.6 GB whatever the prompt). No runtime imports."""

from __future__ import annotations

from dflash_onnx.runtime.errors import DFlashError

FIRST_ROWS = 256  # rows a buffer starts with; it doubles when a call needs more (one copy each time)
STEP_ROWS = 64  # the ragged attention's buffers grow (and shrink) in steps of these rows (rows_in_steps)


def rows_to_hold(needed: int, held: int, capacity: int, name: str) -> int:
    """The rows to grow a buffer of `held` rows to so that it holds `needed` (doubling, at most `capacity`)."""
    if needed > capacity:
        raise DFlashError(f"{name}: a context of {needed} rows exceeds the {capacity} rows this lowering holds: "
                          "lower again with a larger --ctx-len")
    return min(capacity, max(needed, 2 * held, FIRST_ROWS))


def rows_in_steps(needed: int, capacity: int, name: str) -> int:
    """The rows a buffer whose every call pays for all of its rows needs for `needed`: a multiple of STEP_ROWS
    (ONNX Attention on ORT's CPU reads the whole buffer whatever `nonpad_kv_seqlen` says: at the Qwen3-0.6B shape
    a 2-row step at 128 tokens of context took 23.6 ms over 256 rows and 35.1 ms over 1002, measured). More
    copies than doubling, one per STEP_ROWS tokens: at that shape about 15 MB per slot, against a 25 ms step."""
    rows_to_hold(needed, 0, capacity, name)  # the capacity check
    return min(capacity, max(STEP_ROWS, -(-needed // STEP_ROWS) * STEP_ROWS))
