"""Busy processes that stand in for a user's other work (a browser, an IDE, a second model) while `bench
--load N` times its runs: started here, ended by pid however the measurement ends."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

BUSY_LOOP = "while True: pass"


@contextmanager
def busy_processes(count: int) -> Iterator[list[int]]:
    """`count` processes spinning one core each for the duration of the block; yields their pids."""
    processes = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield [p.pid for p in processes]
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()
