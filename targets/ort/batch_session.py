"""The ragged-attention target (passes/kv_ragged.py) holding K/V for several requests: [slots, kv_heads, rows,
head_dim] buffers, one slot (batch row) per request, bound as both input and output so that TensorScatter writes
them in place. A call over slots first..first + batch - 1 binds views of those slots (the slot is the buffers'
outermost axis, so any contiguous range is one block of memory); runtime/batching.py decides which calls run
together. The buffers' row count follows the longest context in use, in steps (targets/kv_rows.rows_in_steps): ONNX
Attention reads every row of them on each call."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.errors import DFlashError
from runtime.manifest import Manifest
from runtime.recurrent import output_names as recurrent_outputs

from ..kv_rows import STEP_ROWS, rows_in_steps
from .session import OrtBufferSession, bind_host_inputs, buffer_attention, run_bound


def batch_refusal(manifest: Manifest) -> str | None:
    """Why this directory's target cannot decode requests side by side (None: it can)."""
    if manifest.backend != "ort" or manifest.form != "buffer":
        return (f"batching needs an ORT lowering in the buffer form (this directory: {manifest.backend or 'export'}, "
                f"{manifest.form} form): lower with --target ort --kv-attention ragged")
    if buffer_attention(manifest) != "ragged":
        return ("batching needs the ragged attention (TensorScatter + ONNX Attention; GroupQueryAttention takes one "
                "request a call): lower again with --kv-attention ragged")
    if manifest.lowering.provider != "cpu":
        return f"batching runs on the CPU provider only so far (this lowering: {manifest.lowering.provider})"
    return None


class OrtBatchSession:
    """K/V for `slots` requests over the single-request session's ONNX Runtime session (its weights loaded once)."""

    def __init__(self, single: OrtBufferSession, manifest: Manifest, slots: int):
        if slots < 1:
            raise DFlashError(f"--max-batch must be at least 1, got {slots}")
        self._session, self.path = single._session, single.path
        self.input_names, self.output_names = single.input_names, single.output_names
        self.slots, self.capacity = slots, single.capacity
        self.active = 0  # slots 0..active-1 hold requests (the batcher sets it; see the shrinking in run_slots)
        self._graph, self._dtype = manifest.target, manifest.numpy_dtype
        self._pairs = list(zip(self._graph.kv_inputs, self._graph.kv_outputs))
        self._buffers: dict[str, np.ndarray] = {}
        self._rows = 0
        self._binding = self._session.io_binding()
        self._specs = {t.name: t for t in self._graph.outputs if t.name not in set(self._graph.kv_outputs)}
        # a hybrid target's linear-attention state outputs: not sized by the call's rows alone (conv rows)
        self._state = {n for layer in self._graph.recurrent.layers for n in recurrent_outputs(layer)} \
            if self._graph.recurrent else set()
        self._inputs: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # per input: the array bound, refilled
        self._outputs: dict[tuple[str, int, int], np.ndarray] = {}  # per output, batch and rows: written by ORT
        self._bound: tuple | None = None

    def _resize(self, rows: int) -> None:
        """Buffers of `rows` rows holding the first rows of the old ones."""
        kept = min(rows, self._rows)
        for past, _ in self._pairs:
            heads, dim = self._graph.kv_shape(past)
            resized = np.zeros((self.slots, heads, rows, dim), self._dtype)
            if past in self._buffers:
                resized[:, :, :kept] = self._buffers[past][:, :, :kept]
            self._buffers[past] = resized
        self._rows = rows

    def move_slot(self, source: int, dest: int) -> None:
        for buffer in self._buffers.values():
            buffer[dest] = buffer[source]

    def kv_buffers(self) -> dict[str, np.ndarray]:
        """A copy of each K/V buffer, every slot (for inspection)."""
        return {name: buffer.copy() for name, buffer in self._buffers.items()}

    def run_slots(self, first: int, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        count, kv = int(feeds["input_ids"].shape[0]), set(self._graph.kv_outputs)
        names = [name for name in names if name not in kv]  # K/V stay in the slots' buffers
        if first < 0 or first + count > self.slots:
            raise DFlashError(f"slots {first}..{first + count - 1} lie outside the {self.slots} this session holds")
        needed = int(feeds["total_sequence_length"])
        if needed > self._rows:
            self._resize(rows_in_steps(needed, self.capacity, self.path.name))
        elif first == 0 and count == self.active and self._rows - needed >= 2 * STEP_ROWS:
            # a call over every active slot shows the longest context in use: the buffers shrink to it (each call
            # pays for every row they hold), free slots hold nothing
            self._resize(rows_in_steps(needed, self.capacity, self.path.name))
        rows = int(feeds["input_ids"].shape[1])
        if self._state.intersection(names):
            return self._run_with_state(first, count, feeds, names)
        key = (first, count, rows, tuple(names), self._rows)
        if key != self._bound:  # a step like the last (same slots, rows, outputs) binds nothing anew
            self._bind(first, count, rows, names, feeds)
            self._bound = key
        for name, value in feeds.items():
            np.copyto(self._inputs[name][0], value)
        run_bound(self._session, self._binding, self.path.name)
        return {name: self._outputs[(name, count, rows)].copy() for name in names}

    def _run_with_state(self, first: int, count: int, feeds: dict[str, np.ndarray],
                        names: list[str]) -> dict[str, np.ndarray]:
        """A call that also returns a hybrid target's linear-attention state (conv rows past + new, states,
        pending rows: shapes the call's rows alone do not give): K/V in the slots' buffers as in run_slots, every
        other input and output bound anew on the host."""
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        kept = bind_host_inputs(binding, feeds)  # noqa: F841 - alive until the run ends
        for name in names:  # bound first: get_outputs() lists the outputs in binding order
            binding.bind_output(name, "cpu")
        self._bind_kv(first, count)
        self._bound = None
        run_bound(self._session, binding, self.path.name)
        return {name: value.numpy() for name, value in zip(names, binding.get_outputs())}

    def _bind_kv(self, first: int, count: int) -> None:
        for past, present in self._pairs:  # a view of the slots' block, both read and written in place
            view = self._buffers[past][first : first + count]
            self._binding.bind_input(past, "cpu", 0, self._dtype, list(view.shape), view.ctypes.data)
            self._binding.bind_output(present, "cpu", 0, self._dtype, list(view.shape), view.ctypes.data)

    def _bind(self, first: int, count: int, rows: int, names: list[str], feeds: dict[str, np.ndarray]) -> None:
        """Bind inputs and outputs to arrays kept per shape, and the K/V to views of slots first..first+count-1."""
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        for name, value in feeds.items():
            kept = self._inputs.get(name)
            if kept is None or kept[0].shape != value.shape or kept[0].dtype != value.dtype:
                array = np.empty(value.shape, value.dtype)
                kept = self._inputs[name] = (array, ort.OrtValue.ortvalue_from_numpy(array))
            binding.bind_ortvalue_input(name, kept[1])
        self._bind_kv(first, count)
        for name in names:
            if (name, count, rows) not in self._outputs:
                spec = self._specs[name]
                shape = [count if dim == "batch" else rows if isinstance(dim, str) else dim for dim in spec.shape]
                self._outputs[(name, count, rows)] = np.empty(shape, np.dtype(spec.dtype))
            array = self._outputs[(name, count, rows)]
            binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
