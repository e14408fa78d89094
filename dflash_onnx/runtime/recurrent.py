"""A hybrid target's linear-attention state on the host: what each call feeds, and what a commit keeps.

Per Gated-DeltaNet layer the graph reads the last `conv_rows` committed convolution inputs, the recurrent state
and the pending rows (decay, key, delta of committed tokens not yet in that state), and returns the conv rows
past + new, the state with the pending rows applied, the state after all of its own tokens, and its own tokens'
rows (dflash_onnx/exporter/models/linear_attention.py). Committing n of a call's T rows keeps the conv rows [n, n +
conv_rows),
and either the state after all tokens (n == T) or the state before them with the first n rows pending. So a
rejected token never reaches the state, and the state after a token is computed by the same operations in any
call: greedy and DFlash stay identical.
"""

from __future__ import annotations

import numpy as np

from dflash_onnx.runtime.manifest import RecurrentSpec

PENDING = ("decay", "key", "delta")


def input_names(layer: int) -> list[str]:
    """A linear-attention layer's state inputs, in graph order."""
    return [f"past_state.{layer}.conv", f"past_state.{layer}.recurrent", *(f"pending.{layer}.{p}" for p in PENDING)]


def output_names(layer: int) -> list[str]:
    """A linear-attention layer's state outputs, in graph order."""
    return [f"present_state.{layer}.conv", f"present_state.{layer}.recurrent", f"present_state.{layer}.recurrent_end",
            *(f"present_pending.{layer}.{p}" for p in PENDING)]


def empty_inputs(spec: RecurrentSpec, conv_dtype, batch: int = 1) -> dict[str, np.ndarray]:
    """Every layer's state before the first token: zeros, and no pending rows."""
    state = np.dtype(spec.state_dtype)
    feeds = {}
    for layer in spec.layers:
        conv, recurrent, decay, key, delta = input_names(layer)
        feeds[conv] = np.zeros((batch, spec.conv_rows, spec.conv_channels), conv_dtype)
        feeds[recurrent] = np.zeros((batch, spec.heads, spec.key_dim, spec.value_dim), state)
        feeds[decay] = np.zeros((batch, 0, spec.heads), state)
        feeds[key] = np.zeros((batch, 0, spec.heads, spec.key_dim), state)
        feeds[delta] = np.zeros((batch, 0, spec.heads, spec.value_dim), state)
    return feeds


class RecurrentState:
    """The feeds of the next call, and the outputs of the last one until `commit` says how many rows it keeps."""

    def __init__(self, spec: RecurrentSpec, conv_dtype):
        self.spec = spec
        self.feeds = empty_inputs(spec, conv_dtype)
        self.outputs = [name for layer in spec.layers for name in output_names(layer)]
        self.last: dict[str, np.ndarray] | None = None
        self.last_start = self.last_rows = 0

    def record(self, outputs: dict[str, np.ndarray], start: int, rows: int) -> None:
        """Keep the state outputs of a call whose rows (`rows`, padding included) began at position `start`, until
        its commit."""
        self.last, self.last_start, self.last_rows = outputs, start, rows

    def commit(self, length: int) -> None:
        """Keep the last call's rows before position `length` (idempotent until the next call is recorded)."""
        if self.last is None:
            return
        rows = length - self.last_start
        if not 0 <= rows <= self.last_rows:
            raise ValueError(f"cannot commit to length {length}: the last call ran positions {self.last_start}.."
                             f"{self.last_start + self.last_rows - 1}")
        # the state after all of the call's rows, where the call returned it for them (a batched call whose rows
        # were padded beyond this request's does not: its pending rows are kept instead)
        out = self.last
        whole = rows == self.last_rows and all(output_names(layer)[2] in out for layer in self.spec.layers)
        for layer in self.spec.layers:
            conv, recurrent, end, *pending = output_names(layer)
            conv_in, recurrent_in, *pending_in = input_names(layer)
            self.feeds[conv_in] = out[conv][:, rows : rows + self.spec.conv_rows]
            self.feeds[recurrent_in] = out[end if whole else recurrent]
            for name, given in zip(pending_in, pending):
                self.feeds[name] = out[given][:, :0 if whole else rows]


def is_state_name(name: str) -> bool:
    """An input or output of the linear-attention state (input_names / output_names)."""
    return name.startswith(("past_state.", "pending.", "present_state.", "present_pending."))


def join_feeds(per_slot: list[dict[str, np.ndarray] | None], names: list[str]) -> dict[str, np.ndarray]:
    """The state inputs of several requests' calls as one batched call's, a request per batch row: pending rows
    padded to the longest with neutral rows (decay 1, key and delta 0: the state unchanged, exactly, as the graph's
    own first row); a row without a call of its own (None: a placeholder) gets a zero state and only neutral rows."""
    model = next(feeds for feeds in per_slot if feeds is not None)
    joined = {}
    for name in names:
        pending = name.startswith("pending.")
        longest = max((feeds[name].shape[1] for feeds in per_slot if feeds is not None), default=0) if pending else 0
        fill = 1.0 if name.endswith(".decay") else 0.0
        shape = (len(per_slot), longest, *model[name].shape[2:]) if pending else (len(per_slot), *model[name].shape[1:])
        array = np.full(shape, fill, model[name].dtype) if pending else np.zeros(shape, model[name].dtype)
        for row, feeds in enumerate(per_slot):
            if feeds is not None:
                given = feeds[name][0]
                array[row, : len(given)] = given
        joined[name] = array
    return joined


def slot_outputs(outputs: dict[str, np.ndarray], row: int, rows: int, batch_rows: int) -> dict[str, np.ndarray]:
    """One request's state outputs from a batched call that padded its `rows` rows to `batch_rows`: the conv rows
    past + its own, the state after its pending rows, its own tokens' rows; the state after all of the call's rows
    only where no padding of the batch's followed its rows (otherwise that state is not its own)."""
    own = {}
    for name, value in outputs.items():
        if name.endswith(".recurrent_end"):
            if rows == batch_rows:
                own[name] = value[row : row + 1]
        elif name.endswith(".recurrent"):
            own[name] = value[row : row + 1]
        elif name.endswith(".conv"):
            own[name] = value[row : row + 1, : value.shape[1] - (batch_rows - rows)]
        else:  # present_pending.*: a row per token
            own[name] = value[row : row + 1, :rows]
    return own
