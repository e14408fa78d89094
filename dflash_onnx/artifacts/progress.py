"""Stage-by-stage progress on stderr, so long exports show where they are without polluting stdout."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Stages:
    """Prints `[i/n] name ...` when a stage starts and its duration when it ends."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total = total
        self.index = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._tenths = 0

    def fraction(self, done: int, total: int) -> None:
        """Within a stage: each tenth of `total` reached (bytes written) printed on the stage's line."""
        tenths = 10 * done // max(total, 1)
        if self.enabled and tenths > self._tenths:
            print("".join(f" {10 * t}%" for t in range(self._tenths + 1, tenths + 1)), end="", file=self.stream,
                  flush=True)
        self._tenths = max(self._tenths, tenths)

    def done(self, name: str, seconds: float) -> None:
        """A stage reported once it has ended (`[i/n] name 0.3s`): a stage that fails leaves no half line before
        the one-line error."""
        self.index += 1
        if self.enabled:
            print(f"[{self.index}/{self.total}] {name} {seconds:.1f}s", file=self.stream, flush=True)

    @contextmanager
    def stage(self, name: str):
        self.index += 1
        self._tenths = 0
        start = time.perf_counter()
        if self.enabled:
            print(f"[{self.index}/{self.total}] {name} ...", end="", file=self.stream, flush=True)
        try:
            yield
        except BaseException:
            if self.enabled:
                print(" failed", file=self.stream, flush=True)
            raise
        if self.enabled:
            print(f" {time.perf_counter() - start:.1f}s", file=self.stream, flush=True)
