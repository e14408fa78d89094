"""The one interface every backend implements; the decoding loop depends on nothing else."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Session(Protocol):
    """A loaded graph: named numpy inputs in, named numpy outputs out."""

    input_names: list[str]
    output_names: list[str]

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run the graph; `output_names` limits what is returned (None: every output)."""
        ...
