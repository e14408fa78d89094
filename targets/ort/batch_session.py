"""The ragged-attention target (passes/kv_ragged.py) holding K/V for several requests: [slots, kv_heads, rows,
head_dim] buffers on the provider's device, one slot (batch row) per request, bound as both input and output so
that TensorScatter writes them in place. A call over slots first..first + batch - 1 binds those slots' block (the
slot is the buffers' outermost axis, so any contiguous range is one block of memory); dflash_onnx/runtime/batching.py
decides
which calls run together. The buffers' row count follows the longest context in use, in steps
(targets/kv_rows.rows_in_steps): ONNX Attention reads every row of them on each call."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.runtime.recurrent import output_names as recurrent_outputs
from dflash_onnx.targets.kv_rows import STEP_ROWS, rows_in_steps
from dflash_onnx.targets.ort.session import OrtBufferSession, bind_host_inputs, buffer_attention, refill, run_bound


def batch_refusal(manifest: Manifest) -> str | None:
    """Why this directory's target cannot decode requests side by side (None: it can)."""
    if manifest.backend != "ort" or manifest.form != "buffer":
        return (f"batching needs an ORT lowering in the buffer form (this directory: {manifest.backend or 'export'}, "
                f"{manifest.form} form): lower with --target ort --kv-attention ragged")
    if buffer_attention(manifest) != "ragged":
        return ("batching needs the ragged attention (TensorScatter + ONNX Attention; GroupQueryAttention takes one "
                "request a call): lower again with --kv-attention ragged")
    if manifest.lowering.provider not in ("cpu", "cuda"):
        return f"batching runs on the CPU and CUDA providers only (this lowering: {manifest.lowering.provider})"
    return None


class OrtBatchSession:
    """K/V for `slots` requests over the single-request session's ONNX Runtime session (its weights loaded once)."""

    def __init__(self, single: OrtBufferSession, manifest: Manifest, slots: int):
        if slots < 1:
            raise DFlashError(f"--max-batch must be at least 1, got {slots}")
        self._session, self.path, self.device = single._session, single.path, single.device
        self.input_names, self.output_names = single.input_names, single.output_names
        self.slots, self.capacity = slots, single.capacity
        self.active = 0  # slots 0..active-1 hold requests (the batcher sets it; see the shrinking in run_slots)
        self._graph, self._dtype = manifest.target, manifest.numpy_dtype
        self._pairs = list(zip(self._graph.kv_inputs, self._graph.kv_outputs))
        self._buffers: dict[str, np.ndarray | ort.OrtValue] = {}  # host arrays on the CPU, else device values
        # off the CPU: K/V as device values, and the small inputs bound again every call (ORT copies a host input
        # to the device when it is bound, not when the graph runs)
        self._on_device = self.device != "cpu"
        self._rows = 0
        self._binding = self._session.io_binding()
        self._specs = {t.name: t for t in self._graph.outputs if t.name not in set(self._graph.kv_outputs)}
        # a hybrid target's linear-attention state outputs: not sized by the call's rows alone (conv rows)
        self._state = {n for layer in self._graph.recurrent.layers for n in recurrent_outputs(layer)} \
            if self._graph.recurrent else set()
        self._inputs: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # per input: the array bound, refilled
        self._outputs: dict[tuple[str, int, int], np.ndarray] = {}  # per output, batch and rows: written by ORT
        self._bound: tuple | None = None

    def _host(self, past: str) -> np.ndarray:
        """Buffer `past` as a host array: the buffer itself on the CPU, a copy of a device value (a value on the CPU
        would hand back a view: copied too, so its changes go through update_inplace as on a device)."""
        buffer = self._buffers[past]
        return buffer if isinstance(buffer, np.ndarray) else np.array(buffer.numpy())

    def _resize(self, rows: int) -> None:
        """Buffers of `rows` rows holding the first rows of the old ones (through the host from a device: resizing
        happens once per STEP_ROWS tokens of the longest context)."""
        kept = min(rows, self._rows)
        for past, _ in self._pairs:
            heads, dim = self._graph.kv_shape(past)
            resized = np.zeros((self.slots, heads, rows, dim), self._dtype)
            if past in self._buffers:
                resized[:, :, :kept] = self._host(past)[:, :, :kept]
            self._buffers[past] = ort.OrtValue.ortvalue_from_numpy(resized, self.device, 0) if self._on_device \
                else resized
        self._rows = rows

    def move_slot(self, source: int, dest: int) -> None:
        for past, buffer in self._buffers.items():
            host = self._host(past)
            host[dest] = host[source]
            if not isinstance(buffer, np.ndarray):  # the same device memory, so the bound pointers still hold
                buffer.update_inplace(host)

    def kv_buffers(self) -> dict[str, np.ndarray]:
        """A copy of each K/V buffer, every slot (for inspection)."""
        return {name: self._host(name).copy() for name in self._buffers}

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
        for name, value in feeds.items():
            refill(self._inputs, name, value)
        key = (first, count, rows, tuple(names), self._rows)
        if key != self._bound:  # a step like the last (same slots, rows, outputs) binds nothing anew
            self._bind(first, count, rows, names, list(feeds))
            self._bound = key
        elif self._on_device:
            for name in feeds:
                self._binding.bind_ortvalue_input(name, self._inputs[name][1])
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
        for past, present in self._pairs:  # the slots' block of each buffer, both read and written in place
            buffer, (heads, dim) = self._buffers[past], self._graph.kv_shape(past)
            start = buffer.ctypes.data if isinstance(buffer, np.ndarray) else buffer.data_ptr()
            start += first * heads * self._rows * dim * np.dtype(self._dtype).itemsize
            shape = [count, heads, self._rows, dim]
            self._binding.bind_input(past, self.device, 0, self._dtype, shape, start)
            self._binding.bind_output(present, self.device, 0, self._dtype, shape, start)

    def _bind(self, first: int, count: int, rows: int, names: list[str], inputs: list[str]) -> None:
        """Bind the (filled) inputs and the outputs to arrays kept per shape, and the K/V to slots
        first..first+count-1."""
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        for name in inputs:
            binding.bind_ortvalue_input(name, self._inputs[name][1])
        self._bind_kv(first, count)
        for name in names:
            if (name, count, rows) not in self._outputs:
                spec = self._specs[name]
                shape = [count if dim == "batch" else rows if isinstance(dim, str) else dim for dim in spec.shape]
                self._outputs[(name, count, rows)] = np.empty(shape, np.dtype(spec.dtype))
            array = self._outputs[(name, count, rows)]
            binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
