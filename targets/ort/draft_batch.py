"""The ragged lowering's draft, one call a step for every request that drafts (dflash_onnx/runtime/batching.py).

Each slot (batch row, as in the target's store) keeps its request's context rows K/V on the host, in
[slots, rows, kv_heads, head_dim] arrays per layer whose row count follows the longest context in use, in steps
(targets/kv_rows.rows_in_steps). A step's draft calls become one call: the slots' block of each array is the
past (a view when the slots are consecutive, the usual case), each request's new context rows padded to the
call's longest, and the graph's key mask (passes/draft_attention.py, key_mask=1) told how many past and new rows
are each request's own, so that no request attends to another's rows or to padding. The new rows the graph
returns are written into each slot after its past. Host arrays fed as they are: the CPU provider only
(`batched_drafts_refusal` turns the others away; their requests keep a draft session each).

A request's proposal beside others is the same as alone up to float rounding (its keys are summed over a longer,
masked row): greedy tokens do not depend on it (the target verifies every proposal), and sampled requests keep
their own draft session (dflash_onnx/runtime/batching.BatchParts.draft_for), so that their draws are the same as alone.
"""

from __future__ import annotations

import numpy as np

from dflash_onnx.runtime.feeds import KEY_MASK_INPUTS
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.kv_rows import STEP_ROWS, rows_in_steps
from dflash_onnx.targets.ort.session import OrtRowsSession, run_plain

DRAFT_INPUTS = {"input_ids", "target_hidden", "position_ids"}


def batched_drafts_refusal(manifest: Manifest, draft: object) -> str | None:
    """Why this directory's requests cannot share one draft call a step (None: they can)."""
    lowering = manifest.lowering
    masked = lowering.rewrites.get("draft-attention", {}).get("draft", {}).get("key_mask") if lowering else None
    if masked is None:
        return ("its draft's attention takes no key mask (not a ragged lowering, or one made before batched drafts): "
                "lower again with --kv-attention ragged")
    if not masked:
        return ("its draft's attention has a mask of its own (a causal or windowed draft) or no ONNX Attention to "
                "take the key mask: each request drafts on its own")
    if lowering.provider != "cpu":
        return f"batched drafts keep their context rows on the host: the CPU provider only, not {lowering.provider}"
    if not isinstance(draft, OrtRowsSession):
        return f"batched drafts need the rows-form draft session, not {type(draft).__name__}"
    other = sorted({t.name for t in manifest.draft.inputs} - DRAFT_INPUTS - set(manifest.draft.kv_inputs)
                   - set(KEY_MASK_INPUTS))
    if other:
        return f"its draft takes inputs {other} per request (a sampled chain): each request drafts on its own"
    return None


class OrtDraftBatch:
    """Context rows for `slots` requests over the single-request draft session's ONNX Runtime session."""

    def __init__(self, single: OrtRowsSession, manifest: Manifest, slots: int):
        self._session, self.path = single._session, single.path
        self.input_names, self.output_names = single.input_names, single.output_names
        self._graph, self._dtype = manifest.draft, manifest.numpy_dtype
        self.capacity, self.slots, self._rows = int(manifest.ctx_len), slots, 0
        self._pairs = list(zip(self._graph.kv_inputs, self._graph.kv_outputs))
        self._buffers = {past: np.zeros((slots, 0, *self._graph.kv_shape(past)), self._dtype)
                         for past, _ in self._pairs}

    def _resize(self, rows: int) -> None:
        kept = min(rows, self._rows)
        for past, buffer in self._buffers.items():
            resized = np.zeros((self.slots, rows, *buffer.shape[2:]), self._dtype)
            resized[:, :kept] = buffer[:, :kept]
            self._buffers[past] = resized
        self._rows = rows

    def move_slot(self, source: int, dest: int) -> None:
        for buffer in self._buffers.values():
            buffer[dest] = buffer[source]

    def kv_buffers(self) -> dict[str, np.ndarray]:
        """A copy of each context-rows array, every slot (for inspection)."""
        return {name: buffer.copy() for name, buffer in self._buffers.items()}

    def run_slots(self, calls: dict[int, tuple[dict[str, np.ndarray], list[str]]],
                  active: int) -> dict[int, dict[str, np.ndarray]]:
        """One draft call for `calls` (slot -> a request's feeds [1, ...] and outputs wanted, as its rows-form
        session would take them); `active`: the slots 0..active-1 in use. Returns each slot's outputs [1, ...]."""
        slots = sorted(calls)
        pasts = [int(calls[slot][0]["position_ids"][0, 0]) for slot in slots]
        contexts = [int(calls[slot][0]["target_hidden"].shape[1]) for slot in slots]
        needed = max(past + rows for past, rows in zip(pasts, contexts))
        if needed > self._rows or (len(slots) == active and self._rows - needed >= 2 * STEP_ROWS):
            # grown to the longest context; shrunk only when every request drafts (none holds more rows then)
            self._resize(rows_in_steps(needed, self.capacity, "the draft"))
        count, most = len(slots), max(contexts)
        first = calls[slots[0]][0]
        block = first["input_ids"].shape[1]
        hidden = np.zeros((count, most, first["target_hidden"].shape[2]), first["target_hidden"].dtype)
        positions = np.zeros((count, most + block), np.int64)
        for index, (slot, past, rows) in enumerate(zip(slots, pasts, contexts)):
            feeds = calls[slot][0]
            hidden[index, :rows] = feeds["target_hidden"][0]
            positions[index, :rows] = feeds["position_ids"][0, :rows]
            positions[index, rows:most] = past  # padding rows: masked, their K/V dropped
            positions[index, most:] = feeds["position_ids"][0, rows:]
        consecutive = slots == list(range(slots[0], slots[0] + count))
        feeds = {"input_ids": np.concatenate([calls[slot][0]["input_ids"] for slot in slots]),
                 "target_hidden": hidden, "position_ids": positions,
                 KEY_MASK_INPUTS[0]: np.array(pasts, np.int64), KEY_MASK_INPUTS[1]: np.array(contexts, np.int64)}
        for past, buffer in self._buffers.items():
            feeds[past] = buffer[slots[0] : slots[0] + count] if consecutive else buffer[slots]
        names = sorted({name for slot in slots for name in calls[slot][1] if name not in dict(self._pairs).values()})
        out = run_plain(self._session, self.path.name, feeds, names + [rows for _, rows in self._pairs])
        for index, (slot, past, rows) in enumerate(zip(slots, pasts, contexts)):
            for past_name, rows_name in self._pairs:
                self._buffers[past_name][slot, past : past + rows] = out[rows_name][index, :rows]
        return {slot: {name: out[name][index : index + 1] for name in calls[slot][1] if name in names}
                for index, slot in enumerate(slots)}
