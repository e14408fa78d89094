"""The one interface every backend implements; the decoding loop depends on nothing else."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Session(Protocol):
    """A loaded graph: named numpy inputs in, named numpy outputs out.

    `retains_state` is True when the session keeps the graph's K/V state itself (on the device, or in
    buffers the graph updates in place): the runners then feed no K/V. False: K/V outputs come back
    with the other outputs and the runners feed them in again.
    """

    input_names: list[str]
    output_names: list[str]
    retains_state: bool

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run the graph; `output_names` limits what is returned (None: every output)."""
        ...
