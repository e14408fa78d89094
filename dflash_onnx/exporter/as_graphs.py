"""The PyTorch pair called as its exported graphs are: numpy feeds by the graphs' input names in, numpy outputs by
their output names out. `parity` walks the graphs and the pair through the same calls with it, and can walk a
rounded copy of the pair (dflash_onnx/exporter/rounded.py) through the very same feeds."""

from __future__ import annotations

import numpy as np
import torch

from dflash_onnx.exporter.models.draft import DFlashDraft
from dflash_onnx.exporter.models.target import TappedTarget
from dflash_onnx.runtime.manifest import Manifest

NEXT_TOKEN = "next_token"  # the target's argmax per row, which the graphs do not return


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().numpy() if tensor.is_floating_point() else tensor.detach().numpy()


class _Graph:
    def __init__(self, call, module: torch.nn.Module):
        self._call, self._module = call, module

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """A feed as the module takes it: hidden states and K/V at the module's precision now (a rounded copy may
        run in float16), other feeds as they are."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        dtype = next(self._module.parameters()).dtype
        return tensor.to(dtype) if tensor.is_floating_point() and tensor.dim() > 2 else tensor

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            return self._call(feeds)


class TorchGraphs:
    """`target.run(feeds)` and `draft.run(feeds)` over the PyTorch modules, named as in `manifest`."""

    def __init__(self, manifest: Manifest, tapped: TappedTarget, draft: DFlashDraft):
        self.manifest, self.tapped, self.draft_module = manifest, tapped, draft
        self.target = _Graph(self._target, tapped.lm)
        self.draft = _Graph(self._draft, draft)

    def _target(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        state_in, state_out = self.tapped.state_names()
        graph = self.target
        out = self.tapped(graph.tensor(feeds["input_ids"]), graph.tensor(feeds["position_ids"]),
                          *[graph.tensor(feeds[name]) for name in state_in])
        return {"logits": _numpy(out[0]), NEXT_TOKEN: _numpy(out[1]), "target_hidden": _numpy(out[2]),
                **{name: _numpy(t) for name, t in zip(state_out, out[3:])}}

    def _draft(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        spec, module, graph = self.manifest.draft, self.draft_module, self.draft
        sampling = [graph.tensor(feeds[name]) for name in module.extra_inputs()]
        out = module(graph.tensor(feeds["input_ids"]), graph.tensor(feeds["target_hidden"]),
                     graph.tensor(feeds["position_ids"]), *[graph.tensor(feeds[n]) for n in spec.kv_inputs],
                     *sampling)
        signals = module.signal_outputs()
        present = out[3 + len(signals) + len(module.extra_outputs()):]
        return {"logits": _numpy(out[0]), "draft_confidence": _numpy(out[2]),
                **{name: _numpy(out[3 + i]) for i, name in enumerate(signals)},
                **{name: _numpy(t) for name, t in zip(spec.kv_outputs, present)}}

    def next_state(self, outputs: dict[str, np.ndarray], rows: int, committed: int) -> dict[str, np.ndarray]:
        """The target's state feeds after a call of `rows` tokens that returned `outputs`, keeping `committed`."""
        state_in, state_out = self.tapped.state_names()
        kept = self.tapped.next_state(tuple(torch.from_numpy(outputs[name]) for name in state_out), rows, committed)
        return {name: t.numpy() for name, t in zip(state_in, kept)}
